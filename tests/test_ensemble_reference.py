"""Ensembles side by side with the real Triton 2.51: outputs, /config, metadata, errors, load failures, stats.

Both serve the same ensembles; Triton runs the ONNX steps as Python-backend copies. Known difference, not
compared: for one failed ensemble request Triton 2.51 counts two failures in the ensemble's `fail` stats (geserve
counts one).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support import ensembles
from tests.support.ensembles import AB, INT16, Ensemble, Step, add_sub_step, chain
from tests.support.reference import (
    BootingTriton,
    build_python_backend_repository,
    reference_available,
    reference_unavailable_reason,
)
from tests.support.server import geserve

pytestmark = pytest.mark.reference

STEP_MODELS = ["add_sub", "add_sub_first", "add_sub_nobatch", "identity_int32"]
ENSEMBLES = [
    chain("chain", "add_sub"),
    Ensemble("chain_nobatch", AB, [("SUM", *INT16), ("DIFF", *INT16)],
             [add_sub_step("add_sub_first", "A", "B", "s", "d"),
              add_sub_step("add_sub_nobatch", "s", "d", "SUM", "DIFF")], max_batch_size=0),
    Ensemble("pipeline_fail", [("A", "TYPE_INT32", (-1,)), ("B", "TYPE_INT32", (-1,))],
             [("SUM", "TYPE_INT32", (-1,)), ("DIFF", "TYPE_INT32", (-1,))],
             [Step("identity_int32", {"INPUT0": "A"}, {"OUTPUT0": "a"}),
              add_sub_step("add_sub_first", "a", "B", "SUM", "DIFF")]),
    Ensemble("bad_unknown", AB, [("SUM", *INT16), ("DIFF", *INT16)],
             [add_sub_step("no_such_model", "A", "B", "SUM", "DIFF")]),
    Ensemble("bad_dtype", [("A", "TYPE_FP32", (16,)), AB[1]], [("SUM", *INT16), ("DIFF", *INT16)],
             [add_sub_step("add_sub_first", "A", "B", "SUM", "DIFF")]),
]
GOOD = ["chain", "chain_nobatch", "pipeline_fail"]
NEWER_CONFIG_FIELDS = {"runtime", "is_non_linear_format_io"}  # in Triton 2.51's proto, not in geserve's


@dataclass(frozen=True)
class Response:
    status: int
    body: Any


def _call(base: str, method: str, path: str, body: dict | None = None) -> Response:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return Response(response.status, json.loads(raw) if raw else None)
    except urllib.error.HTTPError as exc:
        return Response(exc.code, json.loads(exc.read()))


@dataclass(frozen=True)
class Pair:
    triton: str
    geserve: str

    def both(self, method: str, path: str, body: dict | None = None) -> tuple[Response, Response]:
        return _call(self.triton, method, path, body), _call(self.geserve, method, path, body)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    if not reference_available():
        pytest.skip(reference_unavailable_reason() or "reference Triton unavailable")
    root = tmp_path_factory.mktemp("ensemble_ref")
    source = root / "onnx"
    source.mkdir()
    ensembles.add_sub(source, "add_sub")
    ensembles.add_sub(source, "add_sub_first")
    ensembles.add_sub(source, "add_sub_nobatch", max_batch_size=0)
    ensembles.identity_int32(source)
    python_repo = build_python_backend_repository(source, root / "python", STEP_MODELS)
    for ensemble in ENSEMBLES:
        ensemble.write(source)
        ensemble.write(python_repo)
    loads = [f"--load-model={name}" for name in GOOD]

    triton = BootingTriton(python_repo, root, model_control_mode="explicit", load_models=GOOD)
    try:
        with geserve([source], root / "geserve.log", ["--model-control-mode=explicit", *loads]) as server:
            triton.wait()
            yield Pair(triton.url, server.base)
    finally:
        triton.stop()


def _infer_body(a: list[int], b: list[int], shape: list[int], outputs: list[str] | None = None) -> dict:
    body: dict[str, Any] = {"inputs": [{"name": "A", "shape": shape, "datatype": "INT32", "data": a},
                                       {"name": "B", "shape": shape, "datatype": "INT32", "data": b}]}
    if outputs is not None:
        body["outputs"] = [{"name": n} for n in outputs]
    return body


def _outputs(response: Response) -> dict[str, tuple[list[int], list[int]]]:
    return {o["name"]: (o["shape"], o["data"]) for o in response.body["outputs"]}


def test_same_answers(pair: Pair) -> None:
    a, b = list(range(16)), [3] * 16
    for model, shape in (("chain", [1, 16]), ("chain_nobatch", [16])):
        triton, geserve_ = pair.both("POST", f"/v2/models/{model}/infer", _infer_body(a, b, shape))
        assert (triton.status, geserve_.status) == (200, 200)
        assert _outputs(geserve_) == _outputs(triton)
        assert _outputs(geserve_)["SUM"] == (shape, [2 * v for v in a])
    triton, geserve_ = pair.both("POST", "/v2/models/chain/infer", _infer_body(a, b, [1, 16], ["DIFF"]))
    assert _outputs(geserve_) == _outputs(triton) == {"DIFF": ([1, 16], [6] * 16)}


def test_same_config_and_metadata(pair: Pair) -> None:
    for model in GOOD:
        triton, geserve_ = pair.both("GET", f"/v2/models/{model}")
        assert (triton.status, geserve_.status) == (200, 200)
        assert geserve_.body == triton.body
        triton, geserve_ = pair.both("GET", f"/v2/models/{model}/config")
        t_cfg = {k: v for k, v in triton.body.items() if k not in NEWER_CONFIG_FIELDS}
        g_cfg = geserve_.body

        def strip(entries: list[dict]) -> list[dict]:
            return [{k: v for k, v in e.items() if k not in NEWER_CONFIG_FIELDS} for e in entries]

        t_cfg["input"], t_cfg["output"] = strip(t_cfg["input"]), strip(t_cfg["output"])
        assert g_cfg == t_cfg


def test_same_error_for_a_failing_step(pair: Pair) -> None:
    body = _infer_body([1] * 8, [1] * 16, [1, 8])
    body["inputs"][1]["shape"] = [1, 16]  # only the first step's output is too short for the second step
    triton, geserve_ = pair.both("POST", "/v2/models/pipeline_fail/infer", body)
    assert triton.status == geserve_.status == 400
    assert geserve_.body == triton.body
    assert triton.body["error"].startswith("in ensemble 'pipeline_fail', [request id: <id_unknown>] unexpected shape")
    triton, geserve_ = pair.both("POST", "/v2/models/chain/infer", {**_infer_body([1] * 16, [1] * 16, [1, 16]),
                                                                    "outputs": [{"name": "s"}]})
    assert triton.status == geserve_.status == 400 and geserve_.body == triton.body


def test_same_reasons_for_bad_ensembles(pair: Pair) -> None:
    for model in ("bad_unknown", "bad_dtype"):
        triton, geserve_ = pair.both("POST", f"/v2/repository/models/{model}/load", {})
        assert triton.status == geserve_.status == 400
        assert geserve_.body["error"] == triton.body["error"].rstrip("\n")
    index = {e["name"]: e for e in _call(pair.geserve, "POST", "/v2/repository/index", {}).body}
    assert index["bad_dtype"]["reason"] == (
        "in ensemble bad_dtype, ensemble tensor A: inconsistent data type: TYPE_FP32 is inferred from model "
        "bad_dtype while TYPE_INT32 is inferred from model add_sub_first"
    )


def _counts(stats: dict) -> dict:
    return {
        "inference_count": stats["inference_count"],
        "execution_count": stats["execution_count"],
        **{k: v["count"] for k, v in stats["inference_stats"].items() if k != "fail"},
        "batch_stats": [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]],
    }


def test_same_statistics(pair: Pair) -> None:
    for rows in (1, 2, 1):
        triton, geserve_ = pair.both(
            "POST", "/v2/models/chain/infer", _infer_body(list(range(16)) * rows, [1] * 16 * rows, [rows, 16])
        )
        assert triton.status == geserve_.status == 200
    for model in ("chain", "add_sub"):
        # Triton records a request's statistics after it has sent the response, so a read right after the last
        # response can miss it: read again until both agree or a few seconds have passed.
        deadline = time.monotonic() + 5
        while True:
            triton, geserve_ = pair.both("GET", f"/v2/models/{model}/stats")
            t_stats, g_stats = triton.body["model_stats"][0], geserve_.body["model_stats"][0]
            if _counts(g_stats) == _counts(t_stats) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert _counts(g_stats) == _counts(t_stats), model
    assert _counts(g_stats)["execution_count"] >= 6  # (earlier tests ran the chain too)
