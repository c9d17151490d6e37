"""Protocol-neutral request and response types that travel from a frontend to a backend and back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from geserve.types.streams import ResponseStream


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
class ComputeTimes:
    """Compute time of executions, in Triton's three phases (ns)."""

    input_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0

    def add(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.input_ns += input_ns
        self.infer_ns += infer_ns
        self.output_ns += output_ns

    def add_times(self, other: ComputeTimes) -> None:
        self.add(other.input_ns, other.infer_ns, other.output_ns)


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
    # Set on an ensemble's step requests: the compute of each batch this request runs in is added here, so the
    # ensemble reports the compute of its steps, as Triton's does.
    compute: ComputeTimes | None = None
    # Set by the service for a decoupled model: where the backend sends each response as the model produces it.
    stream: ResponseStream | None = None


@dataclass(slots=True)
class InferenceResponse:
    model_name: str
    model_version: str
    outputs: list[OutputTensor]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
