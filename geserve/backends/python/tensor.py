"""`pb_utils.Tensor` over a numpy array, and the Triton type <-> numpy tables Python models use."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from geserve.types import Tensor as CoreTensor
from geserve.types import from_numpy

# model_config DataType names and numbers (TYPE_FP32 == 11, ...), as Python models spell them.
TRITON_STRING_TO_NUMPY: dict[str, type] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    "TYPE_BF16": ml_dtypes.bfloat16,
}
_TYPE_NUMBERS = {
    "TYPE_BOOL": 1, "TYPE_UINT8": 2, "TYPE_UINT16": 3, "TYPE_UINT32": 4, "TYPE_UINT64": 5, "TYPE_INT8": 6,
    "TYPE_INT16": 7, "TYPE_INT32": 8, "TYPE_INT64": 9, "TYPE_FP16": 10, "TYPE_FP32": 11, "TYPE_FP64": 12,
    "TYPE_STRING": 13, "TYPE_BF16": 14,
}
_NUMBER_TO_NUMPY = {_TYPE_NUMBERS[name]: numpy_type for name, numpy_type in TRITON_STRING_TO_NUMPY.items()}
_NUMPY_TO_NUMBER = {np.dtype(numpy_type): number for number, numpy_type in _NUMBER_TO_NUMPY.items()}


def triton_string_to_numpy(triton_type_string: str) -> type:
    """'TYPE_FP32' -> np.float32 ('TYPE_STRING' -> np.object_)."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> type | None:
    """A model_config DataType number (11) -> its numpy type (np.float32); None when it has none."""
    return _NUMBER_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """A numpy type or dtype -> its model_config DataType number; bytes and str arrays are TYPE_STRING."""
    dtype = np.dtype(data_type)
    if dtype.kind in ("O", "S", "U"):
        return _TYPE_NUMBERS["TYPE_STRING"]
    return _NUMPY_TO_NUMBER.get(dtype)


class _Capsule:
    """Lets numpy import a bare DLPack capsule (numpy only takes objects with `__dlpack__`)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


class Tensor:
    """A named tensor. It holds the numpy array it was given (no copy), and hands it on the same way."""

    __slots__ = ("_array", "_name")

    def __init__(self, name: str, data: Any) -> None:
        array = data if isinstance(data, np.ndarray) else np.asarray(data)
        if array.dtype.kind not in ("O", "S", "U") and array.dtype not in _NUMPY_TO_NUMBER:
            raise TypeError(f"tensor '{name}': numpy dtype {array.dtype} has no Triton datatype")
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, dlpack: Any) -> Tensor:
        """From any object with `__dlpack__` (a torch tensor, a numpy array) or a DLPack capsule; CPU only."""
        source = dlpack if hasattr(dlpack, "__dlpack__") else _Capsule(dlpack)
        return Tensor(name, np.from_dlpack(source))

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, shape={self._array.shape}, dtype={self._array.dtype})"

    # ---- geserve side ---------------------------------------------------------------------------------

    @classmethod
    def _from_core(cls, tensor: CoreTensor) -> Tensor:
        wrapped = cls.__new__(cls)
        wrapped._name = tensor.name
        wrapped._array = tensor.data
        return wrapped

    def _to_core(self) -> CoreTensor:
        array = self._array
        datatype = from_numpy(array.dtype).wire
        return CoreTensor(self._name, datatype, tuple(array.shape), array)
