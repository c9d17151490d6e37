"""Core value types shared by every layer: datatypes, tensors, requests and responses."""

from geserve.types.datatypes import BY_CONFIG, BY_WIRE, DataType, from_numpy
from geserve.types.tensors import (
    ComputeTimes,
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    RequestedOutput,
    Tensor,
)

__all__ = [
    "BY_CONFIG",
    "BY_WIRE",
    "ComputeTimes",
    "DataType",
    "InferenceRequest",
    "InferenceResponse",
    "InputTensor",
    "OutputTensor",
    "RequestedOutput",
    "Tensor",
    "from_numpy",
]
