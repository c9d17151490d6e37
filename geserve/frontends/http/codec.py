"""KServe v2 HTTP/REST <-> core types: the JSON header, binary tensor data, BYTES framing, raw bodies.

Written by hand rather than with a schema library: this is the hot path, and each input becomes a numpy
view straight into the request body (`np.frombuffer`), never a copy.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson

from geserve.errors import InvalidArgumentError, NotFoundError
from geserve.service.shared_memory import SharedMemoryRegistry
from geserve.types import (
    BY_WIRE,
    DataType,
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    OutputTensor,
    Prepared,
    RequestedOutput,
    ShmLocation,
    id_prefix,
)
from geserve.types.requests import SEQUENCE_PARAMETERS
from geserve.types.wire import FramingError, element_count, split_bytes, tensor_bytes

_NUMPY_JSON = orjson.OPT_SERIALIZE_NUMPY
_ORJSON_NATIVE_KINDS = frozenset("biuf")
# numpy kinds of JSON values each tensor kind accepts: integers for integers, numbers for floats, bools for BOOL.
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "fiu", "V": "fiu"}
_NOT_BOOLEAN = "Unable to parse '{}': attempt to access JSON non-boolean as boolean"
_KIND_NAMES = {"b": "booleans", "i": "integers", "u": "integers", "f": "floats", "U": "strings"}
_SHM = "shared_memory_region"
_NOT_UNSIGNED = "Unable to parse '{}': attempt to access JSON non-unsigned-integer as unsigned-integer"
_NOT_STRING = "Unable to parse '{}': attempt to access JSON non-string as string"
_NOT_OBJECT = "Unable to parse 'parameters': expected an object"


class RequestParseError(InvalidArgumentError):
    """The body is not a well-formed request (Triton answers these with 500; geserve with 400)."""


MAX_JSON_DEPTH = 100  # Triton's limit on nested arrays and objects in a request
_TOO_DEEP = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"
# A JSON string, escapes included: brackets inside strings are no nesting. Written unrolled (no alternation under a
# repeat), so matching is linear.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def parse_json(body: bytes | memoryview, what: str = "request") -> Any:
    """The body's JSON, refused with Triton's words when nested deeper than Triton allows (100 levels).

    orjson's own limit is 1024 levels. The depth is checked after a successful parse and only when the body holds
    more than 100 opening brackets (two C-speed counts), so the usual request pays nothing; such a body has its
    strings blanked and its bracket depth summed with numpy (linear in the body, a fraction of the parse)."""
    value = load_json(body, what)
    refuse_deep_json(body)
    return value


def load_json(body: bytes | memoryview, what: str = "request") -> Any:
    """The body's JSON without the 100-level check, for a handler that validates its fields first (Triton finds a
    repository-index `ready` of the wrong type before any depth); it calls `refuse_deep_json` after them."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc).lower():  # past orjson's own limit
            raise RequestParseError(_TOO_DEEP) from None
        raise RequestParseError(f"failed to parse the {what} JSON buffer: {exc}") from None


def refuse_deep_json(body: bytes | memoryview) -> None:
    """Refuse, in Triton's words, a well-formed JSON body nested deeper than 100 levels."""
    raw = body if isinstance(body, bytes) else body.tobytes()  # a memoryview is only ever a short JSON header
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(raw) > MAX_JSON_DEPTH:
        raise RequestParseError(_TOO_DEEP)


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of a well-formed JSON text nest (0 for a scalar)."""
    steps = _BRACKET_STEP[np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)]
    steps = steps[steps != 0]
    return int(np.cumsum(steps, dtype=np.int64).max()) if steps.size else 0


# ---- requests ---------------------------------------------------------------------------------------


class HeaderLengthError(InvalidArgumentError):
    """An Inference-Header-Content-Length outside the body (Triton answers it from its HTTP layer, as text/plain)."""


def decode_infer_request(
    body: bytes, header_length: int | None, model_name: str, version: str,
    *, shm: SharedMemoryRegistry | None = None,
) -> InferenceRequest:
    """`header_length` None: the body is all JSON; 0: the body is one raw input (the service deduces its shape).

    Inputs whose parameters name a `shared_memory_region` are read from `shm`, the server's registered regions;
    outputs that name one carry its location for the service to write them there."""
    if header_length == 0:
        return InferenceRequest(model_name, version, [], raw_input=body)
    if header_length is None:
        header_length = len(body)
    elif not 0 < header_length <= len(body):
        raise HeaderLengthError(f"inference header size should be in range (0, {len(body)}), got: {header_length}")
    key = None
    if header_length < len(body) and header_length <= _KNOWN_HEADER_SIZE:
        key = body[:header_length]
        known = _known_headers.get(key)
        if known is not None and header_length + known.data_size == len(body):
            return known.request(body, header_length, model_name, version)
    header, inputs, offset = _decode_header(body, header_length, model_name, shm)
    request = InferenceRequest(model_name, version, inputs)
    _decode_rest(request, header)
    if key is not None and KnownHeader.holds(header, request):
        _remember(key, KnownHeader(request, offset - header_length))
    return request


def _decode_header(
    body: bytes, header_length: int, model: str, shm: SharedMemoryRegistry | None
) -> tuple[dict[str, Any], list[InputTensor], int]:
    """The JSON header, the inputs it describes and where their binary data ends (the body's end)."""
    header = parse_json(body if header_length == len(body) else memoryview(body)[:header_length])
    if not isinstance(header, dict):
        raise RequestParseError("the inference request must be a JSON object")
    try:
        items = header["inputs"]
    except KeyError:
        raise RequestParseError(
            "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"
        ) from None
    if not isinstance(items, list):
        raise RequestParseError("Unable to parse 'inputs': expected an array")
    offset = header_length
    inputs = []
    for item in items:
        tensor, offset = _decode_input(item, body, offset, header, model, shm)
        inputs.append(tensor)
    if offset != len(body):
        raise RequestParseError(
            f"unexpected additional input data: {len(body) - offset} bytes of binary data are not claimed by "
            f"any input's 'binary_data_size'"
        )
    return header, inputs, offset


def _decode_rest(request: InferenceRequest, header: dict[str, Any]) -> None:
    """The header's id, parameters and outputs, into `request` (whose inputs are decoded)."""
    request_id = header.get("id")
    if request_id is not None:
        if not isinstance(request_id, str):
            raise RequestParseError("Unable to parse 'id': attempt to access JSON non-string as string")
        request.id = request_id
    parameters = header.get("parameters")
    if parameters:
        _apply_parameters(request, parameters)
    outputs = header.get("outputs")
    if outputs:  # absent or empty: every output, as Triton
        if not isinstance(outputs, list):
            raise RequestParseError("Unable to parse 'outputs': expected an array")
        # kept as sent: a name asked twice is the service's to refuse (one rule for every protocol)
        request.outputs = [_decode_output(item) for item in outputs]


def _remember(key: bytes, known: KnownHeader) -> None:
    if len(_known_headers) >= _KNOWN_HEADERS:
        _known_headers.clear()  # a client that never repeats its header gains nothing from keeping them
    _known_headers[key] = known


class KnownHeader:
    """A JSON header already decoded, to decode the next body that starts with the same bytes without parsing it.

    A client sends the same header with every request of the same shapes (perf_analyzer, tritonclient): only the
    binary data after it differs. Decoding is a pure function of the header's bytes and the body, so a request
    from a known header is the one a fresh decode would give: 2.4 µs where parsing and checking the header took
    5.6 (perf_analyzer's MLP request). Only headers whose request depends on nothing else are kept: every input
    binary and fixed-size, no shared memory, no request id (but the empty one perf_analyzer sends) or sequence
    parameters (they change per request), and the header no longer than 4 KiB. A client's `timeout` or `priority`
    is kept: it sends the same with every request (its parameters are copied per request, as the inputs' are)."""

    __slots__ = ("_inputs", "_outputs", "_parameters", "data_size", "prepared")

    def __init__(self, request: InferenceRequest, data_size: int) -> None:
        self.data_size = data_size
        # What the service's prepare step made of a request with this header, for the model it last served
        # (`remember_prepared`): the request this header makes carries it, and the service only applies it.
        self.prepared: Prepared | None = None
        self._inputs = tuple(  # the dicts copied: the first request's own are its to change
            (t.name, t.datatype, t.data.dtype, t.shape, t.data.size, t.data.nbytes, dict(t.parameters))
            for t in request.inputs
        )
        outputs = request.outputs
        self._outputs = None if outputs is None else tuple((o.name, dict(o.parameters)) for o in outputs)
        self._parameters = dict(request.parameters)

    @staticmethod
    def holds(header: dict[str, Any], request: InferenceRequest) -> bool:
        if header.get("id") or not SEQUENCE_PARAMETERS.isdisjoint(request.parameters):  # an empty id is no id
            return False
        if any(o.shm is not None for o in request.outputs or ()):
            return False
        return all(  # each input's data in the body, read as its fixed-size elements
            t.datatype != "BYTES" and "binary_data_size" in (item.get("parameters") or ())
            for t, item in zip(request.inputs, header["inputs"], strict=True)
        )

    def request(self, body: bytes, offset: int, model_name: str, version: str) -> InferenceRequest:
        inputs = []
        for name, wire, dtype, shape, count, size, parameters in self._inputs:
            data = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
            inputs.append(InputTensor(name, wire, shape, data, dict(parameters)))  # each request owns its dicts
            offset += size
        request = InferenceRequest(model_name, version, inputs, prepared=self.prepared)
        if self._parameters:
            request.parameters = dict(self._parameters)
        if self._outputs is not None:
            request.outputs = [RequestedOutput(name, dict(parameters)) for name, parameters in self._outputs]
        return request


def remember_prepared(header: bytes, request: InferenceRequest) -> None:
    """After the service prepared in full a request decoded from `header` (`checked_by` its model): keep what it
    made of it with the header, when the header is kept (`KnownHeader`)."""
    known = _known_headers.get(header)
    if known is None:
        return
    names = [item[0] for item in known._inputs]
    try:
        order = tuple(names.index(t.name) for t in request.inputs)
    except ValueError:  # not this header's request after all
        return
    known.prepared = Prepared(
        request.checked_by, None if order == tuple(range(len(names))) else order, request.batch_size
    )


_KNOWN_HEADERS = 256  # distinct headers kept (per process)
_KNOWN_HEADER_SIZE = 4096  # longest header kept: what 256 of them may hold stays small whatever clients send
_known_headers: dict[bytes, KnownHeader] = {}


def _decode_input(
    item: Any, body: bytes, offset: int, header: dict[str, Any], model: str, shm: SharedMemoryRegistry | None
) -> tuple[InputTensor, int]:
    """One input, its data from shared memory, the body's binary part (at `offset`) or JSON; and the offset after
    its binary data."""
    name, datatype, shape, count = _input_head(item)
    parameters = _parameters(item)
    size = parameters.get("binary_data_size")
    if parameters and _SHM in parameters:
        _shm_only(item, size)
        view = _registry(shm, parameters[_SHM]).read(*_shm_location(parameters))
        data = _shm_input(name, datatype.wire, datatype.numpy, shape, count, view, header, model)
        return InputTensor(name, datatype.wire, shape, data, parameters), offset
    if size is None:
        if "data" not in item:
            raise RequestParseError(f"input '{name}' has neither 'data' nor a 'binary_data_size' parameter")
        data = _json_to_array(name, item["data"], datatype.wire, datatype.numpy, count).reshape(shape)
        return InputTensor(name, datatype.wire, shape, data, parameters), offset
    data = _binary_input(name, datatype, shape, count, body, offset, size)
    parameters = dict(parameters)  # the request's own, less the framing
    del parameters["binary_data_size"]
    return InputTensor(name, datatype.wire, shape, data, parameters), offset + size


def _input_head(item: Any) -> tuple[str, DataType, tuple[int, ...], int]:
    """An input's name, datatype, shape and element count."""
    if not isinstance(item, dict):
        raise RequestParseError("Unable to parse 'inputs': each input must be a JSON object")
    try:
        name = item["name"]
        datatype_name = item["datatype"]
        shape = item["shape"]
    except KeyError as exc:
        raise RequestParseError(
            f"Unable to parse {exc}: attempt to access non-existing object member {exc}"
        ) from None
    if not isinstance(name, str):  # a list would not even hash as a lookup key
        raise RequestParseError(_NOT_STRING.format("name"))
    if not isinstance(datatype_name, str):
        raise RequestParseError(_NOT_STRING.format("datatype"))
    datatype = BY_WIRE.get(datatype_name)
    if datatype is None:
        raise InvalidArgumentError(f"invalid datatype for input {name}")
    # `type(d) is int`: JSON true is no dimension (bool is an int to isinstance)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise RequestParseError(f"Unable to parse 'shape' of input '{name}': expected non-negative integers")
    shape_t = tuple(shape)
    return name, datatype, shape_t, element_count(name, shape_t, datatype.itemsize)


def _shm_only(item: dict[str, Any], size: Any) -> None:
    """An input in shared memory has no data of its own."""
    given = [k for k, present in (("'data'", "data" in item), ("'binary_data_size'", size is not None)) if present]
    if given:
        raise InvalidArgumentError(
            "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
            f"'shared_memory_region' in 'parameters'. But set {' '.join(given)} 'shared_memory_region'"
        )


def _binary_input(
    name: str, datatype: DataType, shape: tuple[int, ...], count: int, body: bytes, offset: int, size: Any
) -> np.ndarray:
    """An input's `size` bytes of the body's binary part from `offset`: a view (BYTES elements are copied out)."""
    if type(size) is not int or size < 0 or offset + size > len(body):
        raise RequestParseError(
            f"unexpected binary_data_size {size} for input '{name}': only {len(body) - offset} bytes remain"
        )
    if datatype.wire == "BYTES":
        return _decode_bytes(name, memoryview(body)[offset : offset + size], count).reshape(shape)
    expected = count * datatype.itemsize
    if size != expected:
        raise InvalidArgumentError(
            f"unexpected total byte size {size} for input '{name}', expecting {expected} "
            f"(shape {list(shape)}, datatype {datatype.wire})"
        )
    return np.frombuffer(body, dtype=datatype.numpy, count=count, offset=offset).reshape(shape)


def _parameters(item: dict[str, Any]) -> dict[str, Any]:
    """A tensor's `parameters`: absent, null or an object."""
    parameters = item.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise RequestParseError(_NOT_OBJECT)
    return parameters


def _shm_location(parameters: dict[str, Any]) -> ShmLocation:
    """(region, offset, byte_size) of a tensor placed in shared memory; no `byte_size` means 0 (Triton)."""
    region = parameters[_SHM]
    if not isinstance(region, str):
        raise RequestParseError(f"Unable to parse '{_SHM}': attempt to access JSON non-string as string")
    values = []
    for key in ("shared_memory_offset", "shared_memory_byte_size"):
        value = parameters.get(key, 0)
        if type(value) is not int or value < 0:
            raise RequestParseError(_NOT_UNSIGNED.format(key))
        values.append(value)
    return ShmLocation(region, values[0], values[1])


def _registry(shm: SharedMemoryRegistry | None, region: Any) -> SharedMemoryRegistry:
    if shm is None:
        raise NotFoundError(f"Unable to find shared memory region: '{region}'")
    return shm


def _shm_input(
    name: str, wire: str, dtype: np.dtype[Any], shape: tuple[int, ...], count: int, view: memoryview,
    header: dict[str, Any], model: str,
) -> np.ndarray:
    """An input's array straight over its shared memory window (BYTES elements are copied out)."""
    if wire == "BYTES":
        return _decode_bytes(name, view, count).reshape(shape)
    expected = count * dtype.itemsize
    if view.nbytes != expected:
        request_id = header.get("id")
        raise InvalidArgumentError(
            f"{id_prefix(request_id if isinstance(request_id, str) else '')}input byte size mismatch for input "
            f"'{name}' for model '{model}'. Expected {expected}, got {view.nbytes}"
        )
    return np.frombuffer(view, dtype=dtype, count=count).reshape(shape)


def _json_to_array(name: str, data: Any, wire: str, dtype: np.dtype[Any], count: int) -> np.ndarray:
    try:
        if wire == "BYTES":
            flat = _flatten(data)
            array = np.empty(len(flat), dtype=object)
            array[:] = [v.encode() if isinstance(v, str) else _not_string(name, v) for v in flat]
        else:
            # numpy infers the JSON values' own type first: 1.5 for an INT32 input or "1" for an FP32 one is
            # the client's mistake, never silently truncated or parsed.
            array = np.asarray(data).reshape(-1)
            if array.size:
                kind = array.dtype.kind
                if kind not in _JSON_KINDS[dtype.kind]:
                    if not (dtype.kind in "iu" and all(type(v) is int for v in _flatten(data))):
                        raise ValueError(f"got JSON {_KIND_NAMES.get(kind, 'values of mixed or unsupported types')}")
                    # integers no single numpy dtype holds (0 and 2**64-1): convert, out-of-range ones raise
                    array = np.asarray(data, dtype=dtype).reshape(-1)
                elif dtype.kind in "iu" and (dtype.itemsize < 8 or dtype.kind != kind):
                    info = np.iinfo(dtype)
                    if array.min() < info.min or array.max() > info.max:
                        raise ValueError(f"values out of range [{info.min}, {info.max}]")
            array = array.astype(dtype, copy=False)
    except (ValueError, TypeError, OverflowError) as exc:
        raise RequestParseError(f"Unable to parse 'data' of input '{name}' as {wire}: {exc}") from None
    if array.size != count:
        raise RequestParseError(
            f"Unable to parse 'data': Shape does not match true shape of 'data' field "
            f"(input '{name}': {array.size} elements for a shape of {count})"
        )
    return array


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
    try:
        items, offset = split_bytes(view, count)
    except FramingError as exc:
        if exc.length is None:
            raise _bytes_ended(name, exc.index) from None
        message = f"BYTES element {exc.index} of input '{name}' runs past its binary data"
        raise InvalidArgumentError(message) from None
    if len(items) < count:
        raise _bytes_ended(name, len(items))
    if offset != len(view):
        raise InvalidArgumentError(
            f"input '{name}' has {len(view) - offset} bytes of BYTES data beyond the {count} elements its shape holds"
        )
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def _bytes_ended(name: str, index: int) -> InvalidArgumentError:
    return InvalidArgumentError(f"unexpected end of BYTES data for input '{name}' at element {index}")


def _apply_parameters(request: InferenceRequest, parameters: Any) -> None:
    """The request's parameters as JSON gave them; the service applies priority, timeout and reserved keys."""
    if not isinstance(parameters, dict):
        raise RequestParseError(_NOT_OBJECT)
    binary = parameters.get("binary_data_output")
    if binary is not None and not isinstance(binary, bool):
        raise RequestParseError(_NOT_BOOLEAN.format("binary_data_output"))
    request.parameters = parameters


def _decode_output(item: Any) -> RequestedOutput:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise RequestParseError("Unable to parse 'outputs': each output needs a 'name'")
    parameters = _parameters(item)
    classification = parameters.get("classification")
    if classification is not None and (not isinstance(classification, int) or isinstance(classification, bool)):
        raise InvalidArgumentError(f"'classification' of output '{item['name']}' must be an integer")
    binary = parameters.get("binary_data", False)
    if not isinstance(binary, bool):
        raise RequestParseError(_NOT_BOOLEAN.format("binary_data"))
    location = None
    if parameters and _SHM in parameters:
        if binary:  # tritonclient sends `binary_data: false` with every output it places in shared memory
            raise InvalidArgumentError("Output can't set both 'shared_memory_region' and 'binary_data'")
        location = _shm_location(parameters)
    return RequestedOutput(item["name"], parameters, location)


# ---- responses --------------------------------------------------------------------------------------


def encode_infer_response(
    response: InferenceResponse, request: InferenceRequest
) -> tuple[list[bytes | memoryview], int | None]:
    """The body parts and, when any output travels as binary, the JSON header's length.

    An output the request placed in shared memory (the service wrote it there) is answered with no data."""
    # Outputs the request names follow their own `binary_data` (default JSON) and ignore `binary_data_output`,
    # which only applies when the request names no outputs: Triton's rule, which tritonclient relies on.
    binary_default = bool(request.parameters.get("binary_data_output", False))
    wanted = {o.name: o for o in request.outputs} if request.outputs else {}
    outputs_json = []
    binaries: list[bytes | memoryview] = []
    for output in response.outputs:
        asked = wanted.get(output.name)
        binary = asked.parameters.get("binary_data", False) if asked is not None else binary_default
        entry: dict[str, Any] = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if output.parameters:
            entry["parameters"] = dict(output.parameters)
        if asked is not None and asked.shm is not None:
            pass  # written into its region by the service
        elif binary:
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


def _json_data(output: OutputTensor) -> Any:
    data = output.data
    if output.datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in data.reshape(-1)]
    if data.dtype.kind in _ORJSON_NATIVE_KINDS and data.dtype.itemsize <= 8 and data.dtype.name != "bfloat16":
        return np.ascontiguousarray(data).reshape(-1)
    return data.astype(np.float32).reshape(-1).tolist()
