"""Conformance, gRPC half: the same GRPCInferenceService messages sent to geserve and to the real Triton must agree.

As in the HTTP half, both servers run once for the module: geserve on the ONNX test models, Triton on generated
Python-backend models of the same files. Every case goes to both over a raw `service_pb2_grpc` stub and the answers
are compared: status code, message (Triton's text verbatim where given), response fields, and output tensors decoded
from `raw_output_contents`. Deliberate differences are named where they are asserted:

- server name/version, `platform`/`backend`/`default_model_filename`, instance group names, timings;
- a region registered at an offset that is not page aligned, which Triton refuses and geserve serves;
- with `triton_grpc_error: true`, geserve ends the stream on any failed request; Triton 2.51 only on failures
  inside the model, keeping faults it finds before (unknown model, bad shape) in-band;
- bytes that are no request message: Triton answers INTERNAL "Unable to parse request" (and ends a stream OK, the
  message dropped); geserve INVALID_ARGUMENT in the same words (a stream answers it in band and goes on);
- an output named twice, which Triton 2.51 answers once and newer Triton refuses, geserve refuses; a shape past
  int64 elements geserve refuses in newer Triton's words.
"""

from __future__ import annotations

import ast
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor

from tests.support import models
from tests.support.conformance import MODELS, STATS_MODEL, server_pair
from tests.support.shm import Region

pytestmark = pytest.mark.reference

NUMPY = {
    "BOOL": np.bool_, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16, "FP32": np.float32,
    "FP64": np.float64, "UINT8": np.uint8,
}
Stub = service_pb2_grpc.GRPCInferenceServiceStub


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    message: str
    response: object | None


def call(stub: Stub, rpc: str, request: object, metadata: tuple = ()) -> Answer:
    try:
        return Answer(grpc.StatusCode.OK, "", getattr(stub, rpc)(request, timeout=30, metadata=metadata))
    except grpc.RpcError as exc:
        return Answer(exc.code(), exc.details(), None)




@dataclass
class Servers:
    triton: Stub
    geserve: Stub
    shm_in: Region
    shm_out: Region
    targets: tuple[str, str] = ("", "")  # Triton's and geserve's, for raw-byte calls

    def both(self, rpc: str, request: object, metadata: tuple = ()) -> tuple[Answer, Answer]:
        return call(self.triton, rpc, request, metadata), call(self.geserve, rpc, request, metadata)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with server_pair(tmp_path_factory.mktemp("conformance-grpc")) as pair, \
            grpc.insecure_channel(pair.triton_grpc) as t_channel, \
            grpc.insecure_channel(pair.geserve.grpc_url) as g_channel:
        servers = Servers(Stub(t_channel), Stub(g_channel), *pair.regions)
        servers.targets = (pair.triton_grpc, pair.geserve.grpc_url)
        for stub in (servers.triton, servers.geserve):
            for name, region in (("in", pair.regions[0]), ("out", pair.regions[1])):
                stub.SystemSharedMemoryRegister(
                    pb.SystemSharedMemoryRegisterRequest(name=name, key=region.key, byte_size=256))
        yield servers


# ----------------------------------------------------------------------------------- building requests

A = np.arange(16, dtype=np.int32)
B = np.full(16, 3, dtype=np.int32)
SUM, DIFF = (A + B)[None], (A - B)[None]
NOBATCH_IN = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], dtype=np.float32)
BYTES_ITEMS = [b"hello", b"", "\u00e9t\u00e9".encode()]
BOOLS = np.array([[True, False, True], [False, False, True]])
FP16 = np.array([[1.5, -2.25, 65504.0, 0.1]], dtype=np.float16)


def length_prefixed(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in items)


def infer(model: str, *tensors: tuple[str, str, list[int], object], **fields: object) -> pb.ModelInferRequest:
    """tensors: (name, datatype, shape, data) with data raw bytes, a typed-contents dict, or None (no data)."""
    request = pb.ModelInferRequest(model_name=model, **fields)
    for name, datatype, shape, data in tensors:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if isinstance(data, dict):
            for field, values in data.items():
                getattr(tensor.contents, field).extend(values)
        elif data is not None:
            request.raw_input_contents.append(data)
    return request


def simple(rows: int = 1, a: np.ndarray = A, b: np.ndarray = B, **fields: object) -> pb.ModelInferRequest:
    return infer("simple", ("INPUT0", "INT32", [rows, len(a)], np.tile(a, rows).tobytes()),
                 ("INPUT1", "INT32", [rows, len(b)], np.tile(b, rows).tobytes()), **fields)


def simple_typed(**fields: object) -> pb.ModelInferRequest:
    return infer("simple", ("INPUT0", "INT32", [1, 16], {"int_contents": A.tolist()}),
                 ("INPUT1", "INT32", [1, 16], {"int_contents": B.tolist()}), **fields)


def with_outputs(request: pb.ModelInferRequest, *outputs: tuple[str, dict]) -> pb.ModelInferRequest:
    for name, parameters in outputs:
        output = request.outputs.add(name=name)
        set_parameters(output.parameters, parameters)
    return request


def with_parameters(request: pb.ModelInferRequest, parameters: dict, tensor: int | None = None) -> pb.ModelInferRequest:
    set_parameters(request.parameters if tensor is None else request.inputs[tensor].parameters, parameters)
    return request


def set_parameters(target, parameters: dict) -> None:
    for key, (kind, value) in parameters.items():
        setattr(target[key], kind, value)


def digits_rows(count: int) -> np.ndarray:
    pixels, _ = models.digits_test_set()
    return np.ascontiguousarray(pixels[:count], dtype=np.float32)


def digits(count: int = 2, *outputs: tuple[str, dict]) -> Callable[[], pb.ModelInferRequest]:
    def build() -> pb.ModelInferRequest:
        rows = digits_rows(count)
        return with_outputs(infer("digits", ("pixels", "FP32", list(rows.shape), rows.tobytes())), *outputs)
    return build


def shm(region: str, size: int, offset: int = 0) -> dict:
    parameters = {"shared_memory_region": ("string_param", region), "shared_memory_byte_size": ("int64_param", size)}
    if offset:
        parameters["shared_memory_offset"] = ("int64_param", offset)
    return parameters


# ----------------------------------------------------------------------------------- decoding answers


def unmangle(value: bytes) -> bytes:
    """Undo the reference Python-backend model's stringified BYTES (`b'...'`); see the HTTP half."""
    if len(value) >= 3 and value[:2] in (b"b'", b'b"') and value[-1:] == value[1:2]:
        return ast.literal_eval(value.decode())
    return value


def decode(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    arrays = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        if output.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=NUMPY[output.datatype])
        arrays[output.name] = array.reshape(list(output.shape)) if raw or not len(output.shape) else array
    return arrays


def assert_same_response(triton: Answer, geserve: Answer, expected: dict[str, np.ndarray] | None = None) -> None:
    assert (triton.code, geserve.code) == (grpc.StatusCode.OK,) * 2, (triton.message, geserve.message)
    t, g = triton.response, geserve.response
    assert (g.model_name, g.model_version, g.id) == (t.model_name, t.model_version, t.id)
    assert dict(g.parameters) == dict(t.parameters)
    t_out = {o.name: o for o in t.outputs}
    g_out = {o.name: o for o in g.outputs}
    assert sorted(g_out) == sorted(t_out) and len(g_out) == len(g.outputs)
    assert len(g.raw_output_contents) == len(t.raw_output_contents)
    t_arrays, g_arrays = decode(t), decode(g)
    for name, t_entry in t_out.items():
        g_entry = g_out[name]
        assert (g_entry.datatype, list(g_entry.shape)) == (t_entry.datatype, list(t_entry.shape)), name
        assert dict(g_entry.parameters) == dict(t_entry.parameters), name
        t_value, g_value = t_arrays[name], g_arrays[name]
        if t_entry.datatype == "BYTES":
            plain = np.vectorize(unmangle, otypes=[object])(t_value) if t_value.size else t_value
            assert g_value.tolist() == plain.tolist(), name
        elif g_value.dtype.kind == "f":
            np.testing.assert_allclose(g_value, t_value, rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(g_value, t_value, err_msg=name)
    for name, value in (expected or {}).items():
        assert g_arrays[name].tolist() == value.tolist(), name


class Prefix(str):
    """Both messages start with this; the rest may differ."""


def assert_same_error(triton: Answer, geserve: Answer, code: grpc.StatusCode, message: str | None) -> None:
    assert (triton.code, geserve.code) == (code, code), (triton.message, geserve.message)
    if isinstance(message, Prefix):
        assert triton.message.startswith(message) and geserve.message.startswith(message)
        return
    if message is not None:
        assert triton.message == message, "the reference changed: update the expected text"
    assert geserve.message == triton.message


# ----------------------------------------------------------------------------- health and metadata


def test_server_live_ready_and_metadata(servers: Servers) -> None:
    for rpc, request, field in (("ServerLive", pb.ServerLiveRequest(), "live"),
                                ("ServerReady", pb.ServerReadyRequest(), "ready")):
        triton, geserve = servers.both(rpc, request)
        assert getattr(triton.response, field) and getattr(geserve.response, field)
    triton, geserve = servers.both("ServerMetadata", pb.ServerMetadataRequest())
    assert geserve.response.name and geserve.response.version
    assert set(geserve.response.extensions) <= set(triton.response.extensions)


@pytest.mark.parametrize("version", ["", "1"], ids=["latest", "version-1"])
@pytest.mark.parametrize("model", MODELS)
def test_model_ready_and_metadata(servers: Servers, model: str, version: str) -> None:
    triton, geserve = servers.both("ModelReady", pb.ModelReadyRequest(name=model, version=version))
    assert triton.response.ready and geserve.response.ready
    triton, geserve = servers.both("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version))
    assert triton.response.platform == "python" and geserve.response.platform
    t_meta, g_meta = json_format.MessageToDict(triton.response), json_format.MessageToDict(geserve.response)
    assert {**g_meta, "platform": ""} == {**t_meta, "platform": ""}


@pytest.mark.parametrize("name, version", [("nope", ""), ("simple", "7"), ("nope", "7")])
def test_model_not_ready_is_false_not_an_error(servers: Servers, name: str, version: str) -> None:
    triton, geserve = servers.both("ModelReady", pb.ModelReadyRequest(name=name, version=version))
    assert (triton.code, geserve.code) == (grpc.StatusCode.OK,) * 2
    assert not triton.response.ready and not geserve.response.ready


@pytest.mark.parametrize("model", MODELS)
def test_model_config(servers: Servers, model: str) -> None:
    triton, geserve = servers.both("ModelConfig", pb.ModelConfigRequest(name=model))
    t_cfg = json_format.MessageToDict(triton.response.config, preserving_proto_field_name=True)
    g_cfg = json_format.MessageToDict(geserve.response.config, preserving_proto_field_name=True)
    assert t_cfg["backend"] == "python"
    for key in ("name", "max_batch_size", "version_policy", "input", "output", "batch_input", "batch_output",
                "optimization", "parameters", "model_warmup"):
        assert g_cfg.get(key) == t_cfg.get(key), key
    groups = [(g.get("kind"), g.get("count"), g.get("gpus")) for g in g_cfg["instance_group"]]
    assert groups == [(g.get("kind"), g.get("count"), g.get("gpus")) for g in t_cfg["instance_group"]]


# ------------------------------------------------------------------------- refusals outside inference

NONE_MODE = "explicit model load / unload is not allowed if polling is enabled"
BAD_VERSION = ("failed to get model version from specified version string 'abc' (details: stol), version should be "
               "an integral value > 0")
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
UNAVAILABLE, UNIMPLEMENTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED

REFUSALS = [
    ("metadata-unknown-model", "ModelMetadata", pb.ModelMetadataRequest(name="nope"), NOT_FOUND,
     "Request for unknown model: 'nope' is not found"),
    ("metadata-empty-name", "ModelMetadata", pb.ModelMetadataRequest(), NOT_FOUND,
     "Request for unknown model: '' is not found"),
    ("metadata-unknown-version", "ModelMetadata", pb.ModelMetadataRequest(name="simple", version="7"), NOT_FOUND,
     "Request for unknown model: 'simple' version 7 is not found"),
    ("metadata-version-not-number", "ModelMetadata", pb.ModelMetadataRequest(name="simple", version="abc"), INVALID,
     BAD_VERSION),
    ("ready-version-not-number", "ModelReady", pb.ModelReadyRequest(name="simple", version="abc"), INVALID,
     BAD_VERSION),
    ("config-unknown-model", "ModelConfig", pb.ModelConfigRequest(name="nope"), NOT_FOUND,
     "Request for unknown model: 'nope' is not found"),
    ("config-unknown-version", "ModelConfig", pb.ModelConfigRequest(name="simple", version="7"), NOT_FOUND,
     "Request for unknown model: 'simple' version 7 is not found"),
    ("config-version-not-number", "ModelConfig", pb.ModelConfigRequest(name="simple", version="abc"), INVALID,
     BAD_VERSION),
    ("stats-unknown-model", "ModelStatistics", pb.ModelStatisticsRequest(name="nope"), INVALID,
     "requested model 'nope' is not available"),
    ("stats-unknown-version", "ModelStatistics", pb.ModelStatisticsRequest(name="simple", version="7"), INVALID,
     "requested model version is not available for model 'simple'"),
    ("stats-version-not-number", "ModelStatistics", pb.ModelStatisticsRequest(name="simple", version="abc"), INVALID,
     BAD_VERSION),
    ("load-none-mode", "RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="simple"), UNAVAILABLE,
     NONE_MODE),
    ("load-unknown-none-mode", "RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name="nope"), UNAVAILABLE,
     NONE_MODE),
    ("unload-none-mode", "RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name="simple"), UNAVAILABLE,
     NONE_MODE),
    ("index-repository-name", "RepositoryIndex", pb.RepositoryIndexRequest(repository_name="r"), UNIMPLEMENTED,
     "'repository_name' specification is not supported"),
    ("shm-status-unknown", "SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name="nope"), NOT_FOUND,
     "Unable to find system shared memory region: 'nope'"),
    ("shm-register-twice", "SystemSharedMemoryRegister",
     pb.SystemSharedMemoryRegisterRequest(name="in", key="/whatever", byte_size=8), grpc.StatusCode.ALREADY_EXISTS,
     "shared memory region 'in' already in manager"),
    ("shm-register-missing-key", "SystemSharedMemoryRegister",
     pb.SystemSharedMemoryRegisterRequest(name="x", key="/geserve-no-such-key", byte_size=8), grpc.StatusCode.INTERNAL,
     "Unable to open shared memory region: '/geserve-no-such-key'"),
    ("trace-unknown-model", "TraceSetting", pb.TraceSettingRequest(model_name="nope"), INVALID,
     "Request for unknown model : nope"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusal(servers: Servers, case: tuple) -> None:
    _, rpc, request, code, message = case
    assert_same_error(*servers.both(rpc, request), code, message)


@pytest.mark.parametrize("ready", [False, True])
def test_repository_index(servers: Servers, ready: bool) -> None:
    triton, geserve = servers.both("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready))
    assert geserve.response == triton.response
    assert {m.name for m in geserve.response.models} == {*MODELS, STATS_MODEL}


def test_unregistering_an_unknown_region_is_no_error(servers: Servers) -> None:
    triton, geserve = servers.both("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name="x"))
    assert (triton.code, geserve.code) == (grpc.StatusCode.OK,) * 2


def test_cuda_shared_memory_as_on_a_machine_without_gpus(servers: Servers) -> None:
    triton, geserve = servers.both("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest())
    assert (triton.code, geserve.code) == (grpc.StatusCode.OK,) * 2 and geserve.response == triton.response
    triton, geserve = servers.both("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name="x"))
    assert (triton.code, geserve.code) == (grpc.StatusCode.OK,) * 2
    request = pb.CudaSharedMemoryRegisterRequest(name="x", raw_handle=b"\0" * 64, device_id=0, byte_size=8)
    triton, geserve = servers.both("CudaSharedMemoryRegister", request)
    assert_same_error(triton, geserve, grpc.StatusCode.INVALID_ARGUMENT,
                      "failed to register shared memory region: invalid args")


def test_shared_memory_status(servers: Servers) -> None:
    triton, geserve = servers.both("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest())
    assert geserve.response == triton.response


def test_log_settings_read_and_refused(servers: Servers) -> None:
    triton, geserve = servers.both("LogSettings", pb.LogSettingsRequest())
    assert geserve.response == triton.response
    for key, kind, value, message in (
        ("log_verbose_level", "bool_param", True, "expect int32 for 'log_verbose_level'"),
        ("log_info", "string_param", "x", "expect boolean for 'log_info'"),
        ("log_format", "string_param", "bad", "invalid argument for log_format, got: bad"),
    ):
        request = pb.LogSettingsRequest()
        setattr(request.settings[key], kind, value)
        assert_same_error(*servers.both("LogSettings", request), INVALID, message)


def test_trace_settings_read(servers: Servers) -> None:
    for model in ("", "simple"):
        triton, geserve = servers.both("TraceSetting", pb.TraceSettingRequest(model_name=model))
        assert geserve.response == triton.response
    request = pb.TraceSettingRequest()
    request.settings["trace_rate"].value.append("x")
    assert_same_error(*servers.both("TraceSetting", request), INVALID, "Unable to parse 'trace_rate', got: x")


# ------------------------------------------------------------------------------------ inference works

Build = pb.ModelInferRequest | Callable[[], pb.ModelInferRequest]
BOTH = {"OUTPUT0": SUM, "OUTPUT1": DIFF}
INFERS: list[tuple[str, Build, dict]] = [
    ("raw-all-outputs", simple(), BOTH),
    ("raw-request-id-echo", simple(id="req-42"), BOTH),
    ("raw-one-output", with_outputs(simple(), ("OUTPUT1", {})), {"OUTPUT1": DIFF}),
    ("raw-explicit-version", simple(model_version="1"), BOTH),
    ("raw-batch-of-3", simple(3), {"OUTPUT0": np.tile(SUM, (3, 1))}),
    ("raw-extra-raw-contents-ignored", (lambda: (r := simple(), r.raw_input_contents.append(b"xx"))[0]), BOTH),
    ("parameters-pass-through", with_parameters(simple(), {
        "custom": ("string_param", "x"), "flag": ("bool_param", True), "n": ("int64_param", 3),
        "d": ("double_param", 1.5),
        "priority": ("int64_param", 1), "timeout": ("int64_param", 1_000_000),
        "triton_enable_empty_final_response": ("bool_param", True)}), BOTH),
    ("priority-uint64", with_parameters(simple(), {"priority": ("uint64_param", 2)}), BOTH),
    ("input-and-output-parameters-pass", with_outputs(with_parameters(simple(), {"foo": ("int64_param", 1)}, 0),
                                                      ("OUTPUT0", {"bar": ("string_param", "x")})), {"OUTPUT0": SUM}),
    ("typed-int32", simple_typed(), BOTH),
    ("typed-fp32-nobatch", infer("nobatch", ("INPUT0", "FP32", [2, 3], {"fp32_contents": NOBATCH_IN.reshape(-1)})),
     {"OUTPUT0": np.maximum(NOBATCH_IN, 0)}),
    ("typed-bool", infer("identity_bool", ("INPUT0", "BOOL", [2, 3], {"bool_contents": BOOLS.reshape(-1)})),
     {"OUTPUT0": BOOLS}),
    ("typed-bytes", infer("identity_bytes", ("INPUT0", "BYTES", [1, 3], {"bytes_contents": BYTES_ITEMS})),
     {"OUTPUT0": np.array([BYTES_ITEMS], dtype=object)}),
    ("raw-bytes", infer("identity_bytes", ("INPUT0", "BYTES", [1, 3], length_prefixed(BYTES_ITEMS))),
     {"OUTPUT0": np.array([BYTES_ITEMS], dtype=object)}),
    ("raw-bool", infer("identity_bool", ("INPUT0", "BOOL", [2, 3], BOOLS.tobytes())), {"OUTPUT0": BOOLS}),
    ("raw-fp16", infer("identity_fp16", ("INPUT0", "FP16", [1, 4], FP16.tobytes())), {"OUTPUT0": FP16}),
    ("digits-raw", digits(3), {}),
    ("classification-with-labels", digits(2, ("probabilities", {"classification": ("int64_param", 3)})), {}),
    ("classification-k-clamped", digits(1, ("probabilities", {"classification": ("int64_param", 30)})), {}),
    ("classification-int64-without-labels", digits(2, ("label", {"classification": ("int64_param", 1)}),
                                                   ("probabilities", {})), {}),
    ("classification-int", with_outputs(simple(), ("OUTPUT0", {"classification": ("int64_param", 2)})),
     {"OUTPUT0": np.array([[b"18:15", b"17:14"]], dtype=object)}),
    ("classification-without-batching",
     with_outputs(infer("nobatch", ("INPUT0", "FP32", [2, 3], NOBATCH_IN.tobytes())),
                  ("OUTPUT0", {"classification": ("int64_param", 2)})),
     {"OUTPUT0": np.array([b"6.000000:5", b"4.000000:3"], dtype=object)}),
]


@pytest.mark.parametrize("case", INFERS, ids=[c[0] for c in INFERS])
def test_inference(servers: Servers, case: tuple) -> None:
    _, build, expected = case
    request = build() if callable(build) else build
    assert_same_response(*servers.both("ModelInfer", request), expected)


def _shm_request(in_size: int = 64, in_offset: int = 64, out_size: int = 64) -> pb.ModelInferRequest:
    request = infer("simple", ("INPUT0", "INT32", [1, 16], None), ("INPUT1", "INT32", [1, 16], None))
    with_parameters(request, shm("in", 64), 0)
    with_parameters(request, shm("in", in_size, in_offset), 1)
    return with_outputs(request, ("OUTPUT0", shm("out", out_size)), ("OUTPUT1", shm("out", out_size, 64)))


def test_shared_memory_inputs_and_outputs(servers: Servers) -> None:
    servers.shm_in.memory[:128] = A.tobytes() + B.tobytes()
    answers = []
    for stub in (servers.triton, servers.geserve):
        servers.shm_out.memory[:128] = bytes(128)
        answers.append(call(stub, "ModelInfer", _shm_request()))
        written = np.frombuffer(servers.shm_out.memory, np.int32, 32).reshape(2, 16)
        np.testing.assert_array_equal(written, np.concatenate([SUM, DIFF]))
    triton, geserve = answers
    assert list(geserve.response.raw_output_contents) == list(triton.response.raw_output_contents) == [b"", b""]
    assert [(o.name, o.datatype, list(o.shape)) for o in geserve.response.outputs] == [
        (o.name, o.datatype, list(o.shape)) for o in triton.response.outputs]


# ---------------------------------------------------------------------------------- inference refused


def _rid(text: str, request_id: str = "<id_unknown>") -> str:
    return f"[request id: {request_id}] {text}"


_NOTE = (" NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be prepended to"
         " each input shape. If you want to specify the full shape including the batch dim in your input dims config,"
         " try setting max_batch_size to zero. See the model configuration docs for more info on max_batch_size.")


def _edit(request: pb.ModelInferRequest, edit: Callable[[pb.ModelInferRequest], object]) -> pb.ModelInferRequest:
    edit(request)
    return request


def _mixed() -> pb.ModelInferRequest:
    request = simple()
    request.inputs[0].contents.int_contents.extend(A.tolist())
    return request


_TRITON_KEYS = ("parameter keys starting with 'triton_' are reserved for Triton usage. Only the following keys "
                "starting with 'triton_' are allowed: triton_enable_empty_final_response")
_SHAPE_15 = _rid("unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,15]." + _NOTE)

BADS: list[tuple[str, Build, grpc.StatusCode, str | None]] = [
    ("unknown-model", _edit(simple(), lambda r: setattr(r, "model_name", "nope")), NOT_FOUND,
     "Request for unknown model: 'nope' is not found"),
    ("unknown-version", simple(model_version="7"), NOT_FOUND,
     "Request for unknown model: 'simple' version 7 is not found"),
    ("version-not-number", simple(model_version="abc"), INVALID, BAD_VERSION),
    ("unknown-model-bad-body", infer("nope", ("INPUT0", "INT33", [1], None)), NOT_FOUND,
     "Request for unknown model: 'nope' is not found"),
    ("wrong-shape", simple(a=A[:15]), INVALID, _SHAPE_15),
    ("wrong-shape-request-id", simple(a=A[:15], id="my-id"), INVALID, _SHAPE_15.replace("<id_unknown>", "my-id")),
    ("wrong-shape-no-batching", infer("nobatch", ("INPUT0", "FP32", [3, 2], NOBATCH_IN.tobytes())), INVALID,
     _rid("unexpected shape for input 'INPUT0' for model 'nobatch'. Expected [2,3], got [3,2]. ")),
    ("wrong-shape-and-byte-size-shape-first", _edit(simple(), lambda r: r.inputs[0].shape.__setitem__(1, 15)),
     INVALID, _SHAPE_15),
    ("negative-dim", _edit(simple(), lambda r: r.inputs[0].shape.__setitem__(1, -16)), INVALID,
     _rid("unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,-16]." + _NOTE)),
    ("batch-dim-missing", _edit(simple(), lambda r: [t.shape.pop(0) for t in r.inputs]), INVALID,
     _rid("inference request batch-size must be <= 8 for 'simple'")),
    ("batch-too-large", simple(9), INVALID, _rid("inference request batch-size must be <= 8 for 'simple'")),
    ("batch-sizes-disagree", _edit(simple(), lambda r: (r.inputs[1].shape.__setitem__(0, 2),
                                                        r.raw_input_contents.__setitem__(1, B.tobytes() * 2))),
     INVALID, Prefix(_rid("input 'INPUT"))),  # each server names the input it checks first
    ("wrong-datatype", _edit(simple(), lambda r: (setattr(r.inputs[0], "datatype", "INT64"),
                                                  r.raw_input_contents.__setitem__(0, A.astype(np.int64).tobytes()))),
     INVALID, _rid("inference input 'INPUT0' data-type is 'INT64', but model 'simple' expects 'INT32'")),
    ("unknown-datatype", _edit(simple(), lambda r: setattr(r.inputs[0], "datatype", "INT33")), INVALID,
     _rid("inference input 'INPUT0' data-type is '<invalid>', but model 'simple' expects 'INT32'")),
    ("raw-contents-missing-for-an-input", _edit(simple(), lambda r: r.raw_input_contents.pop()), INVALID,
     "unable to find data for input tensor 'INPUT1' for model 'simple' in request."),
    ("no-data-at-all", _edit(simple(), lambda r: r.ClearField("raw_input_contents")), INVALID,
     "unable to find data for input tensor 'INPUT0' for model 'simple' in request."),
    ("missing-input", _edit(simple(), lambda r: (r.inputs.pop(), r.raw_input_contents.pop())), INVALID,
     _rid("expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing required "
          "input(s) ['INPUT1']. Please provide all required input(s).")),
    ("no-inputs", pb.ModelInferRequest(model_name="simple"), INVALID,
     _rid("expected 2 inputs but got 0 inputs for model 'simple'. Got input(s) [], but missing required input(s) "
          "['INPUT0','INPUT1']. Please provide all required input(s).")),
    ("unknown-input", _edit(simple(), lambda r: setattr(r.inputs[1], "name", "NOPE")), INVALID,
     "unexpected inference input 'NOPE' for model 'simple'"),
    ("input-given-twice", _edit(simple(), lambda r: (r.inputs.append(r.inputs[0]),
                                                     r.raw_input_contents.append(A.tobytes()))), INVALID,
     _rid("input 'INPUT0' already exists in request")),
    ("unknown-output", with_outputs(simple(), ("NOPE", {})), INVALID,
     "unexpected inference output 'NOPE' for model 'simple'"),
    ("triton-prefixed-parameter", with_parameters(simple(), {"triton_foo": ("int64_param", 1)}), INVALID,
     _TRITON_KEYS),
    ("negative-priority", with_parameters(simple(), {"priority": ("int64_param", -1)}), INVALID,
     "invalid value for 'priority', expected value >= 0."),
    ("string-priority", with_parameters(simple(), {"priority": ("string_param", "1")}), INVALID,
     "invalid value type for 'priority' parameter, expected int64_param or uint64_param."),
    ("uint-timeout", with_parameters(simple(), {"timeout": ("uint64_param", 5)}), INVALID,
     "invalid value type for 'timeout' parameter, expected int64_param."),
    ("negative-classification", with_outputs(simple(), ("OUTPUT0", {"classification": ("int64_param", -1)})),
     INVALID, "invalid value for 'classification' parameter, expected >= 0"),
    ("zero-classification-refused-unlike-http", with_outputs(simple(), ("OUTPUT0", {"classification": (
        "int64_param", 0)})), INVALID, "invalid value for 'classification' parameter, expected >= 0"),
    ("uint64-parameter", with_parameters(simple(), {"u": ("uint64_param", 3)}), INVALID,
     "invalid value type for 'u' parameter, expected int64_param, bool_param, or string_param."),
    ("string-classification", with_outputs(simple(), ("OUTPUT0", {"classification": ("string_param", "2")})),
     INVALID, "invalid value type for 'classification' parameter, expected int64_param"),
    ("raw-and-typed-mixed", _mixed, INVALID,
     "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"),
    ("typed-wrong-field", _edit(simple_typed(), lambda r: (r.inputs[0].contents.ClearField("int_contents"),
                                                           r.inputs[0].contents.fp32_contents.extend(A.tolist()))),
     INVALID, "unexpected explicit tensor data for input tensor 'INPUT0' for model 'simple' of type 'FP32', "
              "expected datatype 'INT32'"),
    ("typed-count-short", _edit(simple_typed(), lambda r: r.inputs[0].contents.int_contents.pop()), INVALID,
     _rid("input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60")),
    ("typed-fp16-has-no-field", infer("identity_fp16", ("INPUT0", "FP16", [1, 2], {"fp32_contents": [1.0, 2.0]})),
     INVALID, "unexpected explicit tensor data for input tensor 'INPUT0' for model 'identity_fp16' of type 'FP32', "
              "expected datatype 'FP16'"),
    ("raw-short", _edit(simple(), lambda r: r.raw_input_contents.__setitem__(0, A.tobytes()[:-4])), INVALID,
     _rid("input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60")),
    ("raw-long", _edit(simple(), lambda r: r.raw_input_contents.__setitem__(1, B.tobytes() + b"xxxx")), INVALID,
     _rid("input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 68")),
    ("bytes-typed-fewer-than-shape", infer("identity_bytes", ("INPUT0", "BYTES", [1, 4],
                                                              {"bytes_contents": BYTES_ITEMS})), INVALID,
     _rid("expected 4 string elements for inference input 'INPUT0' for model 'identity_bytes', got 3")),
    ("bytes-raw-fewer-than-shape", infer("identity_bytes", ("INPUT0", "BYTES", [1, 4], length_prefixed(BYTES_ITEMS))),
     INVALID, _rid("expected 4 string elements for inference input 'INPUT0' for model 'identity_bytes', got 3")),
    ("bytes-raw-more-than-shape", infer("identity_bytes", ("INPUT0", "BYTES", [1, 2], length_prefixed(BYTES_ITEMS))),
     INVALID, _rid("unexpected number of string elements 3 for inference input 'INPUT0' for model 'identity_bytes', "
                   "expecting 2")),
    ("bytes-raw-short-length", infer("identity_bytes", ("INPUT0", "BYTES", [1, 1], b"\x05\x00")), INVALID,
     _rid("incomplete string length indicator for inference input 'INPUT0' for model 'identity_bytes', expecting 4 "
          "bytes but only 2 bytes available. Please make sure the string length indicator is in one buffer.")),
    ("bytes-raw-short-data", infer("identity_bytes", ("INPUT0", "BYTES", [1, 1], b"\x05\x00\x00\x00ab")), INVALID,
     "incomplete string data for inference input 'INPUT0', expecting string of length 5 but only 2 bytes available"),
    ("shm-unknown-region", with_parameters(simple(), shm("nope", 64), 0), NOT_FOUND,
     "Unable to find shared memory region: 'nope'"),
    ("shm-output-unknown-region", with_outputs(simple(), ("OUTPUT0", shm("nope", 64))), NOT_FOUND,
     "Unable to find shared memory region: 'nope'"),
    ("shm-window-past-region", _shm_request(in_offset=200), INVALID,
     "Invalid offset + byte size for shared memory region: 'in'"),
    ("shm-byte-size-not-shape", _shm_request(in_size=60), INVALID,
     _rid("input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 60")),
    ("shm-output-too-small", _shm_request(out_size=60), grpc.StatusCode.INTERNAL,
     "shared memory size specified with the request for output 'OUTPUT0' (60 bytes) should be at least 64 bytes to "
     "hold the results"),
    ("shm-byte-size-wrong-type", with_parameters(simple(), {
        "shared_memory_region": ("string_param", "in"), "shared_memory_byte_size": ("string_param", "x")}, 0),
     INVALID, "invalid value type for 'shared_memory_byte_size' parameter for tensor 'INPUT0', expected int64_param."),
    ("shm-byte-size-missing", with_parameters(simple(), {"shared_memory_region": ("string_param", "in")}, 0),
     INVALID, "'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter for tensor "
              "'INPUT0'"),
]


@pytest.mark.parametrize("case", BADS, ids=[c[0] for c in BADS])
def test_inference_refused(servers: Servers, case: tuple) -> None:
    _, build, code, message = case
    request = build() if callable(build) else build
    assert_same_error(*servers.both("ModelInfer", request), code, message)
    ready = servers.both("ServerReady", pb.ServerReadyRequest())
    assert all(a.response.ready for a in ready)  # refused requests leave both serving


# ------------------------------------------------------------------------------------------ streaming


def _stream(stub: Stub, requests: list[pb.ModelInferRequest], metadata: tuple = ()) -> tuple[list, Answer]:
    responses = []
    try:
        for response in stub.ModelStreamInfer(iter(requests), timeout=30, metadata=metadata):
            responses.append(response)
        return responses, Answer(grpc.StatusCode.OK, "", None)
    except grpc.RpcError as exc:
        return responses, Answer(exc.code(), exc.details(), None)


def test_stream_answers_every_request_errors_in_band(servers: Servers) -> None:
    requests = [simple(id="s1"), _edit(simple(id="s2"), lambda r: setattr(r, "model_name", "nope")),
                simple(a=A[:15], id="s3"), simple(id="s4"), simple(2, id="s5")]
    (t_responses, t_end), (g_responses, g_end) = (_stream(s, requests) for s in (servers.triton, servers.geserve))
    assert t_end.code == g_end.code == grpc.StatusCode.OK
    t_by_id = {r.infer_response.id: r for r in t_responses}
    g_by_id = {r.infer_response.id: r for r in g_responses}
    assert sorted(g_by_id) == sorted(t_by_id) == ["s1", "s2", "s3", "s4", "s5"]
    for request_id, t_response in t_by_id.items():
        g_response = g_by_id[request_id]
        assert g_response.error_message == t_response.error_message, request_id
        if t_response.error_message:
            assert g_response.infer_response == t_response.infer_response
        else:
            assert_same_response(Answer(grpc.StatusCode.OK, "", t_response.infer_response),
                                 Answer(grpc.StatusCode.OK, "", g_response.infer_response))


def test_stream_with_grpc_error_header_ends_on_a_failed_request(servers: Servers) -> None:
    """geserve ends the stream with the request's status; Triton 2.51 keeps faults found before the model in-band."""
    requests = [simple(id="s1"), simple(a=A[:15], id="bad")]
    metadata = (("triton_grpc_error", "true"),)
    t_responses, t_end = _stream(servers.triton, requests, metadata)
    assert t_end.code == grpc.StatusCode.OK and [r.error_message for r in t_responses] == ["", _SHAPE_15.replace(
        "<id_unknown>", "bad")]
    g_responses, g_end = _stream(servers.geserve, requests, metadata)
    assert {r.infer_response.id for r in g_responses} <= {"s1"}  # "s1" may still be running when "bad" ends it
    assert (g_end.code, g_end.message) == (INVALID, _SHAPE_15.replace("<id_unknown>", "bad"))


# ------------------------------------------------------------------------------ malformed and newer Triton


@pytest.mark.parametrize("rpc", ["ModelInfer", "ModelMetadata", "ModelConfig", "RepositoryModelLoad", "ServerLive",
                                 "SystemSharedMemoryRegister", "LogSettings"])
def test_bytes_that_do_not_parse_triton_internal_geserve_invalid_argument(servers: Servers, rpc: str) -> None:
    """Not the request message: Triton's gRPC library answers INTERNAL "Unable to parse request" before Triton's
    code runs; geserve answers INVALID_ARGUMENT (the client's fault) with those words and the parser's reason."""
    answers = []
    for target in servers.targets:
        with grpc.insecure_channel(target) as channel:
            try:
                channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")(b"\xff\xff\xff", timeout=30)
                answers.append(Answer(grpc.StatusCode.OK, "", None))
            except grpc.RpcError as exc:
                answers.append(Answer(exc.code(), exc.details(), None))
    triton, geserve = answers
    assert (triton.code, triton.message) == (grpc.StatusCode.INTERNAL, "Unable to parse request")
    assert geserve.code == INVALID and geserve.message.startswith("Unable to parse request: ")


def test_stream_message_that_does_not_parse(servers: Servers) -> None:
    """Triton ends the stream OK and drops the message; geserve answers it in band and serves the next one."""
    ends = []
    for target in servers.targets:
        with grpc.insecure_channel(target) as channel:
            stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                           response_deserializer=pb.ModelStreamInferResponse.FromString)
            ends.append(list(stream(iter([b"\xff\xff\xff", simple(id="s1").SerializeToString()]), timeout=30)))
    triton, geserve = ends
    assert len(triton) <= 1 and all(r.infer_response.id == "s1" for r in triton)
    assert [r.error_message.startswith("Unable to parse request: ") for r in geserve] == [True, False]
    assert geserve[1].infer_response.id == "s1"


def test_output_asked_twice_triton_251_answers_once_geserve_refuses_as_newer_triton(servers: Servers) -> None:
    triton, geserve = servers.both("ModelInfer", with_outputs(simple(), ("OUTPUT0", {}), ("OUTPUT0", {})))
    assert triton.code == grpc.StatusCode.OK and [o.name for o in triton.response.outputs] == ["OUTPUT0"]
    assert decode(triton.response)["OUTPUT0"].tolist() == SUM.tolist()
    assert (geserve.code, geserve.message) == (
        INVALID, "[request id: <id_unknown>] output 'OUTPUT0' already exists in request")


def test_shape_past_int64_elements_in_newer_tritons_words(servers: Servers) -> None:
    request = _edit(simple(), lambda r: (r.inputs[0].shape.__setitem__(0, 16), r.inputs[0].shape.__setitem__(
        1, 2**60 + 2)))
    triton, geserve = servers.both("ModelInfer", request)
    assert triton.code == INVALID  # 2.51: the batch size or the shape, found on the overflowed count
    assert (geserve.code, geserve.message) == (
        INVALID, f"input 'INPUT0' with shape [16,{2**60 + 2}] causes total element count to exceed maximum size of "
                 f"{2**63 - 1}")


# ------------------------------------------------------------------------------------------ statistics


def _counts(entry: pb.ModelStatistics) -> dict:
    as_dict = json_format.MessageToDict(entry, preserving_proto_field_name=True)
    stats = as_dict.get("inference_stats", {})
    return {
        "name": entry.name, "version": entry.version, "inference_count": entry.inference_count,
        "execution_count": entry.execution_count,
        "inference_stats": {k: v.get("count", "0") for k, v in stats.items()},
        "batch_stats": [(b["batch_size"], {k: v.get("count", "0") for k, v in b.items() if k != "batch_size"})
                        for b in as_dict.get("batch_stats", [])],
    }


def test_statistics_count_known_traffic_exactly(servers: Servers) -> None:
    request = pb.ModelStatisticsRequest(name=STATS_MODEL)
    triton, geserve = servers.both("ModelStatistics", request)
    assert _counts(geserve.response.model_stats[0]) == _counts(triton.response.model_stats[0])
    for rows in (1, 2, 2, 3, 1):
        assert all(a.code == grpc.StatusCode.OK for a in servers.both("ModelInfer", _edit(
            simple(rows), lambda r: setattr(r, "model_name", STATS_MODEL))))
    refused = _edit(simple(a=A[:8]), lambda r: setattr(r, "model_name", STATS_MODEL))
    assert all(a.code == INVALID for a in servers.both("ModelInfer", refused))

    deadline = time.monotonic() + 5
    while True:
        triton, geserve = servers.both("ModelStatistics", request)
        t_entry, g_entry = triton.response.model_stats[0], geserve.response.model_stats[0]
        if t_entry.inference_stats.success.count == 5 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert _counts(g_entry) == _counts(t_entry)
    assert g_entry.inference_count == 9 and g_entry.execution_count == 5 and g_entry.last_inference > 0
