"""What every backend implements (Backend, and ModelInstance with the Execution it returns) and what a backend is
given to load."""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from geserve.config import ModelConfig
from geserve.errors import GeserveError
from geserve.metrics.custom import CustomMetricStore
from geserve.types import ComputeTimes, InferenceRequest, InferenceResponse
from geserve.types.streams import StreamResponse

# One entry per request of a batch, in order: its response, or the error that request failed with.
Results = list[InferenceResponse | GeserveError]


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
    """The server's inference service as models see it: BLS calls and ensemble steps go through it."""

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        """Run `request` on its model (validation, scheduler, statistics), as a frontend would."""
        ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop `infer` runs on, for calls made from other threads (a Python model's BLS requests)."""
        ...

    def infer_stream(self, request: InferenceRequest) -> AsyncGenerator[StreamResponse, None]:
        """Every response of `request` as it is sent (any number for a decoupled model, one otherwise), the
        last one flagged final; faults found before the model runs are raised, later ones come as items."""
        ...


@dataclass(slots=True)
class Execution:
    """What one `execute` produced: a result per request, and the batch's compute time in Triton's three phases."""

    results: Results
    compute: ComputeTimes

    @classmethod
    def timed(cls, results: Results, started_ns: int) -> Execution:
        """For an instance that cannot tell its phases apart: everything since `started_ns` counts as infer time."""
        return cls(results, ComputeTimes(0, time.monotonic_ns() - started_ns, 0))


class ModelInstance(abc.ABC):
    """One execution context of a model version, as the instance pool drives it: one batch at a time, on the
    instance's own worker thread, or on the event loop when the instance opts in (`inline_allowed`) and its runs
    are short (geserve/scheduling/pool.py)."""

    name: str
    # True only where `execute` is pure CPU work that returns on its own: the pool judges "short" by the loop
    # thread's CPU time, which does not see a wait (a device, a disk, a socket, a call back into the loop), so an
    # instance that may wait would hold every connection of the process while it does. Opting in is a measured
    # claim; the safe default is the instance's own worker thread.
    inline_allowed: bool = False

    @property
    def checks_readiness(self) -> bool:
        """Whether `is_ready` asks the model itself (Triton's instance-ready hook); fixed once initialized."""
        return False

    def is_ready(self) -> bool:
        """The model's own readiness, asked on a helper thread, possibly while the instance executes."""
        return True

    @abc.abstractmethod
    def execute(self, requests: list[InferenceRequest]) -> Execution:
        """Run `requests` as one batch (synchronously): a result per request, in order, and the compute time.
        A failure of one request is its result; an exception fails the whole batch."""

    def finalize(self) -> None:  # noqa: B027 - a default on purpose: an instance may hold nothing to release
        """Release what the instance holds; called once, after its last execution."""


class Backend(Protocol):
    name: str
    default_model_filename: str

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        """Fill what `config` leaves out (inputs, outputs, max_batch_size) from the model file."""

    def create_instances(self, config: ModelConfig, source: ModelSource) -> Sequence[ModelInstance]:
        """Load the model and build one instance per execution context of its instance groups."""
        ...


# Builds a backend from its `--backend-config` settings, the server's inference service and the custom metric store.
BackendFactory = Callable[[BackendSettings, InferenceHost, CustomMetricStore], Backend]


@dataclass(frozen=True, slots=True)
class BackendKind:
    """How a backend package declares itself to the registry: the config names and files that select it."""

    # The `backend` names it serves; the first also names the `--backend-config` settings they all read.
    names: tuple[str, ...]
    create: BackendFactory
    # platform -> the `backend` a config with only that platform gets ("": none, as Triton prints an ensemble's)
    platforms: Mapping[str, str] = field(default_factory=dict)
    # backend -> the `platform` a config with only that backend gets, as Triton fills it in
    implied_platforms: Mapping[str, str] = field(default_factory=dict)
    # model file -> (platform, backend) of a config naming neither whose version folder holds that file
    model_files: Mapping[str, tuple[str, str]] = field(default_factory=dict)
