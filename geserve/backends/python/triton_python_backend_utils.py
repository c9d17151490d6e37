"""The `triton_python_backend_utils` module Triton Python models import (as `pb_utils`), served in-process.

Written from Triton's documented Python-backend API. The Python backend registers this module under its
Triton name in `sys.modules`, so `import triton_python_backend_utils as pb_utils` in a model.py needs no setup.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from geserve.backends.python.logger import Logger, LogLevel
from geserve.backends.python.messages import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_MEMORY_CPU_PINNED,
    TRITONSERVER_MEMORY_GPU,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
    InferenceRequest,
    InferenceResponse,
    InferenceResponseSender,
    PreferredMemory,
    TritonError,
    TritonModelException,
)
from geserve.backends.python.metrics import MetricFamily
from geserve.backends.python.model_config import ModelConfig
from geserve.backends.python.tensor import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    numpy_to_triton_type,
    triton_string_to_numpy,
    triton_to_numpy_type,
)

__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_CPU_PINNED",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "LogLevel",
    "Logger",
    "MetricFamily",
    "ModelConfig",
    "PreferredMemory",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "using_decoupled_model_transaction_policy",
]

_LENGTH = struct.Struct("<I")


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input called `name`, or None."""
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output called `name`, or None."""
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def _config_entry(model_config: dict[str, Any], kind: str, name: str) -> dict[str, Any] | None:
    for entry in model_config.get(kind, []):
        if entry.get("name") == name:
            return entry
    return None


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The `input` entry called `name` of a model config dict (json.loads(args["model_config"])), or None."""
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The `output` entry called `name` of a model config dict, or None."""
    return _config_entry(model_config, "output", name)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """BYTES elements as one uint8 array of 4-byte little-endian lengths each followed by its bytes."""
    if input_tensor.size == 0:
        return None
    parts = []
    for value in input_tensor.reshape(-1, order="C"):
        item = value if isinstance(value, bytes) else str(value).encode("utf-8")
        parts.append(_LENGTH.pack(len(item)))
        parts.append(item)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    """The inverse of `serialize_byte_tensor`: a flat object array of bytes."""
    buffer = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else bytes(encoded_tensor)
    items, offset = [], 0
    while offset < len(buffer):
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += _LENGTH.size
        items.append(buffer[offset : offset + length])
        offset += length
    return np.array(items, dtype=np.object_)
