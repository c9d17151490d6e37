"""What a load refuses or lets through: a Triton ONNX Runtime model with parameters geserve does not know loads (with
one warning per model), the GE dialects stay strict, and a stateful model loads and is served by the sequence batcher
(never as a stateless one)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from geserve.backends.ge.parameters import ignores_unknown_parameters, parse_ge_options
from geserve.config import parse_config_text
from geserve.errors import InvalidArgumentError
from tests.support import models
from tests.support.server import RunningServer, geserve

UNKNOWN = 'parameters { key: "execute_delay_ms" value: { string_value: "5" } }'


@pytest.mark.parametrize(
    ("dialect", "lenient"),
    [('platform: "onnxruntime_onnx"', True), ('backend: "onnxruntime"', True),
     ('platform: "graph_executor"', False), ('backend: "ge"', False), ('backend: "npu_ge"', False),
     ('platform: "onnxruntime_onnx" backend: "npu_ge"', False), ("", False)],
)
def test_only_triton_onnx_runtime_models_ignore_unknown_parameters(dialect: str, lenient: bool) -> None:
    config = parse_config_text(f'name: "m" {dialect} {UNKNOWN}', "test")
    assert ignores_unknown_parameters(config) is lenient
    if lenient:
        assert parse_ge_options(config).ignored == ["execute_delay_ms"]
    else:
        with pytest.raises(InvalidArgumentError, match="unknown parameter 'execute_delay_ms' for model 'm'"):
            parse_ge_options(config)


def _dialect(model_dir: Path, dialect: str) -> None:
    config = model_dir / "config.pbtxt"
    config.write_text(config.read_text().replace('backend: "onnxruntime"', dialect))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("load-checks") / "models"
    repo.mkdir()
    # A plain Triton ONNX repository: two versions served (one warning for the model, not one per version).
    triton = models.simple(repo, "triton_onnx", extra=UNKNOWN + "\nversion_policy: { all { } }")
    _dialect(triton, 'platform: "onnxruntime_onnx"')
    (triton / "2").mkdir()
    (triton / "2" / "model.onnx").write_bytes((triton / "1" / "model.onnx").read_bytes())
    models.simple(repo, "triton_backend", extra=UNKNOWN)
    _dialect(models.simple(repo, "ge_platform", extra=UNKNOWN), 'platform: "graph_executor"')
    _dialect(models.simple(repo, "npu_ge", extra=UNKNOWN), 'backend: "npu_ge"')
    models.simple(repo, "stateful", extra="sequence_batching { max_sequence_idle_microseconds: 5000000 }")
    log = tmp_path_factory.mktemp("load-checks-logs") / "geserve.log"
    with geserve([repo], log) as running:
        yield running


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(server.base + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _index(server: RunningServer) -> dict[tuple[str, str], dict[str, str]]:
    return {(e["name"], e.get("version", "")): e for e in _post(server, "/v2/repository/index", {})}


def test_a_triton_onnx_model_with_unknown_parameters_loads_serves_and_warns_once(server: RunningServer) -> None:
    index = _index(server)
    for key in (("triton_onnx", "1"), ("triton_onnx", "2"), ("triton_backend", "1")):
        assert index[key]["state"] == "READY", index[key]
    body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [3] * 16}
                       for n in ("INPUT0", "INPUT1")]}
    for path in ("/v2/models/triton_onnx/versions/1/infer", "/v2/models/triton_onnx/versions/2/infer",
                 "/v2/models/triton_backend/infer"):
        assert _post(server, path, body)["outputs"][0]["data"] == [6] * 16
    warnings = [line for line in server.log().splitlines() if "ignoring parameter(s) 'execute_delay_ms'" in line]
    assert sum("'triton_onnx'" in line for line in warnings) == 1, warnings
    assert sum("'triton_backend'" in line for line in warnings) == 1, warnings


def test_the_ge_dialects_refuse_unknown_parameters(server: RunningServer) -> None:
    index = _index(server)
    for name in ("ge_platform", "npu_ge"):
        entry = index[(name, "1")]
        assert entry["state"] == "UNAVAILABLE"
        assert f"unknown parameter 'execute_delay_ms' for model '{name}'" in entry["reason"]


def test_a_stateful_model_loads_and_is_served_by_the_sequence_batcher(server: RunningServer) -> None:
    index = _index(server)
    entry = index[("stateful", "1")]
    assert entry["state"] == "READY", entry
    assert not any(name == "stateful" and not key for name, key in index)  # not refused before its versions
    inputs = [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [3] * 16} for n in ("INPUT0", "INPUT1")]
    started = {"inputs": inputs, "parameters": {"sequence_id": 7, "sequence_start": True, "sequence_end": True}}
    assert _post(server, "/v2/models/stateful/infer", started)["outputs"][0]["data"] == [6] * 16
    # Served as a sequence model, not as a stateless one: a request outside a sequence is refused in Triton's words.
    for parameters, message in (
        ({}, "inference request to model 'stateful' must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": 8}, "inference request for sequence 8 to model 'stateful' must specify the START flag on "
                             "the first request of the sequence"),
    ):
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(server, "/v2/models/stateful/infer", {"inputs": inputs, "parameters": parameters})
        assert refused.value.code == 400
        assert json.loads(refused.value.read())["error"] == message
