"""The datatype table: config enum (TYPE_FP32) <-> wire name ("FP32") <-> numpy dtype, in one place."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from tritonclient.grpc import model_config_pb2


@dataclass(frozen=True, slots=True)
class DataType:
    wire: str  # KServe v2 name, e.g. "FP32"
    config: int  # model_config_pb2.DataType value, e.g. TYPE_FP32
    numpy: np.dtype
    itemsize: int  # 0 for variable-size BYTES

    @property
    def config_name(self) -> str:
        return model_config_pb2.DataType.Name(self.config)


_TABLE = [
    DataType("BOOL", model_config_pb2.TYPE_BOOL, np.dtype(np.bool_), 1),
    DataType("UINT8", model_config_pb2.TYPE_UINT8, np.dtype(np.uint8), 1),
    DataType("UINT16", model_config_pb2.TYPE_UINT16, np.dtype(np.uint16), 2),
    DataType("UINT32", model_config_pb2.TYPE_UINT32, np.dtype(np.uint32), 4),
    DataType("UINT64", model_config_pb2.TYPE_UINT64, np.dtype(np.uint64), 8),
    DataType("INT8", model_config_pb2.TYPE_INT8, np.dtype(np.int8), 1),
    DataType("INT16", model_config_pb2.TYPE_INT16, np.dtype(np.int16), 2),
    DataType("INT32", model_config_pb2.TYPE_INT32, np.dtype(np.int32), 4),
    DataType("INT64", model_config_pb2.TYPE_INT64, np.dtype(np.int64), 8),
    DataType("FP16", model_config_pb2.TYPE_FP16, np.dtype(np.float16), 2),
    DataType("FP32", model_config_pb2.TYPE_FP32, np.dtype(np.float32), 4),
    DataType("FP64", model_config_pb2.TYPE_FP64, np.dtype(np.float64), 8),
    DataType("BF16", model_config_pb2.TYPE_BF16, np.dtype(ml_dtypes.bfloat16), 2),
    DataType("BYTES", model_config_pb2.TYPE_STRING, np.dtype(np.object_), 0),
]

BY_WIRE: dict[str, DataType] = {d.wire: d for d in _TABLE}
BY_CONFIG: dict[int, DataType] = {d.config: d for d in _TABLE}
_BY_NUMPY: dict[np.dtype, DataType] = {d.numpy: d for d in _TABLE}


def from_numpy(dtype: np.dtype) -> DataType:
    """The datatype of a numpy array; unicode and bytes arrays travel as BYTES."""
    if dtype.kind in ("U", "S", "O"):
        return BY_WIRE["BYTES"]
    try:
        return _BY_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"numpy dtype {dtype} has no KServe v2 datatype") from None


# ONNX TensorProto element types -> our table, for auto-complete and metadata.
ONNX_TO_WIRE: dict[int, str] = {
    1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64", 8: "BYTES",
    9: "BOOL", 10: "FP16", 11: "FP64", 12: "UINT32", 13: "UINT64", 16: "BF16",
}
