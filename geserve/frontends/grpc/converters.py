"""inference.GRPCInferenceService messages <-> core types: the one converter module, symmetric to_* / from_*.

The infer path is written by hand: each raw input becomes a numpy view of the request's bytes (`np.frombuffer`),
parameters are converted only when a message carries any, and faults carry Triton's gRPC messages. Faults Triton
finds in its core rather than its frontend (a byte size or string count that does not match the shape) come back
as the request's `late_fault`, so the service reports them after the core's checks, in Triton's order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2 as pb

from geserve.errors import GeserveError, InvalidArgumentError
from geserve.service.parameters import EMPTY_FINAL_RESPONSE
from geserve.service.shared_memory import CudaRegionStatus, RegionStatus, SharedMemoryRegistry
from geserve.types import (
    BY_WIRE,
    InferenceRequest,
    InferenceResponse,
    InputTensor,
    RequestedOutput,
    ShmLocation,
    id_prefix,
)
from geserve.types.wire import FramingError, element_count, split_bytes, tensor_bytes

INVALID_DATATYPE = "<invalid>"  # what Triton's core calls a datatype it does not know
_INT64_MAX = 2**63 - 1
# The typed contents field each datatype travels in, and the datatype each field holds (for Triton's messages).
_FIELD_OF = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_FIELDS = {
    "bool_contents": ("BOOL", np.bool_), "int_contents": ("INT32", np.int32), "int64_contents": ("INT64", np.int64),
    "uint_contents": ("UINT32", np.uint32), "uint64_contents": ("UINT64", np.uint64),
    "fp32_contents": ("FP32", np.float32), "fp64_contents": ("FP64", np.float64), "bytes_contents": ("BYTES", None),
}
_PASS_THROUGH_KINDS = ("int64_param", "bool_param", "string_param", "double_param")  # what Triton passes on
_VERSION_ERROR = (
    "failed to get model version from specified version string '{}' (details: stol), "
    "version should be an integral value > 0"
)


# ---- messages that do not parse ---------------------------------------------------------------------

UNPARSABLE = "Unable to parse request"  # Triton's words (it answers INTERNAL; geserve INVALID_ARGUMENT)


@dataclass(frozen=True, slots=True)
class Unparsable:
    """What the servicer receives in place of a request whose bytes are not its message: grpc.aio would answer a
    deserializer's exception UNKNOWN before any servicer code runs, so the deserializer hands this over instead
    and the servicer answers it INVALID_ARGUMENT, a client's fault like any other."""

    detail: str

    def error(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"{UNPARSABLE}: {self.detail}")


def tolerant_parser(message_type: type[Message]) -> Callable[[bytes], Any]:
    """`message_type.FromString` that returns an `Unparsable` instead of raising: one try on the hot path."""
    parse = message_type.FromString

    def decode(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or anything else the parser meets in hostile bytes
            return Unparsable(str(exc) or type(exc).__name__)

    return decode


# ---- parameters --------------------------------------------------------------------------------------


def from_parameter(parameter: Any) -> Any:
    """An InferParameter / ModelRepositoryParameter / LogSettings value as a Python value (None when unset)."""
    kind = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, kind) if kind else None


def from_infer_parameters(parameters: Any) -> dict[str, Any]:
    return {key: from_parameter(value) for key, value in parameters.items()}


def to_infer_parameters(values: dict[str, Any], target: Any) -> None:
    for key, value in values.items():
        parameter = target[key]
        if isinstance(value, bool | np.bool_):
            parameter.bool_param = bool(value)
        elif isinstance(value, int | np.integer):
            if value > _INT64_MAX:
                parameter.uint64_param = int(value)
            else:
                parameter.int64_param = int(value)
        elif isinstance(value, float | np.floating):
            parameter.double_param = float(value)
        elif isinstance(value, bytes):
            parameter.string_param = value.decode("utf-8", "replace")
        else:
            parameter.string_param = str(value)


def from_version(version: str) -> str:
    """A request's model version: empty (the latest) or an integer, refused with Triton's words otherwise."""
    if version and not version.isdigit():
        raise InvalidArgumentError(_VERSION_ERROR.format(version))
    return version


# ---- inference requests ----------------------------------------------------------------------------

@dataclass(slots=True)
class DecodedRequest:
    request: InferenceRequest
    # `triton_enable_empty_final_response`: a decoupled model's final flag sent alone reaches the client as an
    # empty response (else it is not sent at all, as in Triton)
    empty_final: bool = False


def _prefix(request: InferenceRequest) -> str:
    return id_prefix(request.id)


def from_model_infer_request(message: pb.ModelInferRequest, shm: SharedMemoryRegistry) -> DecodedRequest:
    model = message.model_name
    request = InferenceRequest(model, from_version(message.model_version), [], id=message.id)
    decoded = DecodedRequest(request)
    if len(message.parameters):
        decoded.empty_final = _apply_request_parameters(request, message.parameters)
    raw = message.raw_input_contents
    deferred: GeserveError | None = None
    inputs = request.inputs
    for index, tensor in enumerate(message.inputs):
        name = tensor.name
        parameters = from_infer_parameters(tensor.parameters) if len(tensor.parameters) else {}
        location = _shm_location(tensor.parameters, name) if parameters else None
        typed: np.ndarray | list[bytes] | None = None
        buffer: bytes | memoryview | None = None
        datatype = BY_WIRE.get(tensor.datatype)
        if location is not None:
            buffer = shm.read(*location)
        elif tensor.HasField("contents"):
            if raw:
                raise InvalidArgumentError(
                    f"contents field must not be specified when using raw_input_contents for '{name}' "
                    f"for model '{model}'"
                )
            typed = _from_contents(tensor, model)
        elif index < len(raw):
            buffer = raw[index]
        else:
            raise InvalidArgumentError(f"unable to find data for input tensor '{name}' for model '{model}' in request.")
        shape = tuple(tensor.shape)
        if datatype is None:  # the core refuses it, naming the input, once the request reaches it
            inputs.append(InputTensor(name, INVALID_DATATYPE, shape, np.empty(0, np.uint8), parameters))
            continue
        data, fault = _decode(request, name, datatype.wire, shape, buffer, typed)
        deferred = deferred or fault
        inputs.append(InputTensor(name, datatype.wire, shape, data, parameters))
    request.late_fault = deferred
    if len(message.outputs):
        # kept as sent: a name asked twice is the service's to refuse (one rule for every protocol)
        request.outputs = [_from_requested_output(output) for output in message.outputs]
    return decoded


def _apply_request_parameters(request: InferenceRequest, parameters: Any) -> bool:
    """The request's parameters, each checked for the wire field Triton wants it in (the service applies their
    rules); True when they enable empty final responses."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if key == "priority":
            if kind not in ("int64_param", "uint64_param"):
                raise InvalidArgumentError(
                    "invalid value type for 'priority' parameter, expected int64_param or uint64_param."
                )
        elif key == "timeout":
            if kind != "int64_param":
                raise InvalidArgumentError("invalid value type for 'timeout' parameter, expected int64_param.")
        elif key == "sequence_id":
            if kind not in ("int64_param", "string_param"):
                raise InvalidArgumentError(
                    "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."
                )
        elif key in ("sequence_start", "sequence_end"):
            if kind != "bool_param":
                raise InvalidArgumentError(f"invalid value type for '{key}' parameter, expected bool_param.")
        elif not key.startswith("triton_") and kind not in _PASS_THROUGH_KINDS:
            raise InvalidArgumentError(
                f"invalid value type for '{key}' parameter, expected int64_param, bool_param, or string_param."
            )
        values[key] = getattr(parameter, kind) if kind else None
    request.parameters = values
    return bool(values.get(EMPTY_FINAL_RESPONSE))


def _shm_location(parameters: Any, tensor: str) -> ShmLocation | None:
    """(region, offset, byte_size) when the tensor lives in a shared memory region."""
    if "shared_memory_region" not in parameters:
        return None
    region = _typed(parameters, "shared_memory_region", "string_param", tensor)
    if "shared_memory_byte_size" not in parameters:
        raise InvalidArgumentError(
            f"'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter for tensor "
            f"'{tensor}'"
        )
    size = _typed(parameters, "shared_memory_byte_size", "int64_param", tensor)
    offset = _typed(parameters, "shared_memory_offset", "int64_param", tensor) if (
        "shared_memory_offset" in parameters) else 0
    return ShmLocation(region, offset, size)


def _typed(parameters: Any, key: str, kind: str, tensor: str) -> Any:
    parameter = parameters[key]
    if parameter.WhichOneof("parameter_choice") != kind:
        raise InvalidArgumentError(f"invalid value type for '{key}' parameter for tensor '{tensor}', expected {kind}.")
    return getattr(parameter, kind)


def _from_contents(tensor: Any, model: str) -> np.ndarray | list[bytes]:
    contents = tensor.contents
    wanted = _FIELD_OF.get(tensor.datatype)
    for field, (field_type, _) in _FIELDS.items():
        if field != wanted and len(getattr(contents, field)):
            raise InvalidArgumentError(
                f"unexpected explicit tensor data for input tensor '{tensor.name}' for model '{model}' of type "
                f"'{field_type}', expected datatype '{tensor.datatype}'"
            )
    if wanted is None:  # FP16, BF16 and unknown datatypes have no typed field
        raise InvalidArgumentError(
            f"unable to find data for input tensor '{tensor.name}' for model '{model}' in request."
        )
    values = getattr(contents, wanted)
    natural = _FIELDS[wanted][1]
    if natural is None:
        return list(values)
    return np.array(values, dtype=natural).astype(BY_WIRE[tensor.datatype].numpy, copy=False)


def _decode(
    request: InferenceRequest, name: str, wire: str, shape: tuple[int, ...],
    buffer: bytes | memoryview | None, typed: np.ndarray | list[bytes] | None,
) -> tuple[np.ndarray, GeserveError | None]:
    # refuses a count or a byte size past int64 at once, before anything is sized from it
    count = element_count(name, shape, BY_WIRE[wire].itemsize)
    model = request.model_name
    if min(shape, default=0) < 0:
        return np.empty(0, np.uint8), InvalidArgumentError(
            f"{_prefix(request)}input '{name}' has a negative dimension in its shape"
        )
    if wire == "BYTES":
        items, fault = (typed, None) if typed is not None else _split_bytes(request, name, buffer)  # type: ignore[arg-type]
        if fault is None and len(items) != count:
            got = len(items)
            fault = InvalidArgumentError(
                f"{_prefix(request)}expected {count} string elements for inference input '{name}' for model "
                f"'{model}', got {got}" if got < count else
                f"{_prefix(request)}unexpected number of string elements {got} for inference input '{name}' for "
                f"model '{model}', expecting {count}"
            )
        if fault is not None:
            return np.empty(0, object), fault
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(shape), None
    datatype = BY_WIRE[wire]
    array = typed if isinstance(typed, np.ndarray) else np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[arg-type]
    expected = count * datatype.itemsize
    if array.nbytes != expected:
        return np.empty(0, datatype.numpy), InvalidArgumentError(
            f"{_prefix(request)}input byte size mismatch for input '{name}' for model '{model}'. "
            f"Expected {expected}, got {array.nbytes}"
        )
    return array.view(datatype.numpy).reshape(shape), None


def _split_bytes(
    request: InferenceRequest, name: str, buffer: bytes | memoryview
) -> tuple[list[bytes], GeserveError | None]:
    try:
        return split_bytes(memoryview(buffer))[0], None
    except FramingError as exc:
        if exc.length is None:
            return [], InvalidArgumentError(
                f"{_prefix(request)}incomplete string length indicator for inference input '{name}' for model "
                f"'{request.model_name}', expecting 4 bytes but only {exc.available} bytes available. Please make "
                f"sure the string length indicator is in one buffer."
            )
        return [], InvalidArgumentError(
            f"incomplete string data for inference input '{name}', expecting string of length {exc.length} but "
            f"only {exc.available} bytes available"
        )


def _from_requested_output(output: Any) -> RequestedOutput:
    if not len(output.parameters):
        return RequestedOutput(output.name)
    parameters = from_infer_parameters(output.parameters)
    if "classification" in parameters:
        if output.parameters["classification"].WhichOneof("parameter_choice") != "int64_param":
            raise InvalidArgumentError("invalid value type for 'classification' parameter, expected int64_param")
        if parameters["classification"] <= 0:  # sic: Triton's gRPC frontend refuses 0 too
            raise InvalidArgumentError("invalid value for 'classification' parameter, expected >= 0")
    return RequestedOutput(output.name, parameters, _shm_location(output.parameters, output.name))


# ---- inference responses ---------------------------------------------------------------------------


def to_model_infer_response(
    response: InferenceResponse, request: InferenceRequest, target: pb.ModelInferResponse | None = None
) -> pb.ModelInferResponse:
    """Every output in `raw_output_contents` (an empty entry for one the service wrote to shared memory, as
    Triton answers it)."""
    message = pb.ModelInferResponse() if target is None else target
    message.model_name = response.model_name
    message.model_version = response.model_version
    if request.id:
        message.id = request.id
    if response.parameters:
        to_infer_parameters(response.parameters, message.parameters)
    placed = {o.name for o in request.outputs if o.shm is not None} if request.outputs else None
    raw = message.raw_output_contents
    outputs = message.outputs
    for output in response.outputs:
        entry = outputs.add()
        entry.name = output.name
        entry.datatype = output.datatype
        entry.shape.extend(output.shape)
        if output.parameters:
            to_infer_parameters(output.parameters, entry.parameters)
        if placed and output.name in placed:
            raw.append(b"")
        else:
            raw.append(tensor_bytes(output, copy=True))
    return message


def to_stream_response(
    response: InferenceResponse, request: InferenceRequest, final: bool = True
) -> pb.ModelStreamInferResponse:
    """Triton flags each streamed response: `triton_final_response` true on the last one of its request."""
    message = pb.ModelStreamInferResponse()
    to_model_infer_response(response, request, message.infer_response)
    message.infer_response.parameters["triton_final_response"].bool_param = final
    return message


def to_stream_error(error: GeserveError, request_id: str) -> pb.ModelStreamInferResponse:
    message = pb.ModelStreamInferResponse(error_message=error.message)
    message.infer_response.id = request_id
    return message


# ---- metadata, configuration, statistics, repository -----------------------------------------------


def to_server_metadata_response(metadata: dict[str, Any]) -> pb.ServerMetadataResponse:
    return pb.ServerMetadataResponse(
        name=metadata["name"], version=metadata["version"], extensions=metadata["extensions"]
    )


def to_model_metadata_response(metadata: dict[str, Any]) -> pb.ModelMetadataResponse:
    tensor = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata["versions"],
        platform=metadata["platform"],
        inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in metadata["inputs"]],
        outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in metadata["outputs"]],
    )


def to_model_statistics_response(statistics: dict[str, Any]) -> pb.ModelStatisticsResponse:
    # Fields newer than tritonclient 2.41's proto (response_stats) have nowhere to go.
    return json_format.ParseDict(statistics, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)


def to_repository_index_response(entries: list[dict[str, str]]) -> pb.RepositoryIndexResponse:
    index = pb.RepositoryIndexResponse.ModelIndex
    return pb.RepositoryIndexResponse(
        models=[index(**{k: v for k, v in e.items() if k in ("name", "version", "state", "reason")}) for e in entries]
    )


def from_repository_model_load_request(message: pb.RepositoryModelLoadRequest) -> tuple[str, dict[str, Any]]:
    """The model's name and the load's parameters, as sent: `file:` ones carry the model's files as `bytes_param`
    (bytes here; the service checks them and `config`)."""
    return message.model_name, {key: from_parameter(value) for key, value in message.parameters.items()}


def to_system_shared_memory_status_response(regions: list[RegionStatus]) -> pb.SystemSharedMemoryStatusResponse:
    message = pb.SystemSharedMemoryStatusResponse()
    for region in regions:
        entry = message.regions[region.name]
        entry.name, entry.key, entry.offset, entry.byte_size = region.name, region.key, region.offset, region.byte_size
    return message


def to_cuda_shared_memory_status_response(regions: list[CudaRegionStatus]) -> pb.CudaSharedMemoryStatusResponse:
    message = pb.CudaSharedMemoryStatusResponse()
    for region in regions:
        entry = message.regions[region.name]
        entry.name, entry.device_id, entry.byte_size = region.name, region.device_id, region.byte_size
    return message


# ---- log and trace settings ------------------------------------------------------------------------


def from_log_settings_request(message: pb.LogSettingsRequest) -> dict[str, Any]:
    return {key: from_parameter(value) for key, value in message.settings.items()}


def to_log_settings_response(values: dict[str, Any]) -> pb.LogSettingsResponse:
    message = pb.LogSettingsResponse()
    for key, value in values.items():
        setting = message.settings[key]
        if isinstance(value, bool):
            setting.bool_param = value
        elif isinstance(value, int):
            setting.uint32_param = value
        else:
            setting.string_param = str(value)
    return message


def from_trace_setting_request(message: pb.TraceSettingRequest) -> dict[str, list[str]]:
    return {key: list(value.value) for key, value in message.settings.items()}


def to_trace_setting_response(values: dict[str, list[str]]) -> pb.TraceSettingResponse:
    message = pb.TraceSettingResponse()
    for key, items in values.items():
        message.settings[key].value.extend(items)
    return message
