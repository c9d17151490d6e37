"""System shared memory, logging and trace settings over HTTP, with the real tritonclient against a real geserve.

The module's own server runs with `--allow-system-shared-memory=true`; the session's `server` (switch off) shows
the refusal. Regions are created, filled and read back with `tritonclient.utils.shared_memory`, as users do.
"""

from __future__ import annotations

import http.client
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from tests.support.server import RunningServer, geserve

shm = pytest.importorskip("tritonclient.utils.shared_memory")  # needs pkg_resources (setuptools < 81)

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)
TRACE_DEFAULTS = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
                  "trace_file": "", "trace_mode": "triton"}
LOG_DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True, "log_verbose_level": 0,
                "log_format": "default"}


@pytest.fixture(scope="module")
def shm_server(good_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("shm") / "geserve.log"
    with geserve([good_repo], log, ["--allow-system-shared-memory=true"]) as running:
        yield running


@pytest.fixture
def client(shm_server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(shm_server.url) as c:
        yield c
        c.unregister_system_shared_memory()


class Regions:
    """Shared memory regions a test creates, registers by their name, and destroys at the end."""

    def __init__(self, client: httpclient.InferenceServerClient) -> None:
        self.client = client
        self.handles: dict[str, object] = {}
        self.keys: dict[str, str] = {}

    def create(self, name: str, size: int, register: bool = True) -> object:
        key = self.keys[name] = f"/geserve-test-{uuid.uuid4().hex[:12]}"
        handle = self.handles[name] = shm.create_shared_memory_region(name, key, size)
        if register:
            self.client.register_system_shared_memory(name, key, size)
        return handle

    def destroy(self) -> None:
        for handle in self.handles.values():
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions(client: httpclient.InferenceServerClient) -> Iterator[Regions]:
    made = Regions(client)
    yield made
    made.destroy()


def _shm_inputs(region: str = "in", offset1: int = 64, size1: int = 64) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(region, 64)
    inputs[1].set_shared_memory(region, size1, offset=offset1)
    return inputs


def _shm_outputs(region: str = "out", size: int = 64) -> list[httpclient.InferRequestedOutput]:
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(region, size)
    outputs[1].set_shared_memory(region, size, offset=64)
    return outputs


def _refused(call: Callable[[], object], status: str, message: str | None = None) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == status, info.value.message()
    if message is not None:
        assert info.value.message() == message
    return info.value.message()


# ------------------------------------------------------------------------------------------ inference


def test_inputs_and_outputs_through_shared_memory(client: httpclient.InferenceServerClient, regions: Regions) -> None:
    shm.set_shared_memory_region(regions.create("in", 128), [A, B])
    out = regions.create("out", 128)
    result = client.infer("simple", _shm_inputs(), outputs=_shm_outputs())
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int32, [1, 16]), A + B)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int32, [1, 16], offset=64), A - B)
    # As Triton: each output is named and shaped, with neither data nor parameters.
    assert result.get_response()["outputs"] == [
        {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]},
        {"name": "OUTPUT1", "datatype": "INT32", "shape": [1, 16]},
    ]


def test_shared_memory_inputs_with_binary_and_json_outputs(
    client: httpclient.InferenceServerClient, regions: Regions
) -> None:
    shm.set_shared_memory_region(regions.create("in", 256), [A, B], offset=32)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("simple", _shm_inputs_at(32), outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    # Without named outputs every output comes back in the body.
    result = client.infer("simple", _shm_inputs_at(32))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def _shm_inputs_at(offset: int) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory("in", 64, offset=offset)
    inputs[1].set_shared_memory("in", 64, offset=offset + 64)
    return inputs


def test_bytes_through_shared_memory(client: httpclient.InferenceServerClient, regions: Regions) -> None:
    values = np.array([[b"hello", b"", "\u00e9t\u00e9".encode()]], dtype=object)
    serialized = serialize_byte_tensor(values)
    shm.set_shared_memory_region(regions.create("in", 64), [serialized])
    out = regions.create("out", 64)
    inputs = [httpclient.InferInput("INPUT0", [1, 3], "BYTES")]
    inputs[0].set_shared_memory("in", serialized_byte_size(serialized))
    output = httpclient.InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("out", 64)
    result = client.infer("identity_bytes", inputs, outputs=[output])
    assert result.get_output("OUTPUT0") == {"name": "OUTPUT0", "datatype": "BYTES", "shape": [1, 3]}
    assert shm.get_contents_as_numpy(out, np.object_, [1, 3]).tolist() == values.tolist()


def test_one_output_in_shared_memory_the_other_in_the_body(
    client: httpclient.InferenceServerClient, regions: Regions
) -> None:
    shm.set_shared_memory_region(regions.create("in", 128), [A, B])
    out = regions.create("out", 64)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("out", 64)
    result = client.infer("simple", _shm_inputs(), outputs=outputs)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out, np.int32, [1, 16]), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    assert "data" not in result.get_output("OUTPUT0") and "parameters" not in result.get_output("OUTPUT0")


# ------------------------------------------------------------------------------- regions and errors


def test_status_and_unregister(client: httpclient.InferenceServerClient, regions: Regions) -> None:
    assert client.get_system_shared_memory_status() == []
    regions.create("a", 64)
    regions.create("b", 128, register=False)
    key = regions.keys["b"]
    client.register_system_shared_memory("b", key, 64, offset=32)
    status = client.get_system_shared_memory_status()
    assert [r["name"] for r in status] == ["a", "b"]
    assert client.get_system_shared_memory_status("b") == [{"name": "b", "key": key, "offset": 32, "byte_size": 64}]
    _refused(lambda: client.register_system_shared_memory("b", key, 8), "400",
             "shared memory region 'b' already in manager")
    client.unregister_system_shared_memory("a")
    client.unregister_system_shared_memory("a")  # an unknown region is no error
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["b"]
    _refused(lambda: client.get_system_shared_memory_status("a"), "404",
             "Unable to find system shared memory region: 'a'")
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def test_registered_over_http_seen_over_grpc(shm_server: RunningServer, client: httpclient.InferenceServerClient,
                                             regions: Regions) -> None:
    regions.create("shared", 64)
    with grpcclient.InferenceServerClient(shm_server.grpc_url) as grpc_client:
        assert list(grpc_client.get_system_shared_memory_status(as_json=True)["regions"]) == ["shared"]
        grpc_client.unregister_system_shared_memory("shared")
    assert client.get_system_shared_memory_status() == []


def test_register_refusals(client: httpclient.InferenceServerClient, regions: Regions) -> None:
    _refused(lambda: client.register_system_shared_memory("x", "/geserve-no-such-key", 8), "500",
             "Unable to open shared memory region: '/geserve-no-such-key'")
    regions.create("small", 64, register=False)
    key = regions.keys["small"]
    _refused(lambda: client.register_system_shared_memory("x", key, 65), "500",
             f"Invalid shared memory region: '{key}'")


def test_inference_refusals(client: httpclient.InferenceServerClient, regions: Regions) -> None:
    shm.set_shared_memory_region(regions.create("in", 128), [A, B])
    regions.create("out", 128)
    _refused(lambda: client.infer("simple", _shm_inputs(region="nope")), "404",
             "Unable to find shared memory region: 'nope'")
    _refused(lambda: client.infer("simple", _shm_inputs(), outputs=_shm_outputs(region="nope")), "404",
             "Unable to find shared memory region: 'nope'")
    _refused(lambda: client.infer("simple", _shm_inputs(offset1=100)), "400",
             "Invalid offset + byte size for shared memory region: 'in'")
    _refused(lambda: client.infer("simple", _shm_inputs(size1=60)), "400",
             "[request id: <id_unknown>] input byte size mismatch for input 'INPUT1' for model 'simple'. "
             "Expected 64, got 60")
    _refused(lambda: client.infer("simple", _shm_inputs(), outputs=_shm_outputs(size=60)), "500",
             "shared memory size specified with the request for output 'OUTPUT0' (60 bytes) should be at least 64 "
             "bytes to hold the results")
    assert client.is_server_ready()


def test_switch_off_refuses_registration(server: RunningServer) -> None:
    with httpclient.InferenceServerClient(server.url) as off:
        assert "system_shared_memory" in off.get_server_metadata()["extensions"]  # listed, as Triton lists it
        message = _refused(lambda: off.register_system_shared_memory("r", "/anything", 8), "501")
        assert "--allow-system-shared-memory" in message
        assert off.get_system_shared_memory_status() == []
        off.unregister_system_shared_memory()
        _refused(lambda: off.infer("simple", _shm_inputs()), "404", "Unable to find shared memory region: 'in'")


def test_cuda_shared_memory_as_on_a_machine_without_gpus(client: httpclient.InferenceServerClient) -> None:
    assert client.get_cuda_shared_memory_status() == []
    _refused(lambda: client.get_cuda_shared_memory_status("x"), "404", "Unable to find cuda shared memory region: 'x'")
    client.unregister_cuda_shared_memory()
    client.unregister_cuda_shared_memory("x")
    _refused(lambda: client.register_cuda_shared_memory("x", bytes(64), 0, 8), "400",
             "failed to register shared memory region: invalid args")


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v2/systemsharedmemory/status"), ("GET", "/v2/systemsharedmemory/region/r/register"),
    ("GET", "/v2/systemsharedmemory/unregister"), ("POST", "/v2/cudasharedmemory/region/r/status"),
    ("PUT", "/v2/logging"), ("DELETE", "/v2/trace/setting"), ("PUT", "/v2/models/simple/trace/setting"),
])
def test_wrong_method_is_405(shm_server: RunningServer, method: str, path: str) -> None:
    status, content_type, body = _raw(shm_server, method, path)
    assert (status, content_type, body) == (405, "application/json", {"error": "Method Not Allowed"})


def _raw(server: RunningServer, method: str, path: str, body: bytes | None = None) -> tuple[int, str, object]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        data = response.read()
        return response.status, response.getheader("content-type", ""), json.loads(data) if data else None
    finally:
        connection.close()


# ------------------------------------------------------------------------------- logging and trace


def test_server_metadata_lists_the_extensions_on_both_protocols(shm_server: RunningServer,
                                                                client: httpclient.InferenceServerClient) -> None:
    extensions = client.get_server_metadata()["extensions"]
    assert {"system_shared_memory", "logging", "trace"} <= set(extensions)
    with grpcclient.InferenceServerClient(shm_server.grpc_url) as grpc_client:
        assert list(grpc_client.get_server_metadata().extensions) == extensions


def test_logging_round_trip(shm_server: RunningServer, client: httpclient.InferenceServerClient) -> None:
    assert client.get_log_settings() == LOG_DEFAULTS
    try:
        changed = client.update_log_settings({"log_verbose_level": 1, "log_info": False, "unknown": 3})
        assert changed == {**LOG_DEFAULTS, "log_verbose_level": 1, "log_info": False}
        assert client.get_log_settings() == changed
        with grpcclient.InferenceServerClient(shm_server.grpc_url) as grpc_client:  # one setting for both
            assert grpc_client.get_log_settings(as_json=True)["settings"]["log_verbose_level"] == {"uint32_param": 1}
        _refused(lambda: client.update_log_settings({"log_verbose_level": -1}), "400",
                 "attempt to access JSON non-unsigned-integer as unsigned-integer")
        _refused(lambda: client.update_log_settings({"log_info": "x"}), "400",
                 "attempt to access JSON non-boolean as boolean")
        _refused(lambda: client.update_log_settings({"log_format": "bad"}), "503",
                 "invalid argument for --log_format, got: bad")
        _refused(lambda: client.update_log_settings({"log_file": "/tmp/x.log"}), "501",
                 "log file location can not be updated through network protocol")
        assert client.get_log_settings() == changed  # a refused change changes nothing
    finally:
        client.update_log_settings({"log_verbose_level": 0, "log_info": True})
    assert client.get_log_settings() == LOG_DEFAULTS


def test_trace_settings(client: httpclient.InferenceServerClient) -> None:
    assert client.get_trace_settings() == TRACE_DEFAULTS
    assert client.get_trace_settings("simple") == TRACE_DEFAULTS
    try:
        assert client.update_trace_settings(settings={"trace_rate": "10"}) == {**TRACE_DEFAULTS, "trace_rate": "10"}
        model = client.update_trace_settings("simple", {"trace_count": "3"})
        assert model == {**TRACE_DEFAULTS, "trace_rate": "10", "trace_count": "3"}
        assert client.get_trace_settings() == {**TRACE_DEFAULTS, "trace_rate": "10"}
        assert client.update_trace_settings("simple", {"trace_count": None}) == {**TRACE_DEFAULTS, "trace_rate": "10"}
        _refused(lambda: client.update_trace_settings(settings={"trace_rate": "x"}), "400",
                 "Unable to parse 'trace_rate', got: x")
        _refused(lambda: client.update_trace_settings(settings={"trace_rate": 5}), "400",
                 "attempt to access JSON non-string as string")
        _refused(lambda: client.get_trace_settings("nope"), "400", "Request for unknown model : nope")
        _refused(lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}), "400",
                 "Attempting to set invalid trace setting :trace file name is not given")  # Triton's, without a file
    finally:
        client.update_trace_settings(settings={"trace_rate": None})
    assert client.get_trace_settings() == TRACE_DEFAULTS
