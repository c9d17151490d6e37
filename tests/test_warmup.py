"""Model warmup on a real server: every instance runs every sample (zero, random and file data; `count` times;
`batch_size` requests together; batch 0 skipped) before the model is READY, through no statistics; a failing warmup
leaves the version UNAVAILABLE with Triton's reason and releases its instances."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from geserve.backends.base import InferenceHost
from geserve.backends.registry import BackendRegistry
from geserve.errors import GeserveError
from geserve.repository.lifecycle import LifecycleOptions, ModelManager
from geserve.repository.store import ModelStore
from tests.support import models
from tests.support.server import RunningServer, geserve

FILE_VALUES = [1.5, 2.5, 3.5, 4.5]


def _sample(name: str, *inputs: tuple[str, str], batch_size: int = 1, count: int = 0,
            data_type: str = "TYPE_FP32", dims: str = "4") -> str:
    """One model_warmup entry; `inputs`: (name, data choice) pairs, all of `data_type` and `dims`."""
    count_line = f" count: {count}" if count else ""
    entries = " ".join(f'inputs {{ key: "{key}" value {{ data_type: {data_type} dims: [ {dims} ] {data} }} }}'
                       for key, data in inputs)
    return f'{{ name: "{name}" batch_size: {batch_size}{count_line} {entries} }}'


def _warmup(*samples: str) -> str:
    return "model_warmup [\n  " + ",\n  ".join(samples) + "\n]"


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("warmup-records")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, records: Path) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("warmup") / "models"
    repo.mkdir()
    recorder = models.warmup_recorder(repo, "recorder", records / "recorder", _warmup(
        _sample("zeros", ("INPUT0", "zero_data: true"), batch_size=2, count=3),
        _sample("random", ("INPUT0", "random_data: true")),
        _sample("file", ("INPUT0", 'input_data_file: "input0"')),
        _sample("skipped", ("INPUT0", "zero_data: true"), batch_size=0),
    ))
    (recorder / "warmup").mkdir()
    (recorder / "warmup" / "input0").write_bytes(np.array(FILE_VALUES, dtype=np.float32).tobytes())
    models.warmup_recorder(repo, "decoupled", records / "decoupled", _warmup(
        _sample("zeros", ("INPUT0", "zero_data: true"), batch_size=2, count=2)), decoupled=True)
    models.warmup_recorder(repo, "refusing", records / "refusing", _warmup(
        _sample("zeros", ("INPUT0", "zero_data: true"))), fail=True)

    int32 = {"data_type": "TYPE_INT32", "dims": "16"}
    warm_simple = models.simple(repo, "warm_simple", extra=_warmup(_sample(
        "zero_and_file", ("INPUT0", "zero_data: true"), ("INPUT1", 'input_data_file: "input1"'), batch_size=4,
        **int32)))
    (warm_simple / "warmup").mkdir()
    (warm_simple / "warmup" / "input1").write_bytes(np.arange(16, dtype=np.int32).tobytes())
    short = models.simple(repo, "warm_short", extra=_warmup(_sample(
        "short", ("INPUT0", 'input_data_file: "short"'), ("INPUT1", "zero_data: true"), **int32)))
    (short / "warmup").mkdir()
    (short / "warmup" / "short").write_bytes(b"0123456789")
    models.simple(repo, "warm_variable", extra=_warmup(_sample(
        "variable", ("INPUT0", "zero_data: true"), ("INPUT1", "zero_data: true"), data_type="TYPE_INT32",
        dims="-1")))
    models.simple(repo, "warm_missing_input", extra=_warmup(_sample("one_input", ("INPUT0", "zero_data: true"),
                                                                    **int32)))
    log = tmp_path_factory.mktemp("warmup-logs") / "geserve.log"
    with geserve([repo], log) as running:
        yield running


def _get(server: RunningServer, path: str) -> Any:
    with urllib.request.urlopen(server.base + path, timeout=10) as response:
        return json.loads(response.read())


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _index(server: RunningServer) -> dict[str, dict[str, str]]:
    return {e["name"]: e for e in _post(server, "/v2/repository/index", {})}


def _records(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """Each instance's executions, by record file name (one per instance)."""
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in sorted(directory.iterdir())}


def _counts(server: RunningServer, model: str) -> tuple[int, int, int]:
    (stats,) = _get(server, f"/v2/models/{model}/stats")["model_stats"]
    return stats["inference_count"], stats["execution_count"], stats["inference_stats"]["success"]["count"]


def test_every_instance_runs_every_sample_before_the_model_is_ready(server: RunningServer, records: Path) -> None:
    assert _index(server)["recorder"]["state"] == "READY"
    per_instance = _records(records / "recorder")
    assert len(per_instance) == 2  # both instances of the group
    zeros = {"requests": [{"shape": [1, 4], "values": [0.0] * 4}] * 2}  # batch_size 2: two requests of one row
    for executions in per_instance.values():
        assert len(executions) == 5, executions  # zeros x3 (count), random, file; batch_size 0 skipped
        assert executions[:3] == [zeros] * 3
        (random,) = executions[3]["requests"]
        assert random["shape"] == [1, 4] and any(v != 0.0 for v in random["values"])
        assert executions[4] == {"requests": [{"shape": [1, 4], "values": FILE_VALUES}]}


def test_warmup_is_counted_in_no_statistics(server: RunningServer, records: Path) -> None:
    for model in ("recorder", "decoupled", "warm_simple"):
        assert _counts(server, model) == (0, 0, 0), model
    metrics = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for family in ("nv_inference_count", "nv_inference_exec_count", "nv_inference_request_success"):
        match = re.search(rf'^{family}\{{model="recorder",version="1"\}} (\S+)$', metrics, re.MULTILINE)
        assert match is not None and float(match.group(1)) == 0.0, family

    before = sum(len(e) for e in _records(records / "recorder").values())
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    answer = _post(server, "/v2/models/recorder/infer", body)
    assert answer["outputs"][0]["data"] == [1, 2, 3, 4]
    assert _counts(server, "recorder") == (1, 1, 1)  # a real request counts, and ran on the same instances
    assert sum(len(e) for e in _records(records / "recorder").values()) == before + 1


def test_a_decoupled_model_warms_up_through_its_response_stream(server: RunningServer, records: Path) -> None:
    assert _index(server)["decoupled"]["state"] == "READY"
    per_instance = _records(records / "decoupled")
    assert len(per_instance) == 2
    assert all(len(e) == 2 and len(e[0]["requests"]) == 2 for e in per_instance.values())


def test_an_onnx_model_warms_up_with_zero_and_file_data(server: RunningServer) -> None:
    assert _index(server)["warm_simple"]["state"] == "READY"
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}
                       for n in ("INPUT0", "INPUT1")]}
    assert _post(server, "/v2/models/warm_simple/infer", body)["outputs"][0]["data"] == [2] * 16


def test_a_failing_warmup_leaves_the_version_unavailable_with_the_reason(server: RunningServer, records: Path) -> None:
    index = _index(server)
    refusing = index["refusing"]
    assert refusing["state"] == "UNAVAILABLE"
    assert refusing["reason"].startswith("failed to run warmup sample 'zeros': ")
    assert "recorder refuses" in refusing["reason"] and refusing["reason"].endswith("; ")
    # The first instance failed its warmup and was released; the load stopped before the second was warmed up.
    first, second = sorted(_records(records / "refusing").values(), key=len, reverse=True)
    assert len(first) == 2 and first[-1] == {"finalized": True}
    assert second == [{"finalized": True}]

    assert index["warm_short"]["state"] == "UNAVAILABLE"
    assert index["warm_short"]["reason"] == (
        "failed to prepare warmup sample 'short': [request id: <id_unknown>] warmup setting expects 64 bytes, but "
        "the data provided from short only has 10 bytes"
    )
    assert index["warm_variable"]["reason"] == (
        "failed to prepare warmup sample 'variable': warmup setting expects all variable-size dimensions are "
        "specified for input 'INPUT0'"
    )
    assert "missing required input(s) ['INPUT1']" in index["warm_missing_input"]["reason"]
    with pytest.raises(urllib.error.HTTPError):
        _get(server, "/v2/models/refusing/ready")


def test_bytes_inputs_warm_up_with_empty_or_length_prefixed_strings(tmp_path: Path) -> None:
    """BYTES data in process: zeros and random data are empty strings, a file holds length-prefixed elements."""
    repo = tmp_path / "models"
    repo.mkdir()
    good = models.identity(repo, "bytes")
    config = good / "config.pbtxt"
    samples = [_sample(n, ("INPUT0", d), batch_size=2, data_type="TYPE_STRING", dims="2")
               for n, d in (("zeros", "zero_data: true"), ("random", "random_data: true"),
                            ("file", 'input_data_file: "strings"'))]
    config.write_text(config.read_text() + _warmup(*samples))
    (good / "warmup").mkdir()
    (good / "warmup" / "strings").write_bytes(b"\x02\x00\x00\x00ab\x01\x00\x00\x00c")
    bad = shutil.copytree(good, repo / "bad_strings")
    (bad / "config.pbtxt").write_text(config.read_text().replace("identity_bytes", "bad_strings"))
    (bad / "warmup" / "strings").write_bytes(b"\x02\x00\x00\x00ab\x05\x00\x00\x00c")  # the second one is cut short

    async def run() -> dict[str, dict[str, str]]:
        registry = BackendRegistry({})
        registry.attach_host(cast(InferenceHost, object()))  # no model here calls back into the server
        manager = ModelManager(ModelStore([repo]), registry, LifecycleOptions())
        try:
            for name in ("identity_bytes", "bad_strings"):
                with contextlib.suppress(GeserveError):
                    await manager.load(name)
            assert manager.get("identity_bytes").statistics.inference_count == 0
            return {e["name"]: e for e in manager.index()}
        finally:
            await manager.shutdown()

    index = asyncio.run(run())
    assert index["identity_bytes"]["state"] == "READY"
    assert index["bad_strings"]["state"] == "UNAVAILABLE"
    assert index["bad_strings"]["reason"] == (
        "failed to prepare warmup sample 'file': [request id: <id_unknown>] warmup setting expects 2 length-prefixed "
        "elements for input 'INPUT0', but the data provided from strings only has 1"
    )
