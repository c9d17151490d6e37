"""A loaded model version as the service sees it: config, scheduler, statistics and precomputed checks."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tritonclient.grpc.model_config_pb2 import ModelInput, ModelOutput

from geserve.config import ModelConfig
from geserve.scheduling.admission import Admission
from geserve.scheduling.base import Scheduler
from geserve.statistics import ModelStatistics
from geserve.types.datatypes import BY_CONFIG


class ModelState(enum.Enum):
    UNKNOWN = "UNKNOWN"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    wire_type: str
    dtype: np.dtype[np.generic]
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(slots=True)
class LoadedModel:
    name: str
    version: int
    config: ModelConfig
    scheduler: Scheduler
    statistics: ModelStatistics
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    labels: dict[str, list[str]] = field(default_factory=dict)
    input_order: tuple[str, ...] = ()
    # The instances' own readiness checks (Python models' `is_ready`); None when no instance has one.
    readiness: Callable[[], Awaitable[bool]] | None = None
    # model_transaction_policy.decoupled: any number of responses per request, served by infer_stream only
    decoupled: bool = False
    # The folder it was loaded from: the manager keeps a load request's private folder while a version serves from it.
    model_dir: Path | None = None
    # response_cache { enable: true } with a server cache configured (--cache-config), decided once at load so that a
    # model without it costs the infer path one attribute test: 0 when not cached, else a number no other load gets,
    # part of the cache key: a reloaded model never answers with the answers of the one it replaced.
    response_cache: int = 0
    # Admission control (scheduling/admission.py) when overload control is on for this model, else None: all a
    # request then pays is this attribute test.
    admission: Admission | None = None
    # Requests of this version under way, from the service's submit to their answer (the service counts them): the
    # memory budget never unloads a model with any (repository/budget.py).
    users: int = 0
    # Bytes this version costs the server, measured at load with a memory budget (repository/memory.py); 0 unmeasured.
    memory: int = 0

    @property
    def max_batch_size(self) -> int:
        return self.config.max_batch_size


def tensor_specs(tensors: Iterable[ModelInput | ModelOutput]) -> dict[str, TensorSpec]:
    specs = {}
    for tensor in tensors:
        datatype = BY_CONFIG[tensor.data_type]
        specs[tensor.name] = TensorSpec(
            tensor.name, datatype.wire, datatype.numpy, tuple(tensor.dims), getattr(tensor, "optional", False)
        )
    return specs


@dataclass(slots=True)
class VersionStatus:
    state: ModelState
    reason: str = ""
    model: LoadedModel | None = None
