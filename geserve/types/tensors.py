"""Protocol-neutral request and response types that travel from a frontend to a backend and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass(slots=True)
class RequestedOutput:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)

    @property
    def classification(self) -> int:
        return int(self.parameters.get("classification", 0) or 0)


@dataclass(slots=True)
class InferenceRequest:
    model_name: str
    model_version: str  # "" picks the model's latest ready version
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] | None = None  # None: every output of the model
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    timeout_us: int = 0
    # Set by the data plane once validated: rows this request contributes to a batch (1 without batching).
    batch_size: int = 1
    # Set on an ensemble's step requests: the compute (input, infer, output ns) of each batch this request runs
    # in is added here, so the ensemble reports the compute of its steps, as Triton's does.
    compute_sink: list[int] | None = None
    # Set by the data plane for a decoupled model: its ResponseStream (geserve.types.streams), where the backend
    # sends each response as the model produces it.
    responses: Any = None


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
