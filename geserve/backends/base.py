"""The Backend / ModelInstance protocols every backend implements, and what a backend is given to load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from geserve.config import ModelConfig
from geserve.errors import GeserveError
from geserve.types import InferenceRequest, InferenceResponse
from geserve.types.streams import StreamResponse


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """Server-wide options for one backend, from `--backend-config=<backend>,key=value`."""

    values: dict[str, str] = field(default_factory=dict)

    def get_int(self, key: str, default: int) -> int:
        raw = self.values.get(key)
        return default if raw is None else int(raw)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where one version of a model lives on disk."""

    model_dir: Path
    version: int

    @property
    def version_dir(self) -> Path:
        return self.model_dir / str(self.version)


class InferenceHost(Protocol):
    """The server's own data plane as models see it: BLS calls and ensemble steps go through it."""

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Run `request` on its model (validation, scheduler, statistics), as a frontend would."""
        ...

    # The event loop `infer` runs on, for calls made from other threads (a Python model's BLS requests).
    loop: asyncio.AbstractEventLoop | None

    def infer_stream(self, request: InferenceRequest) -> AsyncIterator[StreamResponse]:
        """Every response of `request` as it is sent (any number for a decoupled model, one otherwise), the
        last one flagged final; faults found before the model runs are raised, later ones come as items."""
        ...


class ModelInstance(Protocol):
    """One execution context of a model version; `execute` is synchronous and runs off the event loop."""

    name: str

    def execute(self, requests: list[InferenceRequest]) -> list[InferenceResponse | GeserveError]: ...

    def finalize(self) -> None: ...


class Backend(Protocol):
    name: str
    default_model_filename: str

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        """Fill what `config` leaves out (inputs, outputs, max_batch_size) from the model file."""

    def create_instances(self, config: ModelConfig, source: ModelSource) -> list[ModelInstance]:
        """Load the model and build one instance per execution context of its instance groups."""
        ...
