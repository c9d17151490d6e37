"""Protocol-neutral tensors and responses that travel from a backend back to a frontend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass(slots=True)
class Tensor:
    """A named tensor: `data` is a numpy array (object dtype of bytes for BYTES), `datatype` its wire name."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


# Inputs and outputs are the same thing travelling in opposite directions.
InputTensor = Tensor
OutputTensor = Tensor


class ShmLocation(NamedTuple):
    """Where a tensor lives in a registered system shared memory region."""

    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)
    # Set when the client placed this output in shared memory: the service writes it there, and the frontend
    # answers it without data.
    shm: ShmLocation | None = None

    @property
    def classification(self) -> int:
        return int(self.parameters.get("classification", 0) or 0)


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
