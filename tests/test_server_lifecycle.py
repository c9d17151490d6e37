"""Server start-up, readiness, bad models, explicit model control and limits, on real server processes."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve import Server, ServerSettings
from tests.support import models
from tests.support.server import REPO_ROOT, geserve


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _post(url: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture(scope="module")
def broken_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.broken_repository(tmp_path_factory.mktemp("broken") / "models")


def test_bad_models_are_unavailable_with_reasons_and_others_serve(broken_repo: Path, tmp_path: Path) -> None:
    with geserve([broken_repo], tmp_path / "log") as server:
        _, body = _post(server.base + "/v2/repository/index")
        index = {entry["name"]: entry for entry in json.loads(body)}
        assert index["simple"]["state"] == "READY"
        expectations = {
            "bad_config": "bad_config/config.pbtxt",
            "bad_onnx": "bad_onnx/1/model.onnx",
            "wrong_name": "expected 'wrong_name'",
            "bad_param": "unknown parameter 'no_such_option'",
        }
        for name, fragment in expectations.items():
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert fragment in index[name]["reason"], index[name]
        # Triton's strict readiness: not ready while some model is unavailable, but live and serving.
        assert _get(server.base + "/v2/health/ready")[0] == 400
        assert _get(server.base + "/v2/health/live")[0] == 200
        assert _get(server.base + "/v2/models/simple/ready")[0] == 200
        assert _get(server.base + "/v2/models/bad_onnx/ready")[0] == 400
        # GET /v2/models (not Triton's): the index by model, what a newcomer's `curl localhost:8000/v2/models` shows.
        status, body = _get(server.base + "/v2/models")
        listed = {entry["name"]: entry for entry in json.loads(body)["models"]}
        assert status == 200 and set(listed) == set(index)
        ready = {"name": "simple", "state": "READY", "versions": [{"version": "1", "state": "READY"}]}
        assert listed["simple"] == ready
        assert listed["bad_onnx"]["state"] == "UNAVAILABLE"
        assert "bad_onnx/1/model.onnx" in json.dumps(listed["bad_onnx"])
        assert _post(server.base + "/v2/models")[0] == 405


def test_readiness_not_strict(broken_repo: Path, tmp_path: Path) -> None:
    with geserve([broken_repo], tmp_path / "log", ["--strict-readiness=false"]) as server:
        assert _get(server.base + "/v2/health/ready")[0] == 200


def test_exit_on_error_stops_start_up(broken_repo: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "geserve", "serve", "--model-repository", str(broken_repo), "--http-port", "0",
         "--exit-on-error=true"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert result.returncode == 1
    assert "failed to load all models" in result.stderr and "bad_onnx" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--model-control-mode", "watch"], "invalid choice: 'watch'"),  # none, explicit and poll are the modes
        (["--strict-readiness=maybe"], "expected a boolean"),
        (["--backend-config", "ge,novalue"], "--backend-config expects"),
    ],
)
def test_bad_command_lines_fail_clearly(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "geserve", "serve", "--model-repository", "/nonexistent", *args],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_missing_repository_fails_clearly(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "geserve", "serve", "--model-repository", str(tmp_path / "nope"), "--http-port", "0"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert result.returncode == 1 and "failed to open model repository" in result.stderr


def test_explicit_model_control(good_repo: Path, tmp_path: Path) -> None:
    with geserve([good_repo], tmp_path / "log", ["--model-control-mode=explicit", "--load-model=simple"]) as server:
        client = httpclient.InferenceServerClient(server.url)
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["simple"]["state"] == "READY" and index["digits"] == {"name": "digits"}
        assert not client.is_model_ready("digits")

        client.load_model("digits")
        assert client.is_model_ready("digits")

        assert not client.is_model_ready("autocomplete")
        config = {"name": "autocomplete", "backend": "onnxruntime", "max_batch_size": 2,
                  "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
                  "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}]}
        client.load_model("autocomplete", config=json.dumps(config))
        assert client.get_model_config("autocomplete")["max_batch_size"] == 2

        client.unload_model("digits")
        assert not client.is_model_ready("digits")
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert index["digits"]["state"] == "UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="failed to poll from model repository"):
            client.load_model("not_there")
        client.unload_model("not_there")  # as in Triton: unloading what is not loaded succeeds
        client.close()
    del client
    gc.collect()  # tritonclient's __del__ must run on this thread: its gevent pool cannot be joined from another


def test_reload_keeps_serving_while_requests_flow(good_repo: Path, tmp_path: Path) -> None:
    """Reloading a model in explicit mode never fails a request: new versions go live before old ones stop."""
    with geserve([good_repo], tmp_path / "log", ["--model-control-mode=explicit", "--load-model=simple"]) as server:
        stop = time.monotonic() + 3

        body = json.dumps({"inputs": [
            {"name": name, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16} for name in ("INPUT0", "INPUT1")
        ]}).encode()

        def traffic() -> int:
            # Plain HTTP: tritonclient.http's gevent pool must not cross threads.
            count = 0
            while time.monotonic() < stop:
                status, answer = _post(server.base + "/v2/models/simple/infer", body)
                assert status == 200, answer
                assert json.loads(answer)["outputs"][0]["data"] == [2] * 16
                count += 1
            return count

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(traffic) for _ in range(2)]
            reloads = 0
            while time.monotonic() < stop - 0.5:
                status, answer = _post(server.base + "/v2/repository/models/simple/load", b"{}")
                assert status == 200, answer
                reloads += 1
            counts = [f.result() for f in futures]
        assert reloads >= 2 and all(c > 0 for c in counts)


def test_load_and_unload_refused_without_explicit_mode(server) -> None:
    status, body = _post(server.base + "/v2/repository/models/simple/unload", b"{}")
    assert status == 503 and b"polling is enabled" in body
    assert _get(server.base + "/v2/models/simple/ready")[0] == 200


def test_oversized_body_is_refused_without_reading_it(good_repo: Path, tmp_path: Path) -> None:
    with geserve([good_repo], tmp_path / "log", ["--http-max-input-size=4096"]) as server:
        status, body = _post(server.base + "/v2/models/simple/infer", b"x" * 100_000)
        assert status == 400 and b"--http-max-input-size" in body
        assert _get(server.base + "/v2/health/live")[0] == 200


def test_instances_execute_in_parallel(tmp_path: Path) -> None:
    """instance_group count 2: two slow requests overlap instead of queueing behind one instance."""
    repo = tmp_path / "repo"
    from onnx import TensorProto, helper

    from tests.support.models import _save

    nodes, previous = [], "x"
    for i in range(40):
        nodes.append(helper.make_node("MatMul", [previous, "w"], [f"h{i}"]))
        previous = f"h{i}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    weight = helper.make_tensor("w", TensorProto.FLOAT, [512, 512], np.full(512 * 512, 1e-3, np.float32).tolist())
    graph = helper.make_graph(
        nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 512])], initializer=[weight],
    )
    _save(repo / "slow", graph, 'name: "slow"\nbackend: "ge"\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n'
          'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n')
    with geserve([repo], tmp_path / "log") as server:
        data = np.ones((256, 512), dtype=np.float32)

        header = json.dumps({"inputs": [{"name": "x", "shape": [256, 512], "datatype": "FP32",
                                         "parameters": {"binary_data_size": data.nbytes}}]}).encode()

        def one() -> None:
            # Plain HTTP: tritonclient.http's gevent pool must not cross threads.
            status, answer = _post(server.base + "/v2/models/slow/infer", header + data.tobytes(),
                                   {"Inference-Header-Content-Length": str(len(header))})
            assert status == 200, answer[:500]

        def compute_infer_ns() -> int:
            _, body = _get(server.base + "/v2/models/slow/stats")
            return json.loads(body)["model_stats"][0]["inference_stats"]["compute_infer"]["ns"]

        one()
        before = compute_infer_ns()
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic_ns()
            list(pool.map(lambda _: one(), range(2)))
            wall = time.monotonic_ns() - started
        busy = compute_infer_ns() - before
        # On one instance the two executions cannot overlap, so their summed time stays below the wall time.
        assert busy > 1.2 * wall, (busy, wall)


def test_same_app_runs_on_uvicorn(good_repo: Path, tmp_path: Path) -> None:
    """The HTTP frontend is a plain ASGI app: uvicorn can host it instead of the native server."""
    with geserve([good_repo], tmp_path / "log", ["--http-server=uvicorn"]) as server:
        body = json.dumps({"inputs": [
            {"name": n, "shape": [1, 16], "datatype": "INT32", "data": [3] * 16} for n in ("INPUT0", "INPUT1")
        ]}).encode()
        status, answer = _post(server.base + "/v2/models/simple/infer", body)
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [6] * 16
        assert _get(server.base + "/v2/models/nope")[0] == 404


def test_busy_metrics_port_stops_start_up(good_repo: Path) -> None:
    """As in Triton: a service that cannot bind its port is a start-up error, not a silent gap."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "geserve", "serve", "--model-repository", str(good_repo), "--http-port", "0",
             "--metrics-address", "127.0.0.1", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        )
    assert result.returncode == 1 and "failed to start the metrics service" in result.stderr, result.stderr[-2000:]


def test_environment_sets_what_the_command_line_leaves_out(good_repo: Path) -> None:
    from geserve.cli import build_parser, settings_from_args

    environment = {"GESERVE_HTTP_PORT": "9123", "GESERVE_STRICT_READINESS": "false"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in environment.items():
            patch.setenv(key, value)
        settings = settings_from_args(build_parser().parse_args(
            ["serve", "--model-repository", str(good_repo), "--grpc-port", "7001"]
        ))
        assert (settings.http_port, settings.grpc_port, settings.strict_readiness) == (9123, 7001, False)
        settings = settings_from_args(build_parser().parse_args(
            ["serve", "--model-repository", str(good_repo), "--http-port", "8000"]
        ))
        assert settings.http_port == 8000  # the command line wins


def test_tritonserver_flags_of_lifecycle_and_limits_parse(good_repo: Path) -> None:
    from geserve.cli import build_parser, settings_from_args

    settings = settings_from_args(build_parser().parse_args([
        "serve", "--model-repository", str(good_repo), "--id", "edge-1", "--exit-timeout-secs", "5",
        "--model-control-mode", "poll", "--repository-poll-secs", "2", "--grpc-keepalive-time", "1000",
        "--grpc-http2-min-recv-ping-interval-without-data", "500", "--http-max-header-count", "20",
    ]))
    assert (settings.server_id, settings.exit_timeout_secs, settings.model_control_mode) == ("edge-1", 5.0, "poll")
    assert (settings.repository_poll_secs, settings.grpc_keepalive_time_ms) == (2.0, 1000)
    assert settings.grpc_http2_min_recv_ping_interval_without_data_ms == 500
    assert settings.http_max_header_count == 20


def test_the_server_metadata_carries_the_id(good_repo: Path) -> None:
    async def run() -> None:
        server = Server(ServerSettings(model_repositories=[good_repo], server_id="edge-1", allow_http=False,
                                       allow_grpc=False, allow_metrics=False))
        await server.start()
        try:
            assert server.service.server_metadata()["name"] == "edge-1"
        finally:
            assert await server.stop()  # nothing in flight: a clean stop

    asyncio.run(run())
