"""KServe v2 HTTP/REST <-> core types: the JSON header, binary tensor data, BYTES framing, raw bodies.

Written by hand rather than with a schema library: this is the hot path, and each input becomes a numpy
view straight into the request body (`np.frombuffer`), never a copy.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

from geserve.errors import InvalidArgumentError
from geserve.repository.model import LoadedModel
from geserve.types import BY_WIRE, InferenceRequest, InferenceResponse, InputTensor, OutputTensor, RequestedOutput

_NUMPY_JSON = orjson.OPT_SERIALIZE_NUMPY
_ORJSON_NATIVE_KINDS = frozenset("biuf")
_LENGTH = struct.Struct("<I")


class RequestParseError(InvalidArgumentError):
    """The body is not a well-formed request (Triton answers these with 500; geserve with 400)."""


def parse_json(body: bytes | memoryview, what: str = "request") -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestParseError(f"failed to parse the {what} JSON buffer: {exc}") from None


# ---- requests ---------------------------------------------------------------------------------------


def decode_infer_request(
    body: bytes, header_length: int | None, model_name: str, version: str, raw_model: LoadedModel | None
) -> InferenceRequest:
    """`header_length` None: the body is all JSON; 0: the body is one raw input (`raw_model` must be set)."""
    if header_length == 0:
        assert raw_model is not None
        return _decode_raw(body, model_name, version, raw_model)
    if header_length is None:
        header_length = len(body)
    elif header_length > len(body):
        raise RequestParseError(
            f"Inference-Header-Content-Length {header_length} is larger than the request body ({len(body)} bytes)"
        )
    header = parse_json(memoryview(body)[:header_length])
    if not isinstance(header, dict):
        raise RequestParseError("the inference request must be a JSON object")
    try:
        items = header["inputs"]
    except KeyError:
        raise RequestParseError("Unable to parse 'inputs': attempt to access non-existing object member 'inputs'") from None
    if not isinstance(items, list):
        raise RequestParseError("Unable to parse 'inputs': expected an array")
    offset = header_length
    inputs = []
    for item in items:
        tensor, offset = _decode_input(item, body, offset)
        inputs.append(tensor)
    if offset != len(body):
        raise RequestParseError(
            f"unexpected additional input data: {len(body) - offset} bytes of binary data are not claimed by "
            f"any input's 'binary_data_size'"
        )
    request = InferenceRequest(model_name, version, inputs)
    request_id = header.get("id")
    if request_id is not None:
        request.id = str(request_id)
    parameters = header.get("parameters")
    if parameters:
        _apply_parameters(request, parameters)
    outputs = header.get("outputs")
    if outputs is not None:
        request.outputs = [_decode_output(o) for o in outputs]
    return request


def _decode_input(item: Any, body: bytes, offset: int) -> tuple[InputTensor, int]:
    if not isinstance(item, dict):
        raise RequestParseError("Unable to parse 'inputs': each input must be a JSON object")
    try:
        name = item["name"]
        datatype_name = item["datatype"]
        shape = item["shape"]
    except KeyError as exc:
        raise RequestParseError(f"Unable to parse input: missing member {exc}") from None
    datatype = BY_WIRE.get(datatype_name)
    if datatype is None:
        raise InvalidArgumentError(f"invalid datatype for input {name}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise RequestParseError(f"Unable to parse 'shape' of input '{name}': expected non-negative integers")
    shape_t = tuple(shape)
    count = 1
    for dim in shape_t:
        count *= dim
    parameters = item.get("parameters") or {}
    size = parameters.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or offset + size > len(body):
            raise RequestParseError(
                f"unexpected binary_data_size {size} for input '{name}': only {len(body) - offset} bytes remain"
            )
        if datatype.wire == "BYTES":
            data = _decode_bytes(name, memoryview(body)[offset : offset + size], count).reshape(shape_t)
        else:
            expected = count * datatype.itemsize
            if size != expected:
                raise InvalidArgumentError(
                    f"unexpected total byte size {size} for input '{name}', expecting {expected} "
                    f"(shape {list(shape_t)}, datatype {datatype.wire})"
                )
            data = np.frombuffer(body, dtype=datatype.numpy, count=count, offset=offset).reshape(shape_t)
        offset += size
        parameters = {k: v for k, v in parameters.items() if k != "binary_data_size"}
    else:
        if "data" not in item:
            raise RequestParseError(f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter")
        data = _json_to_array(name, item["data"], datatype.wire, datatype.numpy, count).reshape(shape_t)
    return InputTensor(name, datatype.wire, shape_t, data, parameters), offset


def _json_to_array(name: str, data: Any, wire: str, dtype: np.dtype, count: int) -> np.ndarray:
    try:
        if wire == "BYTES":
            flat = _flatten(data)
            array = np.empty(len(flat), dtype=object)
            array[:] = [v.encode() if isinstance(v, str) else _not_string(name, v) for v in flat]
        else:
            array = np.asarray(data, dtype=dtype).reshape(-1)
            if wire != "BOOL" and array.size and isinstance(_first(data), bool):
                raise ValueError("booleans given for a numeric input")
    except (ValueError, TypeError, OverflowError) as exc:
        raise RequestParseError(f"Unable to parse 'data' of input '{name}' as {wire}: {exc}") from None
    if array.size != count:
        raise RequestParseError(
            f"Unable to parse 'data': Shape does not match true shape of 'data' field "
            f"(input '{name}': {array.size} elements for a shape of {count})"
        )
    return array


def _first(data: Any) -> Any:
    while isinstance(data, list) and data:
        data = data[0]
    return data


def _not_string(name: str, value: Any) -> bytes:
    raise ValueError(f"BYTES input '{name}' expects strings in JSON, got {type(value).__name__}")


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        return data
    flat: list[Any] = []
    for item in data:
        flat.extend(_flatten(item))
    return flat


def _decode_bytes(name: str, view: memoryview, count: int) -> np.ndarray:
    """BYTES on the wire: each element is a 4-byte little-endian length followed by its bytes."""
    array = np.empty(count, dtype=object)
    offset, end = 0, len(view)
    for index in range(count):
        if offset + 4 > end:
            raise InvalidArgumentError(f"unexpected end of BYTES data for input '{name}' at element {index}")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > end:
            raise InvalidArgumentError(f"BYTES element {index} of input '{name}' runs past its binary data")
        array[index] = bytes(view[offset : offset + length])
        offset += length
    if offset != end:
        raise InvalidArgumentError(
            f"input '{name}' has {end - offset} bytes of BYTES data beyond the {count} elements its shape holds"
        )
    return array


def _apply_parameters(request: InferenceRequest, parameters: Any) -> None:
    if not isinstance(parameters, dict):
        raise RequestParseError("Unable to parse 'parameters': expected an object")
    for key, value in parameters.items():
        if key.startswith("triton_"):
            raise InvalidArgumentError(
                f"parameter keys starting with 'triton_' are reserved for Triton usage and should not be "
                f"specified: '{key}'"
            )
        if key == "priority":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"'priority' must be a non-negative integer, got {value!r}")
            request.priority = value
        elif key == "timeout":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"'timeout' must be a non-negative integer (microseconds), got {value!r}")
            request.timeout_us = value
    request.parameters = parameters


def _decode_output(item: Any) -> RequestedOutput:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise RequestParseError("Unable to parse 'outputs': each output needs a 'name'")
    parameters = item.get("parameters") or {}
    classification = parameters.get("classification")
    if classification is not None and (not isinstance(classification, int) or isinstance(classification, bool)):
        raise InvalidArgumentError(f"'classification' of output '{item['name']}' must be an integer")
    return RequestedOutput(item["name"], parameters)


def _decode_raw(body: bytes, model_name: str, version: str, model: LoadedModel) -> InferenceRequest:
    """Triton's raw binary request: no JSON header, the body is the model's single input."""
    if len(model.inputs) != 1:
        raise InvalidArgumentError(
            f"raw binary request (Inference-Header-Content-Length: 0) needs a model with exactly one input; "
            f"'{model.name}' has {len(model.inputs)}"
        )
    spec = next(iter(model.inputs.values()))
    datatype = BY_WIRE[spec.wire_type]
    if datatype.wire == "BYTES":
        raise InvalidArgumentError(f"raw binary request is not supported for BYTES input '{spec.name}'")
    if len(body) % datatype.itemsize:
        raise InvalidArgumentError(
            f"raw binary request of {len(body)} bytes is not a whole number of {datatype.wire} elements"
        )
    count = len(body) // datatype.itemsize
    fixed = [d for d in spec.dims if d != -1]
    per_row = int(np.prod(fixed)) if fixed else 1
    variable = len(fixed) != len(spec.dims)
    if model.max_batch_size > 0:
        if variable or per_row == 0 or count % per_row:
            raise InvalidArgumentError(
                f"cannot deduce the shape of input '{spec.name}' (dims {list(spec.dims)}) from a raw body "
                f"of {len(body)} bytes"
            )
        shape: tuple[int, ...] = (count // per_row, *spec.dims)
    else:
        if sum(d == -1 for d in spec.dims) > 1 or (not variable and count != per_row) or count % per_row:
            raise InvalidArgumentError(
                f"cannot deduce the shape of input '{spec.name}' (dims {list(spec.dims)}) from a raw body "
                f"of {len(body)} bytes"
            )
        shape = tuple(count // per_row if d == -1 else d for d in spec.dims)
    data = np.frombuffer(body, dtype=datatype.numpy, count=count).reshape(shape)
    request = InferenceRequest(model_name, version, [InputTensor(spec.name, datatype.wire, shape, data)])
    request.parameters = {"binary_data_output": True}
    return request


# ---- responses --------------------------------------------------------------------------------------


def encode_infer_response(
    response: InferenceResponse, request: InferenceRequest
) -> tuple[list[bytes | memoryview], int | None]:
    """The body parts and, when any output travels as binary, the JSON header's length."""
    binary_default = bool(request.parameters.get("binary_data_output", False))
    wanted = {o.name: o.parameters for o in request.outputs} if request.outputs else {}
    outputs_json = []
    binaries: list[bytes | memoryview] = []
    for output in response.outputs:
        binary = wanted.get(output.name, {}).get("binary_data", binary_default)
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if output.parameters:
            entry["parameters"] = dict(output.parameters)
        if binary:
            raw = tensor_bytes(output)
            entry.setdefault("parameters", {})["binary_data_size"] = len(raw)
            binaries.append(raw)
        else:
            entry["data"] = _json_data(output)
        outputs_json.append(entry)
    head: dict[str, Any] = {}
    if response.id:
        head["id"] = response.id
    head["model_name"] = response.model_name
    head["model_version"] = response.model_version
    if response.parameters:
        head["parameters"] = response.parameters
    head["outputs"] = outputs_json
    header = orjson.dumps(head, option=_NUMPY_JSON)
    if not binaries:
        return [header], None
    return [header, *binaries], len(header)


def tensor_bytes(output: OutputTensor) -> bytes | memoryview:
    data = output.data
    if output.datatype == "BYTES":
        parts = []
        for value in data.reshape(-1):
            raw = value if isinstance(value, bytes) else str(value).encode()
            parts.append(_LENGTH.pack(len(raw)))
            parts.append(raw)
        return b"".join(parts)
    return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))


def _json_data(output: OutputTensor) -> Any:
    data = output.data
    if output.datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in data.reshape(-1)]
    if data.dtype.kind in _ORJSON_NATIVE_KINDS and data.dtype.itemsize <= 8 and data.dtype.name != "bfloat16":
        return np.ascontiguousarray(data).reshape(-1)
    return data.astype(np.float32).reshape(-1).tolist()
