"""The ensemble "backend": an ensemble has no model file and no instances; its scheduler runs the steps."""

from __future__ import annotations

from geserve.backends.base import BackendSettings, InferenceHost, ModelInstance, ModelSource
from geserve.config import ModelConfig


class EnsembleBackend:
    name = "ensemble"
    default_model_filename = ""  # Triton prints an ensemble's as empty

    def __init__(self, settings: BackendSettings, host: InferenceHost) -> None:
        self.host = host

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        """Nothing to read: an ensemble's inputs and outputs are what its config says."""

    def create_instances(self, config: ModelConfig, source: ModelSource) -> list[ModelInstance]:
        return []
