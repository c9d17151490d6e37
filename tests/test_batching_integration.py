"""Dynamic batching through a real server: concurrent requests become one execution, with exact /stats."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import models
from tests.support.server import RunningServer, geserve


@pytest.fixture(scope="module")
def batching_server(tmp_path_factory: pytest.TempPathFactory):
    repo = tmp_path_factory.mktemp("batching") / "models"
    repo.mkdir()
    batching = "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 2000000 }"
    models.simple(repo, "batched", extra=batching)
    models.simple(repo, "geared", extra='parameters { key: "batch_gears" value: { string_value: "1,2,4,8" } }\n'
                  "dynamic_batching { max_queue_delay_microseconds: 300000 }")
    models.autocomplete(repo, "auto_batched")
    with geserve([repo], tmp_path_factory.mktemp("logs") / "geserve.log") as server:
        yield server


def _infer(server: RunningServer, model: str, value: int, rows: int = 1) -> list[int]:
    body = json.dumps({"inputs": [
        {"name": n, "shape": [rows, 16], "datatype": "INT32", "data": [value] * 16 * rows} for n in ("INPUT0", "INPUT1")
    ]}).encode()
    request = urllib.request.Request(f"{server.base}/v2/models/{model}/infer", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["outputs"][0]["data"]


def _stats(server: RunningServer, model: str) -> dict:
    with urllib.request.urlopen(f"{server.base}/v2/models/{model}/stats", timeout=10) as response:
        return json.loads(response.read())["model_stats"][0]


def test_concurrent_requests_become_one_batch(batching_server: RunningServer) -> None:
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda v: _infer(batching_server, "batched", v), [1, 2, 3, 4]))
    assert outputs == [[2 * v] * 16 for v in [1, 2, 3, 4]]
    stats = _stats(batching_server, "batched")
    assert stats["inference_count"] == 4 and stats["execution_count"] == 1
    assert stats["inference_stats"]["success"]["count"] == 4
    assert stats["inference_stats"]["queue"]["count"] == 4
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(4, 1)]


def test_gears_pad_and_slice(batching_server: RunningServer) -> None:
    with ThreadPoolExecutor(3) as pool:
        outputs = list(pool.map(lambda v: _infer(batching_server, "geared", v), [5, 6, 7]))
    assert outputs == [[2 * v] * 16 for v in [5, 6, 7]]
    stats = _stats(batching_server, "geared")
    assert stats["inference_count"] == 3 and stats["execution_count"] == 1  # padding rows are not inferences


def test_auto_complete_turns_dynamic_batching_on(batching_server: RunningServer) -> None:
    with urllib.request.urlopen(f"{batching_server.base}/v2/models/auto_batched/config", timeout=10) as response:
        config = json.loads(response.read())
    assert config["max_batch_size"] == 4 and "dynamic_batching" in config
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0


def test_single_request_with_no_delay_is_not_held(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "nodelay", extra="dynamic_batching { }")
    with geserve([repo], tmp_path / "log") as server:
        assert _infer(server, "nodelay", 3, rows=2) == [6] * 32
        stats = _stats(server, "nodelay")
        assert stats["execution_count"] == 1 and stats["inference_count"] == 2


def test_adaptive_batching_model_loads_and_serves(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "adaptive", extra="dynamic_batching { }\n"
                  'parameters { key: "adaptive_batching_target_p99_ms" value: { string_value: "5" } }')
    with geserve([repo], tmp_path / "log") as server:
        with ThreadPoolExecutor(4) as pool:
            outputs = list(pool.map(lambda v: _infer(server, "adaptive", v), range(16)))
        assert outputs == [[2 * v] * 16 for v in range(16)]
