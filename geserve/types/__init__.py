"""Core value types shared by every layer: datatypes, tensors, requests and responses."""

from geserve.types.datatypes import BY_CONFIG, BY_WIRE, DataType, from_numpy
from geserve.types.requests import ComputeTimes, InferenceRequest, Prepared, id_prefix
from geserve.types.tensors import InferenceResponse, InputTensor, OutputTensor, RequestedOutput, ShmLocation, Tensor

__all__ = [
    "BY_CONFIG",
    "BY_WIRE",
    "ComputeTimes",
    "DataType",
    "InferenceRequest",
    "InferenceResponse",
    "InputTensor",
    "OutputTensor",
    "Prepared",
    "RequestedOutput",
    "ShmLocation",
    "Tensor",
    "from_numpy",
    "id_prefix",
]
