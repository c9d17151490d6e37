"""Ensembles with decoupled steps, through a real geserve server and tritonclient's gRPC streams.

Each response of a decoupled step runs the steps after it once more; the ensemble streams one response per run.
The same behaviour on the real Triton is checked in test_python_backend_conformance.py.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.ensembles import Ensemble, Step, repeat_inc
from tests.support.python_repo import PYTHON_MODELS
from tests.support.server import RunningServer, geserve
from tests.support.streams import stream_request, summarized

I32 = "TYPE_INT32"
# Python steps written here: `count_slow` takes 0.3 s to count its input, `plus` adds two scalars.
COUNT_SLOW = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "N", np.array([pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().size], np.int32))]) for r in requests]
"""
PLUS = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("S", pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                                                            + pb_utils.get_input_tensor_by_name(r, "B").as_numpy())])
                for r in requests]
"""


def _python_model(repo: Path, name: str, source: str, inputs: list[tuple[str, str]], output: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    entries = ", ".join(f'{{ name: "{n}" data_type: {I32} dims: [{d}] }}' for n, d in inputs)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\ninput [{entries}]\n'
        f'output [{{ name: "{output}" data_type: {I32} dims: [1] }}]\n'
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("ensemble_decoupled")
    repo = root / "models"
    for name in ("repeat", "inc"):
        shutil.copytree(PYTHON_MODELS / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    _python_model(repo, "count_slow", COUNT_SLOW, [("IN", "-1")], "N")
    _python_model(repo, "plus", PLUS, [("A", "1"), ("B", "1")], "S")
    idx = ("IDX", "TYPE_UINT32", (1,))
    for ensemble in (
        repeat_inc(),
        # IN -> repeat -> o; IN -> count_slow -> n (once, slower than repeat); plus(o, n) -> S per response.
        Ensemble("fanout_join", [("IN", I32, (-1,))], [("S", I32, (1,)), idx], [
            Step("repeat", {"IN": "IN"}, {"OUT": "o", "IDX": "IDX"}),
            Step("count_slow", {"IN": "IN"}, {"N": "n"}),
            Step("plus", {"A": "o", "B": "n"}, {"S": "S"}),
        ], max_batch_size=0),
        # A decoupled step after a decoupled step: the outer IDX is read from the enclosing run.
        Ensemble("nested_repeat", [("IN", I32, (-1,))], [("OUT", I32, (1,)), idx], [
            Step("repeat", {"IN": "IN"}, {"OUT": "o", "IDX": "IDX"}),
            Step("repeat", {"IN": "o"}, {"OUT": "OUT"}),
        ], max_batch_size=0),
        # A decoupled ensemble as a step is a decoupled step.
        Ensemble("outer", [("IN", I32, (-1,))], [("Y", I32, (1,))],
                 [Step("repeat_inc", {"IN": "IN"}, {"Y": "Y"})], max_batch_size=0),
    ):
        ensemble.write(repo)
    with geserve([repo], root / "geserve.log") as running:
        yield running


def stream(server: RunningServer, model: str, values: list[int], outputs: list[str] | None = None) -> list:
    """One request's messages on a gRPC stream: (outputs, final) each, or ("error", message)."""
    return summarized(stream_request(server.grpc_url, model, values, outputs=outputs)[0])


def _get(server: RunningServer, path: str) -> dict:
    with urllib.request.urlopen(server.base + path, timeout=30) as response:
        return json.loads(response.read())


def _executions(server: RunningServer, *models: str) -> dict[str, int]:
    return {m: _get(server, f"/v2/models/{m}/stats")["model_stats"][0]["execution_count"] for m in models}


def _responses(messages: list) -> list[dict]:
    """The responses with outputs, in IDX order (a decoupled ensemble may answer out of order)."""
    found = [outputs for outputs, _ in messages if outputs]
    return sorted(found, key=lambda o: o.get("IDX", [0]))


def test_each_response_of_a_decoupled_step_runs_the_steps_after_it(server: RunningServer) -> None:
    before = _executions(server, "repeat", "inc", "repeat_inc")
    messages = stream(server, "repeat_inc", [1, 2, 3])
    assert _responses(messages) == [{"Y": [2], "IDX": [0]}, {"Y": [3], "IDX": [1]}, {"Y": [4], "IDX": [2]}]
    assert messages[-1][1] and not any(final for _, final in messages[:-1])  # one final flag, at the end
    after = _executions(server, "repeat", "inc", "repeat_inc")
    assert {m: after[m] - before[m] for m in after} == {"repeat": 1, "inc": 3, "repeat_inc": 1}
    # As in Triton: the ensemble is marked decoupled, so HTTP refuses it.
    assert _get(server, "/v2/models/repeat_inc/config")["model_transaction_policy"] == {"decoupled": True}
    body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]}]}
    request = urllib.request.Request(server.base + "/v2/models/repeat_inc/infer", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 501
    assert json.loads(caught.value.read()) == {
        "error": "HTTP end point doesn't support models with decoupled transaction policy"
    }


def test_steps_before_the_decoupled_step_run_once_and_its_runs_wait_for_them(server: RunningServer) -> None:
    before = _executions(server, "repeat", "count_slow", "plus")
    messages = stream(server, "fanout_join", [10, 20, 30])
    assert _responses(messages) == [{"S": [13], "IDX": [0]}, {"S": [23], "IDX": [1]}, {"S": [33], "IDX": [2]}]
    after = _executions(server, "repeat", "count_slow", "plus")
    assert {m: after[m] - before[m] for m in after} == {"repeat": 1, "count_slow": 1, "plus": 3}


def test_only_the_steps_requested_outputs_need_run(server: RunningServer) -> None:
    before = _executions(server, "repeat", "count_slow", "plus")
    messages = stream(server, "fanout_join", [10, 20], outputs=["IDX"])
    assert _responses(messages) == [{"IDX": [0]}, {"IDX": [1]}]
    after = _executions(server, "repeat", "count_slow", "plus")
    assert {m: after[m] - before[m] for m in after} == {"repeat": 1, "count_slow": 0, "plus": 0}


def test_decoupled_steps_nest(server: RunningServer) -> None:
    messages = stream(server, "nested_repeat", [4, 5, 6])
    assert _responses(messages) == [{"OUT": [4], "IDX": [0]}, {"OUT": [5], "IDX": [1]}, {"OUT": [6], "IDX": [2]}]


def test_a_decoupled_ensemble_is_a_decoupled_step(server: RunningServer) -> None:
    assert _get(server, "/v2/models/outer/config")["model_transaction_policy"] == {"decoupled": True}
    messages = stream(server, "outer", [7, 8])
    assert sorted(outputs["Y"] for outputs, _ in messages if outputs) == [[8], [9]]
    assert messages[-1][1]


def test_no_responses_from_the_decoupled_step_is_an_empty_final_response(server: RunningServer) -> None:
    assert stream(server, "repeat_inc", []) == [({}, True)]


def test_a_failing_step_ends_the_stream_with_its_error(server: RunningServer) -> None:
    messages = stream(server, "repeat_inc", [5, 99, 6])
    assert messages == [({"Y": [6], "IDX": [0]}, False), ("error", "in ensemble 'repeat_inc', inc refuses 99")]
    messages = stream(server, "repeat_inc", [-2])  # the decoupled step itself fails
    assert len(messages) == 1 and messages[0][0] == "error"
    assert messages[0][1].startswith("in ensemble 'repeat_inc', ") and "repeat was asked to raise" in messages[0][1]
    assert _responses(stream(server, "repeat_inc", [1])) == [{"Y": [2], "IDX": [0]}]  # the server keeps serving
