"""The ensemble "backend": an ensemble has no model file and no instances; its scheduler runs the steps."""

from __future__ import annotations

from geserve.backends.base import BackendKind, BackendSettings, InferenceHost, ModelInstance, ModelSource
from geserve.config import ModelConfig
from geserve.config.ensemble import ENSEMBLE_PLATFORM
from geserve.metrics.custom import CustomMetricStore


class EnsembleBackend:
    name = "ensemble"
    default_model_filename = ""  # Triton prints an ensemble's as empty

    def __init__(self, settings: BackendSettings, host: InferenceHost) -> None:
        self.host = host

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        """Nothing to read: an ensemble's inputs and outputs are what its config says."""

    def create_instances(self, config: ModelConfig, source: ModelSource) -> list[ModelInstance]:
        return []


def _create(settings: BackendSettings, host: InferenceHost, custom_metrics: CustomMetricStore) -> EnsembleBackend:
    return EnsembleBackend(settings, host)


# An ensemble keeps its `backend` empty, as Triton prints it.
BACKEND_KIND = BackendKind(names=("ensemble",), create=_create, platforms={ENSEMBLE_PLATFORM: ""})
