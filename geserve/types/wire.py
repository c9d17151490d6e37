"""Tensor bytes as both wire protocols carry them: raw little-endian elements, or length-prefixed BYTES."""

from __future__ import annotations

import struct

import numpy as np

from geserve.types.tensors import Tensor

LENGTH_PREFIX = struct.Struct("<I")


def tensor_bytes(tensor: Tensor, copy: bool = False) -> bytes | memoryview:
    """A tensor's wire bytes: a view of the array's memory (a copy if asked), or prefixed BYTES elements."""
    data = tensor.data
    if tensor.datatype == "BYTES":
        parts = []
        for value in data.reshape(-1):
            item = value if isinstance(value, bytes) else str(value).encode()
            parts.append(LENGTH_PREFIX.pack(len(item)))
            parts.append(item)
        return b"".join(parts)
    contiguous = np.ascontiguousarray(data)
    return contiguous.tobytes() if copy else memoryview(contiguous.reshape(-1).view(np.uint8))
