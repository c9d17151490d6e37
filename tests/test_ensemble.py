"""Ensembles through a real geserve server: DAG execution, per-step batching, errors, statistics, lifecycle."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support import ensembles
from tests.support.ensembles import AB, INT16, Ensemble, Step, add_sub_step, chain
from tests.support.server import RunningServer, geserve

FP4 = ("TYPE_FP32", (4,))
SLOW_ROUNDS = 30  # ~35 ms of one core per branch run


# Three Python steps in one process: `watch_make` makes a 16 MB tensor and keeps only a weak reference to it (in a
# module all steps see), `watch_sum` reduces it, and `watch_check` reports whether anything still holds it.
WATCH_MODEL = """
import gc
import sys
import types
import weakref

import numpy as np
import triton_python_backend_utils as pb_utils

WATCH = sys.modules.setdefault("_ensemble_watch", types.ModuleType("_ensemble_watch"))


class TritonPythonModel:
    def initialize(self, args):
        self.role = args["model_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if self.role == "watch_make":
                y = np.full(4_000_000, x[0], np.float32)
                WATCH.ref = weakref.ref(y)
            elif self.role == "watch_sum":
                y = np.array([x.sum()], np.float32)
            else:
                gc.collect()
                y = np.array([WATCH.ref() is None], np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""


def _watch_step(repo: Path, name: str, in_dims: str, out_dims: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(WATCH_MODEL)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        f'input [{{ name: "X" data_type: TYPE_FP32 dims: [{in_dims}] }}]\n'
        f'output [{{ name: "Y" data_type: TYPE_FP32 dims: [{out_dims}] }}]\n'
    )


def _repository(repo: Path) -> Path:
    repo.mkdir(parents=True)
    _watch_step(repo, "watch_make", "1", "-1")
    _watch_step(repo, "watch_sum", "-1", "1")
    _watch_step(repo, "watch_check", "1", "1")
    for name in ("add_sub", "add_sub_stats", "add_sub_fail", "add_sub_unload"):
        ensembles.add_sub(repo, name)
    ensembles.add_sub(repo, "add_sub_nobatch", max_batch_size=0)
    ensembles.add_sub(repo, "add_sub_batched", extra="dynamic_batching { max_queue_delay_microseconds: 300000 }")
    ensembles.identity_int32(repo)
    ensembles.affine(repo, "double", 2.0, 0.0)
    ensembles.affine(repo, "slow_plus", 1.0, 1.0, heavy=SLOW_ROUNDS)
    ensembles.affine(repo, "slow_minus", 1.0, -1.0, heavy=SLOW_ROUNDS)
    ensembles.add(repo, "join")
    for ensemble in (
        chain("chain", "add_sub"),
        chain("chain_stats", "add_sub_stats"),
        chain("chain_batched", "add_sub_batched"),
        chain("chain_unload", "add_sub_unload"),
        Ensemble("watch", [("X", "TYPE_FP32", (1,))], [("TOTAL", "TYPE_FP32", (1,)), ("FREED", "TYPE_FP32", (1,))], [
            Step("watch_make", {"X": "X"}, {"Y": "BIG"}),
            Step("watch_sum", {"X": "BIG"}, {"Y": "TOTAL"}),
            Step("watch_check", {"X": "TOTAL"}, {"Y": "FREED"}),
        ], max_batch_size=0),
        # A batching step feeding a non-batching one, in a non-batching ensemble: shapes move as in Triton.
        Ensemble("chain_nobatch", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [add_sub_step("add_sub", "A", "B", "s", "d"),
                  add_sub_step("add_sub_nobatch", "s", "d", "SUM", "DIFF")], max_batch_size=0),
        # X -> double -> D; D -> slow_plus -> PLUS and D -> slow_minus -> MINUS (concurrently); join -> SUM = 4X
        Ensemble("diamond", [("X", *FP4)], [("SUM", *FP4), ("PLUS", *FP4)], [
            Step("double", {"X": "X"}, {"Y": "D"}),
            Step("slow_plus", {"X": "D"}, {"Y": "PLUS"}),
            Step("slow_minus", {"X": "D"}, {"Y": "MINUS"}),
            Step("join", {"A": "PLUS", "B": "MINUS"}, {"SUM": "SUM"}),
        ]),
        # Variable-length ensemble inputs; the second step only takes 16 values: a shorter request fails there.
        Ensemble("pipeline_fail", [("A", "TYPE_INT32", (-1,)), ("B", "TYPE_INT32", (-1,))],
                 [("SUM", "TYPE_INT32", (-1,)), ("DIFF", "TYPE_INT32", (-1,))],
                 [Step("identity_int32", {"INPUT0": "A"}, {"OUTPUT0": "a"}),
                  add_sub_step("add_sub_fail", "a", "B", "SUM", "DIFF")]),
        # An ensemble as a step of another (pinned to version 1), and two ensembles that use each other.
        Ensemble("nested", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [Step("chain", {"A": "A", "B": "B"}, {"SUM": "SUM", "DIFF": "DIFF"}, version=1)]),
        Ensemble("loop_a", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [Step("loop_b", {"A": "A", "B": "B"}, {"SUM": "SUM", "DIFF": "DIFF"})]),
        Ensemble("loop_b", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [Step("loop_a", {"A": "A", "B": "B"}, {"SUM": "SUM", "DIFF": "DIFF"})]),
        Ensemble("bad_cycle", AB, [("SUM", *INT16), ("DIFF", *INT16)], [
            add_sub_step("add_sub", "A", "x", "s", "d"),
            add_sub_step("add_sub", "s", "d", "x", "DIFF"),
            add_sub_step("add_sub", "s", "B", "SUM", "unused"),
        ]),
        Ensemble("bad_unknown", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [add_sub_step("no_such_model", "A", "B", "SUM", "DIFF")]),
        Ensemble("bad_unmapped", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [add_sub_step("add_sub", "A", "nowhere", "SUM", "DIFF"), add_sub_step("add_sub", "B", "B", "x", "y")]),
        Ensemble("bad_input_name", AB, [("SUM", *INT16), ("DIFF", *INT16)],
                 [Step("add_sub", {"INPUT0": "A", "INPUTX": "B"}, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"})]),
    ):
        ensemble.write(repo)
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("ensemble")
    repo = _repository(root / "models")
    # Explicit mode with every model loaded at start: the lifecycle tests load and unload on the same server.
    with geserve([repo], root / "geserve.log", ["--model-control-mode=explicit", "--load-model=*"]) as running:
        yield running


def _get(server: RunningServer, path: str) -> dict | list:
    with urllib.request.urlopen(server.base + path, timeout=30) as response:
        return json.loads(response.read())


def _post(server: RunningServer, path: str, body: dict | None = None) -> tuple[int, dict | list | None]:
    request = urllib.request.Request(server.base + path, data=json.dumps(body or {}).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _stats(server: RunningServer, model: str) -> dict:
    return _get(server, f"/v2/models/{model}/stats")["model_stats"][0]


def _index(server: RunningServer) -> dict[str, dict]:
    return {e["name"]: e for e in _post(server, "/v2/repository/index")[1]}


def _ab_inputs(module, a: np.ndarray, b: np.ndarray) -> list:
    inputs = [module.InferInput("A", list(a.shape), "INT32"), module.InferInput("B", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _http_chain(server: RunningServer, model: str, a: np.ndarray, b: np.ndarray, **kwargs) -> httpclient.InferResult:
    with httpclient.InferenceServerClient(server.url) as client:
        return client.infer(model, _ab_inputs(httpclient, a, b), **kwargs)


def _diamond(client: httpclient.InferenceServerClient, x: np.ndarray, outputs: list[str] | None = None):
    tensor = httpclient.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    wanted = [httpclient.InferRequestedOutput(n) for n in outputs] if outputs else None
    return client.infer("diamond", [tensor], outputs=wanted)


A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def test_chain_over_http_and_grpc(server: RunningServer) -> None:
    result = _http_chain(server, "chain", A, B, priority=1, timeout=10_000_000)
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * A)
    np.testing.assert_array_equal(result.as_numpy("DIFF"), 2 * B)
    assert result.get_response()["model_name"] == "chain" and result.get_response()["model_version"] == "1"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        a, b = np.vstack([A, A + 1]), np.vstack([B, B])
        result = client.infer("chain", _ab_inputs(grpcclient, a, b), request_id="grpc-1")
        np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * a)
        np.testing.assert_array_equal(result.as_numpy("DIFF"), 2 * b)
        assert result.get_response().id == "grpc-1"
        metadata = client.get_model_metadata("chain", as_json=True)
    assert metadata["platform"] == "ensemble"
    assert [(i["name"], i["shape"]) for i in metadata["inputs"]] == [("A", ["-1", "16"]), ("B", ["-1", "16"])]


def test_an_ensemble_can_be_a_step(server: RunningServer) -> None:
    before = _stats(server, "chain")["execution_count"]
    result = _http_chain(server, "nested", A, B)
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * A)
    assert _stats(server, "chain")["execution_count"] == before + 1
    nested = _stats(server, "nested")
    assert nested["execution_count"] == 1 and nested["inference_stats"]["compute_infer"]["ns"] > 0


def test_config_and_metadata_have_tritons_shape(server: RunningServer) -> None:
    config = _get(server, "/v2/models/chain/config")
    assert (config["platform"], config["backend"], config["default_model_filename"]) == ("ensemble", "", "")
    assert config["instance_group"] == [] and "optimization" not in config and "dynamic_batching" not in config
    assert config["model_transaction_policy"] == {"decoupled": False}
    steps = config["ensemble_scheduling"]["step"]
    assert [(s["model_name"], s["model_version"]) for s in steps] == [("add_sub", -1), ("add_sub", -1)]
    assert steps[1]["input_map"] == {"INPUT0": "s", "INPUT1": "d"}
    assert steps[1]["output_map"] == {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}
    metadata = _get(server, "/v2/models/chain")
    assert metadata["platform"] == "ensemble" and metadata["versions"] == ["1"]
    assert [o["name"] for o in metadata["outputs"]] == ["SUM", "DIFF"]


def test_batching_and_non_batching_steps_mix(server: RunningServer) -> None:
    result = _http_chain(server, "chain_nobatch", A[0], B[0])
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * A[0])
    np.testing.assert_array_equal(result.as_numpy("DIFF"), 2 * B[0])


def test_diamond_branches_run_concurrently(server: RunningServer) -> None:
    before = {m: _stats(server, m) for m in ("diamond", "slow_plus", "slow_minus")}
    x = np.array([[1.0, 2.0, -3.0, 0.5]], np.float32)
    with httpclient.InferenceServerClient(server.url) as client:
        for _ in range(3):
            result = _diamond(client, x)
            np.testing.assert_array_equal(result.as_numpy("SUM"), 4 * x)
            np.testing.assert_array_equal(result.as_numpy("PLUS"), 2 * x + 1)
    after = {m: _stats(server, m) for m in before}

    def spent(model: str, field: str) -> int:
        return after[model]["inference_stats"][field]["ns"] - before[model]["inference_stats"][field]["ns"]

    branches = spent("slow_plus", "compute_infer") + spent("slow_minus", "compute_infer")
    # One after the other, the ensemble would take longer than both branches together (measured: 0.97 of it);
    # side by side, about as long as one (measured: 1.7 x).
    assert branches > 1.25 * spent("diamond", "success"), (branches, spent("diamond", "success"))
    assert after["diamond"]["execution_count"] - before["diamond"]["execution_count"] == 3


def test_only_requested_outputs_and_the_steps_they_need(server: RunningServer) -> None:
    result = _http_chain(server, "chain", A, B, outputs=[httpclient.InferRequestedOutput("DIFF")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["DIFF"]
    np.testing.assert_array_equal(result.as_numpy("DIFF"), 2 * B)
    before = {m: _stats(server, m)["execution_count"] for m in ("double", "slow_plus", "slow_minus", "join")}
    x = np.ones((1, 4), np.float32)
    with httpclient.InferenceServerClient(server.url) as client:
        result = _diamond(client, x, ["PLUS"])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["PLUS"]
    np.testing.assert_array_equal(result.as_numpy("PLUS"), 3 * x)
    ran = {m: _stats(server, m)["execution_count"] - n for m, n in before.items()}
    assert ran == {"double": 1, "slow_plus": 1, "slow_minus": 0, "join": 0}  # pruned, as Triton prunes
    status, body = _post(server, "/v2/models/chain/infer", {
        "inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16} for n in ("A", "B")],
        "outputs": [{"name": "s"}],
    })
    assert (status, body) == (400, {"error": "unexpected inference output 's' for model 'chain'"})


def test_dynamic_batching_applies_in_each_step(server: RunningServer) -> None:
    requests = 6
    with ThreadPoolExecutor(requests) as pool:
        results = list(pool.map(lambda k: _http_chain(server, "chain_batched", A + k, B), range(requests)))
    for k, result in enumerate(results):
        np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * (A + k))
    step = _stats(server, "add_sub_batched")
    assert step["inference_count"] == 2 * requests
    assert step["execution_count"] < step["inference_count"]  # the steps of different requests shared batches
    ensemble = _stats(server, "chain_batched")
    assert (ensemble["inference_count"], ensemble["execution_count"]) == (requests, requests)


def test_a_failing_step_fails_the_ensemble_with_its_error(server: RunningServer) -> None:
    short = np.ones((1, 8), np.int32)
    with pytest.raises(InferenceServerException) as caught:
        _http_chain(server, "pipeline_fail", short, B)
    assert caught.value.status() == "400"
    assert caught.value.message() == (
        "in ensemble 'pipeline_fail', [request id: <id_unknown>] unexpected shape for input 'INPUT0' for model "
        "'add_sub_fail'. Expected [-1,16], got [1,8]. NOTE: Setting a non-zero max_batch_size in the model config "
        "requires a batch dimension to be prepended to each input shape. If you want to specify the full shape "
        "including the batch dim in your input dims config, try setting max_batch_size to zero. See the model "
        "configuration docs for more info on max_batch_size."
    )
    with grpcclient.InferenceServerClient(server.grpc_url) as client, pytest.raises(InferenceServerException) as err:
        client.infer("pipeline_fail", _ab_inputs(grpcclient, short, B))
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "in ensemble 'pipeline_fail'" in err.value.message()
    result = _http_chain(server, "pipeline_fail", A, B)  # the server and the pipeline serve on
    np.testing.assert_array_equal(result.as_numpy("SUM"), A + B)
    ensemble, first, second = (_stats(server, m) for m in ("pipeline_fail", "identity_int32", "add_sub_fail"))
    assert ensemble["inference_stats"]["fail"]["count"] == 2
    assert ensemble["inference_stats"]["success"]["count"] == ensemble["execution_count"] == 1
    assert first["inference_stats"]["success"]["count"] == 3  # the first step ran each time
    assert second["inference_stats"]["success"]["count"] == 1  # refused requests are no failures of the model's
    assert second["inference_stats"]["fail"]["count"] == 0


def test_statistics_count_the_ensemble_and_its_steps(server: RunningServer) -> None:
    _http_chain(server, "chain_stats", A, B)
    _http_chain(server, "chain_stats", np.vstack([A, A]), np.vstack([B, B]))
    _http_chain(server, "chain_stats", A, B)
    ensemble, step = _stats(server, "chain_stats"), _stats(server, "add_sub_stats")
    assert (ensemble["inference_count"], ensemble["execution_count"]) == (4, 3)
    counts = {k: v["count"] for k, v in ensemble["inference_stats"].items()}
    assert counts == {"success": 3, "fail": 0, "queue": 3, "compute_input": 3, "compute_infer": 3,
                      "compute_output": 3, "cache_hit": 0, "cache_miss": 0}
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in ensemble["batch_stats"]] == [(1, 2), (2, 1)]
    assert (step["inference_count"], step["execution_count"]) == (8, 6)
    assert step["inference_stats"]["success"]["count"] == 6
    # The ensemble reports the compute of its steps (Triton's way): here every step execution was its own.
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert ensemble["inference_stats"][phase]["ns"] == step["inference_stats"][phase]["ns"]
    assert ensemble["inference_stats"]["success"]["ns"] >= ensemble["inference_stats"]["compute_infer"]["ns"]
    assert ensemble["last_inference"] > 0


def test_unloading_a_composing_model_unloads_its_ensembles(server: RunningServer) -> None:
    assert _post(server, "/v2/repository/models/add_sub_unload/unload")[0] == 200
    index = _index(server)
    assert (index["chain_unload"]["state"], index["chain_unload"]["reason"]) == ("UNAVAILABLE", "unloaded")
    assert index["add_sub_unload"]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException) as caught:
        _http_chain(server, "chain_unload", A, B)
    assert caught.value.status() == "404"
    assert caught.value.message() == "Request for unknown model: 'chain_unload' has no available versions"
    # Loading the composing model again brings its ensemble back, as in Triton.
    assert _post(server, "/v2/repository/models/add_sub_unload/load")[0] == 200
    assert _index(server)["chain_unload"]["state"] == "READY"
    np.testing.assert_array_equal(_http_chain(server, "chain_unload", A, B).as_numpy("SUM"), 2 * A)
    # Loading an ensemble loads its composing models first.
    assert _post(server, "/v2/repository/models/chain_unload/unload")[0] == 200
    assert _post(server, "/v2/repository/models/add_sub_unload/unload")[0] == 200
    assert _index(server)["add_sub_unload"]["state"] == "UNAVAILABLE"
    assert _post(server, "/v2/repository/models/chain_unload/load")[0] == 200
    index = _index(server)
    assert index["add_sub_unload"]["state"] == index["chain_unload"]["state"] == "READY"
    np.testing.assert_array_equal(_http_chain(server, "chain_unload", A, B).as_numpy("DIFF"), 2 * B)


BAD = {
    "bad_cycle": "ensemble 'bad_cycle' has a cycle: step 0 (add_sub) -> step 1 (add_sub) -> step 0 (add_sub) "
                 "(each needs an output of the next)",
    "bad_unknown": "ensemble bad_unknown contains models that are not available or ambiguous: no_such_model",
    "bad_unmapped": "in ensemble 'bad_unmapped', step 0 (model 'add_sub') reads ensemble tensor 'nowhere', which is "
                    "neither an ensemble input nor an output of any step",
    "bad_input_name": "in ensemble bad_input_name, ensemble tensor B is mapping to non-existing input INPUTX in "
                      "model add_sub",
}


def test_bad_ensembles_are_unavailable_with_reasons(server: RunningServer) -> None:
    index = _index(server)
    for name in ("loop_a", "loop_b"):  # which of the two finds the cycle depends on which loads first
        assert index[name]["state"] == "UNAVAILABLE"
        assert "circular dependency between ensembles: loop_" in index[name]["reason"]
    status, body = _post(server, "/v2/repository/models/loop_a/load")  # refused, not deadlocked
    assert status == 400 and "circular dependency between ensembles: loop_" in body["error"]
    assert {name: (index[name]["state"], index[name]["reason"]) for name in BAD} == {
        name: ("UNAVAILABLE", reason) for name, reason in BAD.items()
    }
    status, body = _post(server, "/v2/repository/models/bad_unknown/load")
    assert status == 400 and body == {"error": f"load failed for model 'bad_unknown': {BAD['bad_unknown']}"}
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:
        _http_chain(server, "bad_cycle", A, B)
    assert caught.value.status() == "404" and time.monotonic() - started < 5
    assert _get(server, "/v2/models/chain/stats")["model_stats"][0]["name"] == "chain"  # all is well


def test_an_intermediate_tensor_is_released_after_its_last_reader(server: RunningServer) -> None:
    """Triton frees an ensemble tensor once every step reading it is done; so does geserve: by the time the third
    step runs, the 16 MB tensor the first step made (and only the second read) is gone."""
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.array([0.5], np.float32))
    with httpclient.InferenceServerClient(server.url) as client:
        result = client.infer("watch", [x])
    assert result.as_numpy("TOTAL")[0] == 2_000_000
    assert result.as_numpy("FREED")[0] == 1.0
