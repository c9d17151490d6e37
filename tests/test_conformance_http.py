"""Conformance: the same raw HTTP requests sent to geserve and to the real NVIDIA Triton server must agree.

Both servers run once for the module on equivalent repositories: geserve serves the ONNX test models on its GE
backend; Triton serves the same ONNX files through generated Python-backend models
(`tests.support.reference.build_python_backend_repository`). Every case goes out byte for byte the same to both,
over plain `http.client`, and the answers are compared: status code, content type, JSON shape (same keys, same
types), values where they are deterministic, and output tensors decoded (binary or JSON) and compared with numpy.

Read the tables as the spec. Deliberate differences are named where they are asserted:

- a client's malformed request that Triton answers with 500 (unparsable JSON, a `data` count that does not match
  the shape, JSON values of the wrong type, missing members) geserve answers with 400 (`*_triton_500_geserve_400`);
- FP16 tensors in JSON, which Triton refuses, geserve serves (`test_fp16_json_is_a_geserve_extension`);
- server name/version, `platform`/`backend`/`default_model_filename` (Triton runs these models as `python`),
  nanosecond timings, and the two config fields newer than the `model_config.proto` geserve is built on;
- the order of `outputs` in a response (Triton's follows its backend; clients look outputs up by name);
- where newer Triton changed its answers, geserve answers as newer Triton (issue 12), asserted beside 2.51's own:
  an output named twice is refused, JSON nested past 100 levels and a shape past int64 elements are refused in
  newer Triton's words, a repository index `ready` that is no boolean is worded as newer Triton words it;
- a gzip body of several members (a client compressing as it streams) and a gzip transfer coding, which Triton
  2.51 does not decode, geserve decodes (`test_gzip_members_and_transfer_codings_geserve_decodes`).

Both serve system shared memory (geserve behind `--allow-system-shared-memory`): two regions, `in` (holding the
inputs the shared memory cases read) and `out`, are registered on both servers at the start, over HTTP.
Settings type errors that Triton answers with 500 geserve answers with 400, as for inference (the trace settings
with a trace file set, and tracing itself, are compared in tests/test_tracing.py).

All six models serve under Triton's Python backend; for `identity_bytes` the generated model stringifies BYTES
values (`b'...'`), which `unmangle` undoes before comparing. Not sent: classification of a BYTES output, which
crashes Triton 2.51.
"""

from __future__ import annotations

import ast
import base64
import functools
import gzip
import http.client
import json
import socket
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from tritonclient.utils import deserialize_bytes_tensor

from tests.support import models
from tests.support.conformance import MODELS, STATS_MODEL, server_pair
from tests.support.shm import Region

pytestmark = pytest.mark.reference

JSON_CT = "application/json"
TEXT_CT = "text/plain"
INFERENCE_STATS_KEYS = {
    "success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss"
}
# Fields of Triton 2.51's model_config.proto that the tritonclient 2.41 proto geserve prints /config from lacks.
NEWER_CONFIG_FIELDS = {"runtime", "is_non_linear_format_io"}
NUMPY = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}


# ------------------------------------------------------------------------------------------ the wire


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    def plain_body(self) -> bytes:
        encoding = self.headers.get("content-encoding")
        if encoding == "gzip":
            return gzip.decompress(self.body)
        if encoding == "deflate":
            return zlib.decompress(self.body)
        return self.body

    def json(self) -> Any:
        return json.loads(self.plain_body())

    def error(self) -> str:
        body = self.json()
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]


def send(base: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
    url = urlsplit(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()




@dataclass(frozen=True)
class Servers:
    triton: str
    geserve: str
    shm_in: Region
    shm_out: Region

    def both(
        self, method: str, path: str, body: bytes | dict | list | None = None, headers: dict[str, str] | None = None
    ) -> tuple[Reply, Reply]:
        if isinstance(body, dict | list):
            body = json.dumps(body).encode()
        return send(self.triton, method, path, body, headers), send(self.geserve, method, path, body, headers)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with server_pair(tmp_path_factory.mktemp("conformance")) as pair:
        regions = pair.regions
        regions[0].memory[:SHM_IN_SIZE] = SHM_IN
        servers = Servers(f"http://{pair.triton_http}", pair.geserve.base, *regions)
        for name, region in (("in", regions[0]), ("out", regions[1])):
            path = f"/v2/systemsharedmemory/region/{name}/register"
            replies = servers.both("POST", path, {"key": region.key, "offset": 0, "byte_size": 256})
            assert [(r.status, r.body) for r in replies] == [(200, b"")] * 2, replies
        yield servers


# --------------------------------------------------------------------------------- request builders

A = np.arange(16, dtype=np.int32)
B = np.full(16, 3, dtype=np.int32)


def simple_inputs(rows: int = 1, binary: bool = False) -> tuple[dict, bytes]:
    a, b = np.tile(A, (rows, 1)), np.tile(B, (rows, 1))
    tensors = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor: dict[str, Any] = {"name": name, "shape": list(value.shape), "datatype": "INT32"}
        if binary:
            tensor["parameters"] = {"binary_data_size": value.nbytes}
        else:
            tensor["data"] = value.reshape(-1).tolist()
        tensors.append(tensor)
    return {"inputs": tensors}, (a.tobytes() + b.tobytes() if binary else b"")


def simple_json(**extra: Any) -> dict:
    header, _ = simple_inputs()
    return {**header, **extra}


def binary_request(header: dict, payload: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + payload, {"Inference-Header-Content-Length": str(len(head))}


def length_prefixed(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in items)


def digits_rows(count: int = 2) -> np.ndarray:
    pixels, _ = models.digits_test_set()
    return np.ascontiguousarray(pixels[:count], dtype=np.float32)


def digits_json(count: int = 2, **extra: Any) -> dict:
    rows = digits_rows(count)
    return {"inputs": [{"name": "pixels", "shape": list(rows.shape), "datatype": "FP32",
                        "data": rows.reshape(-1).tolist()}], **extra}


NOBATCH_IN = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], dtype=np.float32)
BYTES_ITEMS = [b"hello", b"", "\u00e9t\u00e9".encode()]
# The `in` region: INPUT0 and INPUT1 of `simple` at 0 and 64, BYTES_ITEMS (length-prefixed) at 128.
SHM_BYTES = b"".join(struct.pack("<I", len(v)) + v for v in BYTES_ITEMS)
SHM_IN = A.tobytes() + B.tobytes() + SHM_BYTES
SHM_IN_SIZE = len(SHM_IN)


def shm(region: str, size: int, offset: int = 0) -> dict:
    """The parameters placing a tensor in a registered shared memory region."""
    parameters: dict[str, Any] = {"shared_memory_region": region, "shared_memory_byte_size": size}
    if offset:
        parameters["shared_memory_offset"] = offset
    return parameters


# ----------------------------------------------------------------------------------- decoding replies


def decode_outputs(reply: Reply) -> tuple[dict, dict[str, np.ndarray]]:
    """The JSON header and every output as a numpy array, whether it came as JSON data or binary."""
    body = reply.plain_body()
    length = reply.headers.get("inference-header-content-length")
    split = int(length) if length is not None else len(body)
    header = json.loads(body[:split])
    offset, arrays = split, {}
    for output in header["outputs"]:
        datatype, shape = output["datatype"], output["shape"]
        size = output.get("parameters", {}).get("binary_data_size")
        if size is not None:
            raw = body[offset : offset + size]
            offset += size
            bytes_tensor = datatype == "BYTES"
            array = deserialize_bytes_tensor(raw) if bytes_tensor else np.frombuffer(raw, dtype=NUMPY[datatype])
        elif datatype == "BYTES":
            array = np.empty(len(output["data"]), dtype=object)
            array[:] = [v.encode() for v in output["data"]]
        else:
            array = np.asarray(output["data"], dtype=NUMPY[datatype])
        arrays[output["name"]] = array.reshape(shape)
    assert offset == len(body), "binary data left over after the last output"
    return header, arrays


def unmangle(value: bytes) -> bytes:
    """The reference Python-backend model hands ORT `bytes` objects, which ORT stringifies (`b'...'`); undo that.

    A no-op for values that do not look like a bytes literal, so the comparison keeps working once the
    reference model decodes its inputs to text.
    """
    if len(value) >= 3 and value[:2] in (b"b'", b'b"') and value[-1:] == value[1:2]:
        return ast.literal_eval(value.decode())
    return value


def strip_values(value: Any) -> Any:
    """The JSON's shape: keys and value types, without values (list lengths kept)."""
    if isinstance(value, dict):
        return {k: strip_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [strip_values(v) for v in value]
    return type(value).__name__


def assert_same_error(triton: Reply, geserve: Reply, status: int, message: str | None = None) -> None:
    """Both refuse with `status`, the same content type and `{"error": str}`; `message`: Triton's text, verbatim."""
    assert (triton.status, geserve.status) == (status, status), (triton.body, geserve.body)
    assert geserve.content_type == triton.content_type
    triton_error, geserve_error = triton.error(), geserve.error()
    if message is not None:
        assert triton_error == message, "the reference changed: update the expected text"
        assert geserve_error == triton_error


def assert_same_outputs(triton: Reply, geserve: Reply, expected: dict[str, np.ndarray] | None = None) -> dict:
    """Same status, framing and JSON shape; the same tensors (floats to 1e-6); geserve's equal to `expected`."""
    assert (triton.status, geserve.status) == (200, 200), (triton.body[:300], geserve.body[:300])
    assert geserve.content_type == triton.content_type
    assert geserve.headers.get("content-encoding") == triton.headers.get("content-encoding")
    framed = "inference-header-content-length"
    assert (framed in geserve.headers) == (framed in triton.headers)
    t_header, t_arrays = decode_outputs(triton)
    g_header, g_arrays = decode_outputs(geserve)
    assert list(g_header) == list(t_header)
    for key in ("id", "model_name", "model_version"):
        assert g_header.get(key) == t_header.get(key)
    # The order of `outputs` is each server's own (Triton's follows its backend); clients look outputs up by name.
    t_outputs = {o["name"]: o for o in t_header["outputs"]}
    g_outputs = {o["name"]: o for o in g_header["outputs"]}
    assert sorted(g_outputs) == sorted(t_outputs) and len(g_outputs) == len(g_header["outputs"])
    for name, t_out in t_outputs.items():
        g_out, t_value, g_value = g_outputs[name], t_arrays[name], g_arrays[name]
        assert set(g_out) == set(t_out)
        assert (g_out["datatype"], g_out["shape"]) == (t_out["datatype"], t_out["shape"])
        if t_out["datatype"] == "BYTES":
            plain = np.vectorize(unmangle, otypes=[object])(t_value) if t_value.size else t_value
            assert g_value.tolist() == plain.tolist(), name
            if plain.tolist() != t_value.tolist():  # stringified by the reference model: sizes differ
                assert set(g_out.get("parameters", {})) == set(t_out.get("parameters", {}))
                continue
        assert g_out.get("parameters") == t_out.get("parameters")
        if g_value.dtype.kind == "f":
            np.testing.assert_allclose(g_value, t_value, rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(g_value, t_value, err_msg=name)
    for name, value in (expected or {}).items():
        if value.dtype == object:
            assert g_arrays[name].tolist() == value.tolist(), name
        else:
            np.testing.assert_array_equal(g_arrays[name], value, err_msg=name)
    return g_header


# ----------------------------------------------------------------------------- health and metadata


def test_health_live_and_ready(servers: Servers) -> None:
    for path in ("/v2/health/live", "/v2/health/ready"):
        triton, geserve = servers.both("GET", path)
        assert (triton.status, triton.content_type, triton.body) == (200, TEXT_CT, b"")
        assert (geserve.status, geserve.content_type, geserve.body) == (200, TEXT_CT, b"")


def test_server_metadata_has_tritons_keys_and_a_subset_of_its_extensions(servers: Servers) -> None:
    """Name and version are the server's own; every extension geserve claims is one Triton has too."""
    triton, geserve = servers.both("GET", "/v2")
    assert (triton.status, geserve.status) == (200, 200)
    assert geserve.content_type == triton.content_type == JSON_CT
    assert strip_values({**geserve.json(), "extensions": []}) == strip_values({**triton.json(), "extensions": []})
    assert all(isinstance(e, str) for e in geserve.json()["extensions"])
    assert set(geserve.json()["extensions"]) <= set(triton.json()["extensions"])


@pytest.mark.parametrize("path_tail", ["", "/versions/1"], ids=["latest", "version-1"])
@pytest.mark.parametrize("model", MODELS)
def test_model_metadata(servers: Servers, model: str, path_tail: str) -> None:
    """Identical but for `platform`: Triton names the backend it runs these models on (`python`)."""
    triton, geserve = servers.both("GET", f"/v2/models/{model}{path_tail}")
    assert (triton.status, geserve.status) == (200, 200)
    assert geserve.content_type == triton.content_type == JSON_CT
    t_meta, g_meta = triton.json(), geserve.json()
    assert t_meta["platform"] == "python" and isinstance(g_meta["platform"], str) and g_meta["platform"]
    assert list(g_meta) == list(t_meta)
    assert {**g_meta, "platform": ""} == {**t_meta, "platform": ""}


@pytest.mark.parametrize("model", MODELS)
def test_model_ready(servers: Servers, model: str) -> None:
    for path in (f"/v2/models/{model}/ready", f"/v2/models/{model}/versions/1/ready"):
        triton, geserve = servers.both("GET", path)
        assert (triton.status, triton.content_type, triton.body) == (200, TEXT_CT, b"")
        assert (geserve.status, geserve.content_type, geserve.body) == (200, TEXT_CT, b"")


def _config_keys(value: Any, path: str = "") -> set[str]:
    keys: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            if key in NEWER_CONFIG_FIELDS:
                continue
            keys.add(f"{path}/{key}")
            if path.endswith(("/parameters", "/cc_model_filenames", "/metric_tags")):
                continue  # map values: their keys are data, not schema
            keys |= _config_keys(item, f"{path}/{key}")
    elif isinstance(value, list):
        for item in value:
            keys |= _config_keys(item, f"{path}[]")
    return keys


@pytest.mark.parametrize("model", MODELS)
def test_model_config(servers: Servers, model: str) -> None:
    """Every field Triton prints (defaults included) with the same main values.

    `platform`, `backend` and `default_model_filename` legitimately differ (Triton runs these models as
    Python-backend models); `runtime` and `is_non_linear_format_io` are newer than geserve's model_config.proto.
    """
    triton, geserve = servers.both("GET", f"/v2/models/{model}/config")
    assert (triton.status, geserve.status) == (200, 200)
    assert geserve.content_type == triton.content_type == JSON_CT
    t_cfg, g_cfg = triton.json(), geserve.json()
    assert _config_keys(g_cfg) == _config_keys(t_cfg)
    assert t_cfg["backend"] == "python" and (g_cfg["platform"] or g_cfg["backend"])
    for key in ("name", "max_batch_size", "version_policy", "batch_input", "batch_output", "optimization",
                "parameters", "model_warmup", "metric_tags"):
        assert g_cfg[key] == t_cfg[key], key

    def io(entries: list[dict]) -> list[dict]:
        return [{k: v for k, v in e.items() if k not in NEWER_CONFIG_FIELDS} for e in entries]

    assert io(g_cfg["input"]) == io(t_cfg["input"])
    assert io(g_cfg["output"]) == io(t_cfg["output"])
    groups = [(g["kind"], g["count"], g["gpus"]) for g in g_cfg["instance_group"]]
    assert groups == [(g["kind"], g["count"], g["gpus"]) for g in t_cfg["instance_group"]]


# ------------------------------------------------------------------- errors outside inference, routes


@dataclass(frozen=True)
class Refusal:
    """A request both servers refuse the same way: status, content type, and (when set) Triton's exact text."""

    id: str
    method: str
    path: str
    status: int
    message: str | None = None
    body: bytes | dict | None = None
    headers: dict[str, str] = field(default_factory=dict)


NOT_FOUND = "Not Found"
NOT_ALLOWED = "Method Not Allowed"
NONE_MODE = "explicit model load / unload is not allowed if polling is enabled"

REFUSALS = [
    Refusal("metadata-unknown-model", "GET", "/v2/models/nope", 404, "Request for unknown model: 'nope' is not found"),
    Refusal("metadata-unknown-version", "GET", "/v2/models/simple/versions/7", 404,
            "Request for unknown model: 'simple' version 7 is not found"),
    Refusal("metadata-unknown-model-version", "GET", "/v2/models/nope/versions/7", 404,
            "Request for unknown model: 'nope' is not found"),
    Refusal("config-unknown-model", "GET", "/v2/models/nope/config", 404,
            "Request for unknown model: 'nope' is not found"),
    Refusal("config-unknown-version", "GET", "/v2/models/simple/versions/7/config", 404,
            "Request for unknown model: 'simple' version 7 is not found"),
    Refusal("ready-unknown-model", "GET", "/v2/models/nope/ready", 400, "Model version not ready"),
    Refusal("ready-unknown-version", "GET", "/v2/models/simple/versions/7/ready", 400, "Model version not ready"),
    Refusal("stats-unknown-model", "GET", "/v2/models/nope/stats", 400, "requested model 'nope' is not available"),
    Refusal("stats-unknown-version", "GET", "/v2/models/simple/versions/7/stats", 400,
            "requested model version is not available for model 'simple'"),
    Refusal("load-none-mode", "POST", "/v2/repository/models/simple/load", 503, NONE_MODE, {}),
    Refusal("load-unknown-none-mode", "POST", "/v2/repository/models/nope/load", 503, NONE_MODE, {}),
    Refusal("unload-none-mode", "POST", "/v2/repository/models/simple/unload", 503, NONE_MODE, {}),
    Refusal("route-unknown", "GET", "/v2/nonexistent", 404, NOT_FOUND),
    Refusal("route-outside-v2", "GET", "/nothing", 404, NOT_FOUND),
    Refusal("route-v2-slash", "GET", "/v2/", 404, NOT_FOUND),
    # GET /v2/models is not here: Triton answers it 404, geserve lists the models (a documented difference, tested in
    # tests/test_server_lifecycle.py).
    Refusal("route-health", "GET", "/v2/health", 404, NOT_FOUND),
    Refusal("route-model-action", "GET", "/v2/models/simple/foo", 404, NOT_FOUND),
    Refusal("route-version-action", "GET", "/v2/models/simple/versions/1/foo", 404, NOT_FOUND),
    Refusal("route-versions", "GET", "/v2/models/simple/versions", 404, NOT_FOUND),
    Refusal("route-version-not-number", "GET", "/v2/models/simple/versions/abc", 404, NOT_FOUND),
    Refusal("route-infer-version-not-number", "POST", "/v2/models/simple/versions/abc/infer", 404, NOT_FOUND,
            simple_json()),
    Refusal("route-stats-extra", "GET", "/v2/models/stats/extra", 404, NOT_FOUND),
    Refusal("route-repository-action", "POST", "/v2/repository/models/simple/foo", 404, NOT_FOUND, {}),
    Refusal("method-health", "POST", "/v2/health/live", 405, NOT_ALLOWED),
    Refusal("method-server-metadata", "POST", "/v2", 405, NOT_ALLOWED),
    Refusal("method-model-metadata", "DELETE", "/v2/models/simple", 405, NOT_ALLOWED),
    Refusal("method-infer-get", "GET", "/v2/models/simple/infer", 405, NOT_ALLOWED),
    Refusal("method-infer-put", "PUT", "/v2/models/simple/infer", 405, NOT_ALLOWED, {}),
    Refusal("method-all-stats", "POST", "/v2/models/stats", 405, NOT_ALLOWED),
    Refusal("method-repository-index", "GET", "/v2/repository/index", 405, NOT_ALLOWED),
    # shared memory, logging and trace settings
    Refusal("shm-status-unknown", "GET", "/v2/systemsharedmemory/region/nope/status", 404,
            "Unable to find system shared memory region: 'nope'"),
    Refusal("shm-register-twice", "POST", "/v2/systemsharedmemory/region/in/register", 400,
            "shared memory region 'in' already in manager", {"key": "/whatever", "byte_size": 8}),
    Refusal("shm-register-no-key", "POST", "/v2/systemsharedmemory/region/x/register", 400,
            "Shared memory register request has no 'key' field", {"offset": 0, "byte_size": 8}),
    Refusal("shm-register-no-byte-size", "POST", "/v2/systemsharedmemory/region/x/register", 400,
            "Shared memory register request has no 'byte_size' field", {"key": "/whatever"}),
    Refusal("shm-register-missing-key", "POST", "/v2/systemsharedmemory/region/x/register", 500,
            "Unable to open shared memory region: '/geserve-no-such-key'", {"key": "/geserve-no-such-key",
                                                                            "byte_size": 8}),
    Refusal("cuda-shm-status-unknown", "GET", "/v2/cudasharedmemory/region/x/status", 404,
            "Unable to find cuda shared memory region: 'x'"),
    Refusal("cuda-shm-register-no-handle", "POST", "/v2/cudasharedmemory/region/x/register", 400,
            "Shared memory register request has no 'raw_handle' field", {"device_id": 0, "byte_size": 8}),
    Refusal("cuda-shm-register-without-gpu", "POST", "/v2/cudasharedmemory/region/x/register", 400,
            "failed to register shared memory region: invalid args",
            {"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "device_id": 0, "byte_size": 8}),
    Refusal("log-format-invalid", "POST", "/v2/logging", 503, "invalid argument for --log_format, got: bad",
            {"log_format": "bad"}),
    Refusal("log-file", "POST", "/v2/logging", 501, "log file location can not be updated through network protocol",
            {"log_file": ""}),
    Refusal("trace-rate-not-a-number", "POST", "/v2/trace/setting", 400, "Unable to parse 'trace_rate', got: x",
            {"trace_rate": "x"}),
    Refusal("trace-unknown-model", "GET", "/v2/models/nope/trace/setting", 400, "Request for unknown model : nope"),
    Refusal("trace-update-unknown-model", "POST", "/v2/models/nope/trace/setting", 400,
            "Request for unknown model : nope", {}),
    Refusal("route-shm", "GET", "/v2/systemsharedmemory", 404, NOT_FOUND),
    Refusal("route-shm-region", "GET", "/v2/systemsharedmemory/region/in", 404, NOT_FOUND),
    Refusal("route-shm-register-no-name", "POST", "/v2/systemsharedmemory/region//register", 404, NOT_FOUND,
            {"key": "/whatever", "byte_size": 8}),
    Refusal("route-trace", "GET", "/v2/trace", 404, NOT_FOUND),
    Refusal("route-trace-version", "GET", "/v2/models/simple/versions/1/trace/setting", 404, NOT_FOUND),
    Refusal("method-shm-status", "POST", "/v2/systemsharedmemory/status", 405, NOT_ALLOWED),
    Refusal("method-shm-register", "GET", "/v2/systemsharedmemory/region/in/register", 405, NOT_ALLOWED),
    Refusal("method-shm-unregister", "GET", "/v2/systemsharedmemory/unregister", 405, NOT_ALLOWED),
    Refusal("method-cuda-shm-unregister", "GET", "/v2/cudasharedmemory/unregister", 405, NOT_ALLOWED),
    Refusal("method-logging", "PUT", "/v2/logging", 405, NOT_ALLOWED),
    Refusal("method-trace", "PUT", "/v2/trace/setting", 405, NOT_ALLOWED),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c.id for c in REFUSALS])
def test_refusal(servers: Servers, case: Refusal) -> None:
    triton, geserve = servers.both(case.method, case.path, case.body, case.headers)
    assert_same_error(triton, geserve, case.status, case.message)


@pytest.mark.parametrize("body", [b"{}", b'{"ready": false}', b'{"ready": true}', b""], ids=["empty", "all", "ready",
                                                                                         "no-body"])
def test_repository_index(servers: Servers, body: bytes) -> None:
    triton, geserve = servers.both("POST", "/v2/repository/index", body)
    assert (triton.status, geserve.status) == (200, 200)
    assert geserve.content_type == triton.content_type == JSON_CT
    assert geserve.json() == triton.json()
    assert {e["name"] for e in geserve.json()} == {*MODELS, STATS_MODEL}


@pytest.mark.parametrize(
    "body", [b"{bad", b'{"ready": "yes"}'], ids=["malformed-json", "ready-not-boolean"]
)
def test_repository_index_bad_body_triton_500_geserve_400(servers: Servers, body: bytes) -> None:
    """A client's malformed index request: Triton answers 500, geserve 400."""
    triton, geserve = servers.both("POST", "/v2/repository/index", body)
    assert (triton.status, geserve.status) == (500, 400)
    assert geserve.content_type == triton.content_type == JSON_CT
    triton.error(), geserve.error()


SETTINGS_PARSE_ERRORS = [
    ("log-verbose-boolean", "/v2/logging", {"log_verbose_level": True},
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ("log-verbose-negative", "/v2/logging", {"log_verbose_level": -1},
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ("log-info-string", "/v2/logging", {"log_info": "x"}, "attempt to access JSON non-boolean as boolean"),
    ("log-no-body", "/v2/logging", b"", None),
    ("trace-rate-number", "/v2/trace/setting", {"trace_rate": 5}, "attempt to access JSON non-string as string"),
    ("trace-level-not-array", "/v2/trace/setting", {"trace_level": "OFF"}, "attempt to access JSON non-array as array"),
    ("trace-malformed-json", "/v2/trace/setting", b"{bad", None),
    ("shm-register-byte-size-string", "/v2/systemsharedmemory/region/x/register", {"key": "/k", "byte_size": "8"},
     "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ("shm-register-key-number", "/v2/systemsharedmemory/region/x/register", {"key": 5, "byte_size": 8},
     "attempt to access JSON non-string as string"),
    ("shm-register-no-body", "/v2/systemsharedmemory/region/x/register", b"", None),
]


@pytest.mark.parametrize("case", SETTINGS_PARSE_ERRORS, ids=[c[0] for c in SETTINGS_PARSE_ERRORS])
def test_settings_parse_error_triton_500_geserve_400(servers: Servers, case: tuple) -> None:
    _, path, body, message = case
    triton, geserve = servers.both("POST", path, body)
    assert (triton.status, geserve.status) == (500, 400), (triton.body, geserve.body)
    assert geserve.content_type == triton.content_type == JSON_CT
    if message is None:
        prefix = "failed to parse the request JSON buffer: "
        assert triton.error().startswith(prefix) and geserve.error().startswith(prefix)
    else:
        assert triton.error() == message, "the reference changed: update the expected text"
        assert geserve.error() == message


def _same_json(triton: Reply, geserve: Reply) -> Any:
    assert (triton.status, geserve.status) == (200, 200), (triton.body, geserve.body)
    assert geserve.content_type == triton.content_type == JSON_CT
    assert geserve.body == triton.body  # the same keys, in the same order, with the same values
    return geserve.json()


def test_shared_memory_status_and_unregistering_unknown_regions(servers: Servers) -> None:
    regions = _same_json(*servers.both("GET", "/v2/systemsharedmemory/status"))
    assert [r["name"] for r in regions] == ["in", "out"]
    assert _same_json(*servers.both("GET", "/v2/systemsharedmemory/region/out/status")) == regions[1:]
    assert _same_json(*servers.both("GET", "/v2/cudasharedmemory/status")) == []
    for path in ("/v2/systemsharedmemory/region/nope/unregister", "/v2/cudasharedmemory/region/nope/unregister",
                 "/v2/cudasharedmemory/unregister"):
        triton, geserve = servers.both("POST", path)
        assert (triton.status, triton.content_type, triton.body) == (200, JSON_CT, b"")
        assert (geserve.status, geserve.content_type, geserve.body) == (200, JSON_CT, b"")


def test_logging_settings(servers: Servers) -> None:
    settings = _same_json(*servers.both("GET", "/v2/logging"))
    assert settings["log_verbose_level"] == 0
    for body in ({}, [1], {"unknown": 1}):
        assert _same_json(*servers.both("POST", "/v2/logging", body)) == settings
    try:
        changed = _same_json(*servers.both("POST", "/v2/logging", {"log_info": False, "log_format": "ISO8601"}))
        assert changed == {**settings, "log_info": False, "log_format": "ISO8601"}
        assert _same_json(*servers.both("GET", "/v2/logging")) == changed
    finally:
        restored = _same_json(*servers.both("POST", "/v2/logging", {"log_info": True, "log_format": "default"}))
    assert restored == settings


def test_trace_settings(servers: Servers) -> None:
    defaults = _same_json(*servers.both("GET", "/v2/trace/setting"))
    assert defaults["trace_level"] == ["OFF"]
    assert _same_json(*servers.both("GET", "/v2/models/simple/trace/setting")) == defaults
    for body in ({}, {"bogus": 5}, {"trace_level": ["OFF"]}):
        assert _same_json(*servers.both("POST", "/v2/trace/setting", body)) == defaults
    try:
        rate = _same_json(*servers.both("POST", "/v2/trace/setting", {"trace_rate": "10"}))
        assert rate == {**defaults, "trace_rate": "10"}
        count = _same_json(*servers.both("POST", "/v2/models/simple/trace/setting", {"trace_count": "3"}))
        assert count == {**rate, "trace_count": "3"}
        assert _same_json(*servers.both("GET", "/v2/models/simple/trace/setting")) == count
        assert _same_json(*servers.both("GET", "/v2/trace/setting")) == rate
        cleared = _same_json(*servers.both("POST", "/v2/models/simple/trace/setting", {"trace_count": None}))
        assert cleared == rate
    finally:
        restored = _same_json(*servers.both("POST", "/v2/trace/setting", {"trace_rate": None}))
    assert restored == defaults


# ------------------------------------------------------------------------------ inference that works


# A request body, or a function that makes it once the servers run (the digits data is built with them).
Body = bytes | dict | Callable[[], bytes | dict]


def _body(body: Body) -> bytes | dict:
    return body() if callable(body) else body


@dataclass(frozen=True)
class Infer:
    """One inference request; `expected`: what geserve must return, computed here (Triton must agree)."""

    id: str
    model: str
    body: Body
    headers: dict[str, str] = field(default_factory=dict)
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    path: str = ""

    @property
    def url(self) -> str:
        return self.path or f"/v2/models/{self.model}/infer"


def _binary(model: str, header: dict, payload: bytes, expected: dict | None = None, id: str = "") -> Infer:
    body, headers = binary_request(header, payload)
    return Infer(id, model, body, headers, expected or {})


def _digits_binary(rows: int, id: str) -> Infer:
    header = {"inputs": [{"name": "pixels", "shape": [rows, 64], "datatype": "FP32",
                          "parameters": {"binary_data_size": rows * 64 * 4}}],
              "parameters": {"binary_data_output": True}}
    head, headers = binary_request(header, b"")
    return Infer(id, "digits", lambda: head + digits_rows(rows).tobytes(), headers)


_SUM, _DIFF = A + B, A - B
_BOTH = {"OUTPUT0": _SUM[None], "OUTPUT1": _DIFF[None]}
_BIN_IN = simple_inputs(binary=True)
_GZ = json.dumps(simple_json()).encode()
_BYTES_RAW = length_prefixed(BYTES_ITEMS)
_BYTES_ARRAY = np.array([BYTES_ITEMS], dtype=object)
_BOOL = np.array([[True, False, True], [False, False, True]])
_FP16 = np.array([[1.5, -2.25, 65504.0, 0.1]], dtype=np.float16)
_BYTES_HEAD = {
    "name": "INPUT0", "shape": [1, 3], "datatype": "BYTES", "parameters": {"binary_data_size": len(_BYTES_RAW)}
}
_NOBATCH_JSON = {
    "inputs": [{"name": "INPUT0", "shape": [2, 3], "datatype": "FP32", "data": NOBATCH_IN.reshape(-1).tolist()}]
}


def _inputs(*tensors: dict, **extra: Any) -> dict:
    return {"inputs": list(tensors), **extra}


def _with_outputs(*outputs: dict, **extra: Any) -> dict:
    return simple_json(outputs=list(outputs), **extra)


def _shm_simple(in_size: int = 64, in_offset: int = 64, *outputs: dict) -> dict:
    """`simple` with both inputs read from the `in` region (INPUT1's window as given)."""
    inputs = [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": shm("in", 64)},
              {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": shm("in", in_size, in_offset)}]
    return {"inputs": inputs, **({"outputs": list(outputs)} if outputs else {})}


_SHM_OUT = ({"name": "OUTPUT0", "parameters": shm("out", 64)}, {"name": "OUTPUT1", "parameters": shm("out", 64, 64)})
_SHM_BYTES_IN = {"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES", "parameters": shm("in", len(SHM_BYTES), 128)}


INFERS = [
    Infer("json-all-outputs", "simple", simple_json(), expected=_BOTH),
    Infer("json-request-id-echo", "simple", simple_json(id="req-42"), expected=_BOTH),
    Infer("json-one-output", "simple", _with_outputs({"name": "OUTPUT1"}), expected={"OUTPUT1": _DIFF[None]}),
    Infer("json-explicit-version", "simple", simple_json(), expected=_BOTH, path="/v2/models/simple/versions/1/infer"),
    Infer("json-batch-of-3", "simple", simple_inputs(rows=3)[0],
          expected={"OUTPUT0": np.tile(_SUM, (3, 1)), "OUTPUT1": np.tile(_DIFF, (3, 1))}),
    Infer("json-nested-data", "simple",
          {"inputs": [{**simple_json()["inputs"][0], "data": [A.tolist()]}, simple_json()["inputs"][1]]},
          expected=_BOTH),
    Infer("json-empty-outputs-means-all", "simple", _with_outputs(), expected=_BOTH),
    Infer("json-unknown-parameters-pass", "simple",
          simple_json(parameters={"custom": "x", "priority": 0, "timeout": 1_000_000}), expected=_BOTH),
    Infer("json-input-and-output-parameters-pass", "simple",
          {"inputs": [{**simple_json()["inputs"][0], "parameters": {"foo": 1}}, simple_json()["inputs"][1]],
           "outputs": [{"name": "OUTPUT0", "parameters": {"bar": "x"}}]}, expected={"OUTPUT0": _SUM[None]}),
    _binary("simple", *_BIN_IN, expected=_BOTH, id="binary-inputs-json-outputs"),
    Infer("binary-data-output-all", "simple", simple_json(parameters={"binary_data_output": True}), expected=_BOTH),
    Infer("binary-per-output-mixed", "simple",
          _with_outputs({"name": "OUTPUT0", "parameters": {"binary_data": True}},
                        {"name": "OUTPUT1", "parameters": {"binary_data": False}}), expected=_BOTH),
    Infer("binary-data-output-ignored-for-listed-outputs", "simple",
          _with_outputs({"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"},
                        parameters={"binary_data_output": True}), expected=_BOTH),
    Infer("binary-output-listed-false", "simple",
          _with_outputs({"name": "OUTPUT0", "parameters": {"binary_data": False}},
                        parameters={"binary_data_output": True}), expected={"OUTPUT0": _SUM[None]}),
    _binary("simple", {**_BIN_IN[0], "parameters": {"binary_data_output": True}}, _BIN_IN[1], expected=_BOTH,
            id="binary-in-binary-out"),
    Infer("gzip-request", "simple", gzip.compress(_GZ), {"Content-Encoding": "gzip"}, expected=_BOTH),
    Infer("deflate-request", "simple", zlib.compress(_GZ), {"Content-Encoding": "deflate"}, expected=_BOTH),
    Infer("identity-content-encoding", "simple", _GZ, {"Content-Encoding": "identity"}, expected=_BOTH),
    Infer("gzip-response", "simple", _GZ, {"Accept-Encoding": "gzip"}, expected=_BOTH),
    Infer("deflate-response", "simple", _GZ, {"Accept-Encoding": "deflate"}, expected=_BOTH),
    Infer("gzip-preferred-response", "simple", _GZ, {"Accept-Encoding": "gzip, deflate"}, expected=_BOTH),
    Infer("unsupported-accept-encoding-plain", "simple", _GZ, {"Accept-Encoding": "br"}, expected=_BOTH),
    Infer("gzip-both-ways-binary", "simple", gzip.compress(json.dumps(simple_json(
        parameters={"binary_data_output": True})).encode()), {"Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
        expected=_BOTH),
    Infer("digits-json", "digits", digits_json),
    _digits_binary(3, "digits-binary"),
    Infer("classification-with-labels", "digits", functools.partial(
        digits_json, outputs=[{"name": "probabilities", "parameters": {"classification": 3}}])),
    Infer("classification-with-labels-binary", "digits", functools.partial(
        digits_json, outputs=[{"name": "probabilities", "parameters": {"classification": 2, "binary_data": True}}])),
    Infer("classification-k-clamped-to-classes", "digits", functools.partial(
        digits_json, 1, outputs=[{"name": "probabilities", "parameters": {"classification": 30}}])),
    Infer("classification-int64-without-labels", "digits", functools.partial(
        digits_json, outputs=[{"name": "label", "parameters": {"classification": 1}}, {"name": "probabilities"}])),
    Infer("classification-int-without-labels", "simple",
          _with_outputs({"name": "OUTPUT0", "parameters": {"classification": 2}}),
          expected={"OUTPUT0": np.array([[b"18:15", b"17:14"]], dtype=object)}),
    Infer("classification-without-batching", "nobatch",
          {**_NOBATCH_JSON, "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]},
          expected={"OUTPUT0": np.array([b"6.000000:5", b"4.000000:3"], dtype=object)}),
    Infer("classification-zero-is-off", "simple",
          _with_outputs({"name": "OUTPUT0", "parameters": {"classification": 0}}),
          expected={"OUTPUT0": _SUM[None]}),
    Infer("nobatch-json", "nobatch", _NOBATCH_JSON, expected={"OUTPUT0": np.maximum(NOBATCH_IN, 0)}),
    Infer("raw-body-single-input", "nobatch", NOBATCH_IN.tobytes(), {"Inference-Header-Content-Length": "0"},
          expected={"OUTPUT0": np.maximum(NOBATCH_IN, 0)}),
    Infer("raw-body-batch-1-deduced", "digits", lambda: digits_rows(1).tobytes(),
          {"Inference-Header-Content-Length": "0"}),
    Infer("raw-body-variable-dim-deduced", "identity_fp16", _FP16.tobytes(), {"Inference-Header-Content-Length": "0"},
          expected={"OUTPUT0": _FP16}),
    Infer("raw-body-bool", "identity_bool", _BOOL[:1].tobytes(), {"Inference-Header-Content-Length": "0"},
          expected={"OUTPUT0": _BOOL[:1]}),
    Infer("bytes-json", "identity_bytes",
          _inputs({"name": "INPUT0", "shape": [1, 3], "datatype": "BYTES", "data": [v.decode() for v in BYTES_ITEMS]}),
          expected={"OUTPUT0": _BYTES_ARRAY}),
    _binary("identity_bytes",
            {"inputs": [_BYTES_HEAD], "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]},
            _BYTES_RAW, expected={"OUTPUT0": _BYTES_ARRAY}, id="bytes-length-prefixed-both-ways"),
    _binary("identity_bytes", {"inputs": [_BYTES_HEAD]}, _BYTES_RAW, expected={"OUTPUT0": _BYTES_ARRAY},
            id="bytes-length-prefixed-in-json-out"),
    Infer("bool-json", "identity_bool",
          {"inputs": [{"name": "INPUT0", "shape": [2, 3], "datatype": "BOOL", "data": _BOOL.reshape(-1).tolist()}]},
          expected={"OUTPUT0": _BOOL}),
    _binary("identity_bool", {"inputs": [{"name": "INPUT0", "shape": [2, 3], "datatype": "BOOL",
                                          "parameters": {"binary_data_size": 6}}],
                              "parameters": {"binary_data_output": True}},
            _BOOL.tobytes(), expected={"OUTPUT0": _BOOL}, id="bool-binary"),
    _binary("identity_fp16", {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP16",
                                          "parameters": {"binary_data_size": 8}}],
                              "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]},
            _FP16.tobytes(), expected={"OUTPUT0": _FP16}, id="fp16-binary"),
    Infer("shm-inputs-json-outputs", "simple", _shm_simple(), expected=_BOTH),
    Infer("shm-inputs-binary-output", "simple",
          _shm_simple(64, 64, {"name": "OUTPUT1", "parameters": {"binary_data": True}}),
          expected={"OUTPUT1": _DIFF[None]}),
    Infer("shm-input-and-json-input", "simple", _inputs(_shm_simple()["inputs"][0], simple_json()["inputs"][1]),
          expected=_BOTH),
    Infer("shm-bytes-input", "identity_bytes", _inputs(_SHM_BYTES_IN), expected={"OUTPUT0": _BYTES_ARRAY}),
]


@pytest.mark.parametrize("case", INFERS, ids=[c.id for c in INFERS])
def test_inference(servers: Servers, case: Infer) -> None:
    body = _body(case.body)
    triton, geserve = servers.both("POST", case.url, body, case.headers)
    header = assert_same_outputs(triton, geserve, case.expected)
    assert header.get("id") == (body.get("id") if isinstance(body, dict) else None)


def test_output_asked_twice_triton_251_answers_once_geserve_refuses_as_newer_triton(servers: Servers) -> None:
    """Triton 2.51 answers an output named twice once; newer Triton refuses it (triton-inference-server/core#493,
    the duplicate's buffers leaked), and so does geserve, in the words of Triton's input twin."""
    body = _with_outputs({"name": "OUTPUT0"}, {"name": "OUTPUT0"})
    triton, geserve = servers.both("POST", "/v2/models/simple/infer", body)
    assert triton.status == 200 and [o["name"] for o in triton.json()["outputs"]] == ["OUTPUT0"]
    assert decode_outputs(triton)[1]["OUTPUT0"].tolist() == _SUM[None].tolist()
    assert (geserve.status, geserve.content_type) == (400, JSON_CT)
    assert geserve.error() == "[request id: <id_unknown>] output 'OUTPUT0' already exists in request"


def test_newer_triton_limits_nesting_and_element_count(servers: Servers) -> None:
    """JSON past 100 levels and a shape past int64 elements: Triton 2.51 parses on and refuses what it finds (500,
    a data count that does not match); newer Triton refuses them first in the words geserve answers with (400)."""
    body = simple_json()
    body["inputs"][0]["data"] = "deep"
    deep = json.dumps(body).encode().replace(b'"deep"', b"[" * 150 + b"1" + b"]" * 150)
    triton, geserve = servers.both("POST", "/v2/models/simple/infer", deep)
    assert triton.status == 500 and triton.error().startswith("Unable to parse 'data'")
    assert (geserve.status, geserve.error()) == (400, "JSON nesting depth exceeds maximum allowed limit (100)")
    body = simple_json()
    body["inputs"][0]["shape"] = [16, 2**60 + 2]
    triton, geserve = servers.both("POST", "/v2/models/simple/infer", body)
    assert triton.status == 500 and triton.error().startswith("Unable to parse 'data'")
    assert (geserve.status, geserve.error()) == (
        400, f"input 'INPUT0' with shape [16,{2**60 + 2}] causes total element count to exceed maximum size of "
             f"{2**63 - 1}")


def test_repository_index_judges_ready_before_the_nesting_depth(servers: Servers) -> None:
    """Triton's qa test_repository_index_deeply_nested_json: a body nested past 100 levels whose `ready` is no boolean
    is refused for `ready` (Triton limits depth where it reads inference data, not here). With a boolean `ready`
    Triton answers the index; geserve keeps its one depth limit for every JSON body (400)."""
    deep = b"[" * 150 + b"]" * 150
    triton, geserve = servers.both("POST", "/v2/repository/index", b'{"ready": ' + deep + b"}")
    assert (triton.status, triton.error()) == (500, "attempt to access JSON non-boolean as boolean")  # 2.51's words
    assert (geserve.status, geserve.error()) == (400, "Invalid value for 'ready': expected a boolean")
    triton, geserve = servers.both("POST", "/v2/repository/index", b'{"ready": true, "x": ' + deep + b"}")
    assert triton.status == 200
    assert (geserve.status, geserve.error()) == (400, "JSON nesting depth exceeds maximum allowed limit (100)")


def test_repository_index_ready_not_boolean_in_newer_tritons_words(servers: Servers) -> None:
    triton, geserve = servers.both("POST", "/v2/repository/index", b'{"ready": "yes"}')
    assert triton.error() == "attempt to access JSON non-boolean as boolean"  # 2.51's words
    assert geserve.error() == "Invalid value for 'ready': expected a boolean"


def test_gzip_members_and_transfer_codings_geserve_decodes(servers: Servers) -> None:
    """A client that gzips each piece as it streams writes one member per piece: Triton 2.51 (and geserve before
    issue 12) decoded only the first and failed on the cut JSON. A gzip transfer coding Triton 2.51 leaves encoded."""
    plain = json.dumps(simple_json()).encode()
    members = b"".join(gzip.compress(plain[at:at + 40]) for at in range(0, len(plain), 40))
    triton, geserve = servers.both("POST", "/v2/models/simple/infer", members, {"Content-Encoding": "gzip"})
    assert triton.status == 500 and triton.error().startswith("failed to parse the request JSON buffer")
    assert geserve.status == 200
    assert decode_outputs(geserve)[1]["OUTPUT0"].tolist() == _SUM[None].tolist()
    # Data after the end that is no member is ignored by both, as gzip(1) does.
    triton, geserve = servers.both("POST", "/v2/models/simple/infer", gzip.compress(plain) + b"junk",
                                   {"Content-Encoding": "gzip"})
    assert (triton.status, geserve.status) == (200, 200)
    compressed = gzip.compress(plain)
    chunked = f"{len(compressed):x}\r\n".encode() + compressed + b"\r\n0\r\n\r\n"
    replies = []
    for base in (servers.triton, servers.geserve):
        url = urlsplit(base)
        raw = (b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n"
               b"Connection: close\r\n\r\n" + chunked)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(raw)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        replies.append(int(data.split(b" ", 2)[1]))
    assert replies == [400, 200]


def test_shared_memory_outputs(servers: Servers) -> None:
    """Outputs written into the `out` region, each server in turn; the response names and shapes them, no data."""
    replies = []
    for base in (servers.triton, servers.geserve):
        servers.shm_out.memory[:128] = bytes(128)
        body = json.dumps(_shm_simple(64, 64, *_SHM_OUT)).encode()
        replies.append(send(base, "POST", "/v2/models/simple/infer", body))
        written = np.frombuffer(servers.shm_out.memory, np.int32, 32).reshape(2, 16)
        np.testing.assert_array_equal(written, np.stack([_SUM, _DIFF]))
    triton, geserve = replies
    assert _same_json(triton, geserve)["outputs"] == [
        {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]},
        {"name": "OUTPUT1", "datatype": "INT32", "shape": [1, 16]},
    ]


def test_digits_outputs_are_the_classifier_answers(servers: Servers) -> None:
    """The real model end to end: labels equal the argmax of probabilities, and match Triton's."""
    triton, geserve = servers.both("POST", "/v2/models/digits/infer", digits_json(8))
    assert_same_outputs(triton, geserve)
    _, arrays = decode_outputs(geserve)
    assert arrays["label"].reshape(-1).tolist() == arrays["probabilities"].argmax(axis=1).tolist()
    _, labels = models.digits_test_set()
    assert (arrays["label"].reshape(-1) == labels[:8]).mean() >= 0.75


def test_fp16_json_is_a_geserve_extension(servers: Servers) -> None:
    """Triton refuses FP16 in JSON both ways (400); geserve serves it. Deliberate: no Triton client relies on the
    refusal, and tritonclient's `binary_data=False` works against geserve for every datatype."""
    data = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP16", "data": _FP16.reshape(-1).tolist()}]}
    triton, geserve = servers.both("POST", "/v2/models/identity_fp16/infer", data)
    assert triton.status == 400 and "FP16 data via JSON is not supported" in triton.error()
    assert geserve.status == 200
    np.testing.assert_array_equal(decode_outputs(geserve)[1]["OUTPUT0"], _FP16)


# -------------------------------------------------------------------------------- inference refused


@dataclass(frozen=True)
class Bad:
    """An inference request both refuse. `triton_status`: where Triton differs (500 for a client's mistake)."""

    id: str
    model: str
    body: Body
    status: int = 400
    message: str | None = None  # Triton's text, which geserve repeats verbatim
    triton_status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    path: str = ""
    same_prefix: str | None = None  # both messages start with this

    @property
    def url(self) -> str:
        return self.path or f"/v2/models/{self.model}/infer"


def _rid(text: str, request_id: str = "<id_unknown>") -> str:
    return f"[request id: {request_id}] {text}"


_NOTE = (" NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be prepended to"
         " each input shape. If you want to specify the full shape including the batch dim in your input dims config,"
         " try setting max_batch_size to zero. See the model configuration docs for more info on max_batch_size.")
_IN0, _IN1 = simple_json()["inputs"]


def _bin_simple(size0: int, payload: bytes, id: str) -> Bad:
    """INPUT0 as `size0` bytes of binary data (`payload`), INPUT1 as JSON."""
    binary = {k: v for k, v in _IN0.items() if k != "data"}
    head = json.dumps({"inputs": [{**binary, "parameters": {"binary_data_size": size0}}, _IN1]}).encode()
    return Bad(id, "simple", head + payload, headers={"Inference-Header-Content-Length": str(len(head))})


def _bytes_bin(shape: list[int], id: str) -> Bad:
    head = json.dumps({"inputs": [{**_BYTES_HEAD, "shape": shape}]}).encode()
    return Bad(id, "identity_bytes", head + _BYTES_RAW, headers={"Inference-Header-Content-Length": str(len(head))})


_BAD_INT32 = "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"
_SHM_IN0 = _shm_simple()["inputs"][0]
_ONLY_ONE = ("Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
             "'shared_memory_region' in 'parameters'. But set {} 'shared_memory_region'")
_NOT_UNSIGNED = "Unable to parse '{}': attempt to access JSON non-unsigned-integer as unsigned-integer"

BADS = [
    Bad("unknown-model", "nope", simple_json(), 404, "Request for unknown model: 'nope' is not found"),
    Bad("unknown-version", "simple", simple_json(), 404, "Request for unknown model: 'simple' version 7 is not found",
        path="/v2/models/simple/versions/7/infer"),
    Bad("unknown-model-malformed-body", "nope", b"{bad", 404, "Request for unknown model: 'nope' is not found"),
    Bad("wrong-shape", "simple", _inputs({**_IN0, "shape": [1, 15], "data": A[:15].tolist()}, _IN1), 400,
        _rid("unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,15]." + _NOTE)),
    Bad("wrong-shape-request-id", "simple", _inputs({**_IN0, "shape": [1, 15], "data": A[:15].tolist()}, _IN1,
                                                     id="my-id"), 400,
        _rid("unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,15]." + _NOTE,
             "my-id")),
    Bad("wrong-shape-no-batching", "nobatch",
        _inputs({"name": "INPUT0", "shape": [3, 2], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}), 400,
        # sic: with no NOTE to add, Triton's text still ends with a space
        _rid("unexpected shape for input 'INPUT0' for model 'nobatch'. Expected [2,3], got [3,2]. ")),
    Bad("batch-dim-missing-checked-as-batch-first", "simple",
        _inputs({**_IN0, "shape": [16]}, {**_IN1, "shape": [16]}), 400,
        _rid("inference request batch-size must be <= 8 for 'simple'")),
    Bad("batch-too-large", "simple", simple_inputs(rows=9)[0], 400,
        _rid("inference request batch-size must be <= 8 for 'simple'")),
    Bad("batch-sizes-disagree", "simple",
        _inputs(_IN0, {**_IN1, "shape": [2, 16], "data": B.tolist() * 2}), 400,
        same_prefix="[request id: <id_unknown>] input 'INPUT"),
    Bad("wrong-datatype", "simple", _inputs({**_IN0, "datatype": "INT64"}, _IN1), 400,
        _rid("inference input 'INPUT0' data-type is 'INT64', but model 'simple' expects 'INT32'")),
    Bad("unknown-datatype", "simple", _inputs({**_IN0, "datatype": "INT33"}, _IN1), 400,
        "invalid datatype for input INPUT0"),
    Bad("missing-input", "simple", _inputs(_IN0), 400,
        _rid("expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing required "
             "input(s) ['INPUT1']. Please provide all required input(s).")),
    Bad("no-inputs", "simple", _inputs(), 400,
        _rid("expected 2 inputs but got 0 inputs for model 'simple'. Got input(s) [], but missing required "
             "input(s) ['INPUT0','INPUT1']. Please provide all required input(s).")),
    Bad("unknown-input", "simple", _inputs(_IN0, {**_IN1, "name": "NOPE"}), 400,
        "unexpected inference input 'NOPE' for model 'simple'"),
    Bad("extra-input", "simple", _inputs(_IN0, _IN1, {**_IN1, "name": "NOPE"}), 400),
    Bad("input-given-twice", "simple", _inputs(_IN0, _IN1, _IN0), 400,
        _rid("input 'INPUT0' already exists in request")),
    Bad("unknown-output", "simple", _with_outputs({"name": "NOPE"}), 400,
        "unexpected inference output 'NOPE' for model 'simple'"),
    Bad("triton-prefixed-parameter", "simple", simple_json(parameters={"triton_foo": 1}), 400,
        "parameter keys starting with 'triton_' are reserved for Triton usage and should not be specified."),
    Bad("input-without-data", "simple", _inputs({k: v for k, v in _IN0.items() if k != "data"}, _IN1), 400),
    _bin_simple(64, A.tobytes()[:-4], id="binary-data-short"),
    _bin_simple(64, A.tobytes() + b"xxxx", id="binary-data-unclaimed"),
    _bin_simple(60, A.tobytes()[:60], id="binary-data-size-not-shape"),
    _bytes_bin([1, 4], "bytes-fewer-elements-than-shape"),
    _bytes_bin([1, 2], "bytes-more-elements-than-shape"),
    Bad("header-length-past-body", "simple", _BIN_IN[0], 400,
        headers={"Inference-Header-Content-Length": "100000"}, same_prefix="inference header size should be in range"),
    Bad("raw-body-model-has-two-inputs", "simple", A.tobytes(), 400,
        _rid("Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple' model "
             "configuration"), headers={"Inference-Header-Content-Length": "0"}),
    Bad("raw-body-short", "nobatch", NOBATCH_IN.tobytes()[:-4], 400, headers={"Inference-Header-Content-Length": "0"},
        same_prefix="[request id: <id_unknown>] input byte size mismatch for input '"),
    Bad("raw-body-two-rows-is-not-batch-1", "digits", lambda: digits_rows(2).tobytes(), 400,
        headers={"Inference-Header-Content-Length": "0"},
        same_prefix="[request id: <id_unknown>] input byte size mismatch for input '"),
    Bad("raw-body-bytes-needs-shape-1", "identity_bytes", b"hello", 400,
        _rid("For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
        headers={"Inference-Header-Content-Length": "0"}),
    Bad("unsupported-content-encoding", "simple", _GZ, 501, "Unsupported compression type",
        headers={"Content-Encoding": "br"}),
    Bad("corrupt-gzip-body", "simple", b"not gzip at all", 400, headers={"Content-Encoding": "gzip"}),
    # A client's malformed request: Triton answers 500, geserve 400.
    Bad("malformed-json-triton-500-geserve-400", "simple", b'{"inputs": [ {"name": ', triton_status=500,
        same_prefix="failed to parse the request JSON buffer: "),
    Bad("missing-inputs-member-triton-500-geserve-400", "simple", {}, triton_status=500,
        message="Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"),
    Bad("data-count-short-triton-500-geserve-400", "simple", _inputs(_IN0, {**_IN1, "data": B[:15].tolist()}),
        triton_status=500, same_prefix="Unable to parse 'data': Shape does not match true shape of 'data' field"),
    Bad("data-count-long-triton-500-geserve-400", "simple", _inputs(_IN0, {**_IN1, "data": [*B.tolist(), 1]}),
        triton_status=500, same_prefix="Unable to parse 'data': Shape does not match true shape of 'data' field"),
    Bad("floats-for-int32-triton-500-geserve-400", "simple", _inputs({**_IN0, "data": [1.5] * 16}, _IN1),
        triton_status=500, same_prefix="Unable to parse 'data'"),
    Bad("strings-for-int32-triton-500-geserve-400", "simple", _inputs({**_IN0, "data": ["1"] * 16}, _IN1),
        triton_status=500, same_prefix="Unable to parse 'data'"),
    Bad("booleans-for-int32-triton-500-geserve-400", "simple", _inputs({**_IN0, "data": [True] * 16}, _IN1),
        triton_status=500, same_prefix="Unable to parse 'data'"),
    Bad("integers-for-bool-triton-500-geserve-400", "identity_bool",
        _inputs({"name": "INPUT0", "shape": [1, 2], "datatype": "BOOL", "data": [1, 0]}),
        triton_status=500, same_prefix="Unable to parse 'data'"),
    Bad("number-for-bytes-triton-500-geserve-400", "identity_bytes",
        _inputs({"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "data": ["a", 1]}), triton_status=500),
    Bad("missing-name-triton-500-geserve-400", "simple", _inputs({k: v for k, v in _IN0.items() if k != "name"}, _IN1),
        triton_status=500, message="Unable to parse 'name': attempt to access non-existing object member 'name'"),
    Bad("missing-shape-triton-500-geserve-400", "simple",
        _inputs({k: v for k, v in _IN0.items() if k != "shape"}, _IN1),
        triton_status=500, message="Unable to parse 'shape': attempt to access non-existing object member 'shape'"),
    Bad("missing-datatype-triton-500-geserve-400", "simple",
        _inputs({k: v for k, v in _IN0.items() if k != "datatype"}, _IN1), triton_status=500,
        message="Unable to parse 'datatype': attempt to access non-existing object member 'datatype'"),
    Bad("negative-dim-triton-500-geserve-400", "simple", _inputs({**_IN0, "shape": [1, -16]}, _IN1),
        triton_status=500, same_prefix="Unable to parse 'shape'"),
    Bad("non-string-id-triton-500-geserve-400", "simple", simple_json(id=5), triton_status=500,
        message="Unable to parse 'id': attempt to access JSON non-string as string"),
    Bad("non-boolean-binary-data-output-triton-500-geserve-400", "simple",
        simple_json(parameters={"binary_data_output": "yes"}), triton_status=500,
        message="Unable to parse 'binary_data_output': attempt to access JSON non-boolean as boolean"),
    Bad("non-boolean-binary-data-triton-500-geserve-400", "simple",
        _with_outputs({"name": "OUTPUT0", "parameters": {"binary_data": 1}}), triton_status=500,
        message="Unable to parse 'binary_data': attempt to access JSON non-boolean as boolean"),
    Bad("negative-priority-triton-500-geserve-400", "simple", simple_json(parameters={"priority": -1}),
        triton_status=500),
    Bad("negative-classification-triton-500-geserve-400", "simple",
        _with_outputs({"name": "OUTPUT0", "parameters": {"classification": -1}}), triton_status=500),
    Bad("string-classification-triton-500-geserve-400", "simple",
        _with_outputs({"name": "OUTPUT0", "parameters": {"classification": "2"}}), triton_status=500),
    # shared memory
    Bad("shm-unknown-region", "simple", _inputs({**_SHM_IN0, "parameters": shm("nope", 64)}, _IN1), 404,
        "Unable to find shared memory region: 'nope'"),
    Bad("shm-output-unknown-region", "simple", _with_outputs({"name": "OUTPUT0", "parameters": shm("nope", 64)}), 404,
        "Unable to find shared memory region: 'nope'"),
    Bad("shm-window-past-region", "simple", _shm_simple(64, 200), 400,
        "Invalid offset + byte size for shared memory region: 'in'"),
    Bad("shm-byte-size-missing", "simple", _inputs({**_SHM_IN0, "parameters": {"shared_memory_region": "in"}}, _IN1),
        400, "Invalid offset + byte size for shared memory region: 'in'"),
    Bad("shm-byte-size-not-shape", "simple", _shm_simple(60), 400,
        _rid("input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 64, got 60")),
    Bad("shm-output-too-small", "simple", _shm_simple(64, 64, {"name": "OUTPUT0", "parameters": shm("out", 60)}),
        500, "shared memory size specified with the request for output 'OUTPUT0' (60 bytes) should be at least 64 "
             "bytes to hold the results"),
    Bad("shm-bytes-output-too-small", "identity_bytes",
        _inputs(_SHM_BYTES_IN, outputs=[{"name": "OUTPUT0", "parameters": shm("out", 4)}]), 500,
        same_prefix="shared memory size specified with the request for output 'OUTPUT0' (4 bytes) should be at least"),
    Bad("shm-and-data", "simple", _inputs({**_IN0, "parameters": shm("in", 64)}, _IN1), 400,
        _ONLY_ONE.format("'data'")),
    Bad("shm-and-binary-data-size", "simple",
        _inputs({**_SHM_IN0, "parameters": {**shm("in", 64), "binary_data_size": 64}}, _IN1), 400,
        _ONLY_ONE.format("'binary_data_size'")),
    Bad("shm-output-binary-data", "simple",
        _shm_simple(64, 64, {"name": "OUTPUT0", "parameters": {**shm("out", 64), "binary_data": True}}), 400,
        "Output can't set both 'shared_memory_region' and 'binary_data'"),
    Bad("shm-byte-size-string-triton-500-geserve-400", "simple",
        _inputs({**_SHM_IN0, "parameters": {**shm("in", 64), "shared_memory_byte_size": "64"}}, _IN1),
        triton_status=500, message=_NOT_UNSIGNED.format("shared_memory_byte_size")),
    Bad("shm-negative-offset-triton-500-geserve-400", "simple",
        _inputs({**_SHM_IN0, "parameters": shm("in", 64, -4)}, _IN1),
        triton_status=500, message=_NOT_UNSIGNED.format("shared_memory_offset")),
    Bad("shm-region-not-string-triton-500-geserve-400", "simple",
        _inputs({**_SHM_IN0, "parameters": {**shm("in", 64), "shared_memory_region": 5}}, _IN1), triton_status=500,
        message="Unable to parse 'shared_memory_region': attempt to access JSON non-string as string"),
]


@pytest.mark.parametrize("case", BADS, ids=[c.id for c in BADS])
def test_inference_refused(servers: Servers, case: Bad) -> None:
    triton, geserve = servers.both("POST", case.url, _body(case.body), case.headers)
    if case.triton_status is None:
        assert_same_error(triton, geserve, case.status, case.message)
    else:
        assert (triton.status, geserve.status) == (case.triton_status, case.status), (triton.body, geserve.body)
        assert geserve.content_type == triton.content_type == JSON_CT
        if case.message is not None:
            assert triton.error() == case.message, "the reference changed: update the expected text"
            assert geserve.error() == case.message
    triton_error, geserve_error = triton.error(), geserve.error()
    if case.same_prefix is not None:
        assert triton_error.startswith(case.same_prefix) and geserve_error.startswith(case.same_prefix)
    # Refused requests leave both servers serving.
    assert all(r.status == 200 for r in servers.both("GET", "/v2/health/ready"))


# ------------------------------------------------------------------------------------------ statistics


def _stats(reply: Reply) -> dict:
    assert reply.status == 200 and reply.content_type == JSON_CT
    (entry,) = reply.json()["model_stats"]
    return entry


def _counts(entry: dict) -> dict:
    """Everything in a model's statistics but the timings: what must equal Triton's exactly."""
    return {
        "name": entry["name"],
        "version": entry["version"],
        "inference_count": entry["inference_count"],
        "execution_count": entry["execution_count"],
        "inference_stats": {k: v["count"] for k, v in entry["inference_stats"].items()},
        "batch_stats": [
            {"batch_size": b["batch_size"], **{k: v["count"] for k, v in b.items() if k != "batch_size"}}
            for b in entry["batch_stats"]
        ],
        "response_stats": entry["response_stats"],
        "memory_usage": entry["memory_usage"],
    }


def _wait_for(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float = 5.0) -> Any:
    """Triton may update statistics just after it answers; poll until the traffic shows."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def test_statistics_count_known_traffic_exactly(servers: Servers) -> None:
    """A fresh model: all zeros, then after known traffic the same counts as Triton, batch_stats included.

    Requests refused before they reach the model (bad shape, unknown output, malformed JSON) count nowhere.
    """
    path = f"/v2/models/{STATS_MODEL}/stats"
    triton, geserve = servers.both("GET", path)
    fresh_t, fresh_g = _stats(triton), _stats(geserve)
    assert fresh_g == fresh_t  # all zeros: every value, timings included
    assert set(fresh_g["inference_stats"]) == INFERENCE_STATS_KEYS

    url = f"/v2/models/{STATS_MODEL}/infer"
    batches = [1, 2, 2, 3, 1]
    for rows in batches:
        header, payload = simple_inputs(rows, binary=True)
        body, headers = binary_request(header, payload)
        assert all(r.status == 200 for r in servers.both("POST", url, body, headers))
    short = _inputs({**_IN0, "shape": [1, 8], "data": A[:8].tolist()}, _IN1)
    assert all(r.status == 400 for r in servers.both("POST", url, short))
    assert all(r.status == 400 for r in servers.both("POST", url, _with_outputs({"name": "NOPE"})))
    assert {r.status for r in servers.both("POST", url, b"{bad")} == {400, 500}

    def read() -> tuple[dict, dict]:
        triton, geserve = servers.both("GET", path)
        return _stats(triton), _stats(geserve)

    expected = len(batches)
    after_t, after_g = _wait_for(read, lambda s: all(e["inference_stats"]["success"]["count"] == expected for e in s))
    assert strip_values(after_g) == strip_values(after_t)
    assert _counts(after_g) == _counts(after_t)
    assert after_g["inference_count"] == sum(batches) and after_g["execution_count"] == len(batches)
    assert [b["batch_size"] for b in after_g["batch_stats"]] == [1, 2, 3]
    assert [b["compute_infer"]["count"] for b in after_g["batch_stats"]] == [2, 2, 1]
    for entry in (after_t, after_g):
        assert entry["last_inference"] > 0
        for key, value in entry["inference_stats"].items():
            assert (value["ns"] > 0) == (value["count"] > 0), key

    version_t, version_g = servers.both("GET", f"/v2/models/{STATS_MODEL}/versions/1/stats")
    assert _counts(_stats(version_g)) == _counts(_stats(version_t)) == _counts(after_g)


def test_statistics_of_every_model(servers: Servers) -> None:
    triton, geserve = servers.both("GET", "/v2/models/stats")
    assert (triton.status, geserve.status) == (200, 200)
    assert geserve.content_type == triton.content_type == JSON_CT
    t_all, g_all = triton.json()["model_stats"], geserve.json()["model_stats"]
    assert [(e["name"], e["version"]) for e in g_all] == [(e["name"], e["version"]) for e in t_all]
    for t_entry, g_entry in zip(t_all, g_all, strict=True):
        assert set(g_entry) == set(t_entry)
        assert set(g_entry["inference_stats"]) == set(t_entry["inference_stats"]) == INFERENCE_STATS_KEYS
        for stats in g_entry["inference_stats"].values():
            assert set(stats) == {"count", "ns"} and all(isinstance(v, int) for v in stats.values())

