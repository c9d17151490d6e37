"""The memory budget and load on demand on real server processes, with the real clients: charges in the index, the
statistics and the metrics; least recently used eviction; pinned models; the refusal when nothing can make room
(HTTP 503, gRPC UNAVAILABLE); memory that comes back on unload; and many more models than memory under concurrent
Zipf-like traffic, with the process tree's memory sampled throughout.

A budget is set in model-sized slots: `calibration` measures once what an MLP costs on this machine (and the first
model, which also pays for the runtime's first session)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.support import budget_models, models
from tests.support.budget_models import PINNED, PYTHON_CONFIG, WIDTH, expected, samples, tree_pss
from tests.support.server import RunningServer, geserve
from tests.test_workers import kill_a_worker

HIDDEN = 4096  # 4 MiB of weights per MLP
MODELS = 30  # the load test's: MLPs m0..m29, m0 pinned
CLIENTS = 8
DURATION_S = 45.0  # of Zipf-ordered requests, after one request to every model
MARGIN = 1.15  # the process tree's PSS stays under (budget + base) x MARGIN


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("budget_server") / "models"
    root.mkdir()
    budget_models.mlp(root, "m0", 0, HIDDEN, PINNED)
    for i in range(1, MODELS):
        budget_models.mlp(root, f"m{i}", i, HIDDEN)
    models.slow_python(root, "slow", PYTHON_CONFIG)
    return root


@dataclass(frozen=True)
class Calibration:
    first: int  # m0, the first model loaded: with the runtime's first session in each worker
    size: int  # any other MLP


def _server(repo: Path, log: Path, budget: int | str, workers: int = 2) -> AbstractContextManager[RunningServer]:
    return geserve([repo], log, ["--model-control-mode", "explicit", "--load-on-demand", "--model-memory-budget",
                                 str(budget), "--workers", str(workers)])


def _ready(server: RunningServer) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(server.base + "/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    # The workers' last start-up step (a collection, then gc.freeze) runs as they begin to serve: a
                    # load measured meanwhile would see the memory it frees.
                    time.sleep(1.0)
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"not ready:\n{server.log()[-3000:]}")


def _metrics(server: RunningServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
        return answer.read().decode()


def _charges(server: RunningServer) -> dict[str, int]:
    found = samples(_metrics(server), "ge_model_memory_bytes")
    return {key.split('"')[1]: int(value) for key, value in found.items()}


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((1, WIDTH)).astype(np.float32)


def _infer(client: httpclient.InferenceServerClient, seed: int, name: str = "") -> None:
    x = _x(seed)
    tensor = httpclient.InferInput("IN", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    answer = client.infer(name or f"m{seed}", [tensor]).as_numpy("OUT")
    np.testing.assert_allclose(answer, expected(seed, HIDDEN, x), rtol=1e-4, atol=1e-4)


def _serving(client: httpclient.InferenceServerClient) -> set[str]:
    return {e["name"] for e in client.get_model_repository_index() if e.get("state") == "READY"}


@pytest.fixture(scope="module")
def calibration(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Calibration:
    """What the first MLP and any later one cost a server of two workers (as every server here has)."""
    with _server(repo, tmp_path_factory.mktemp("logs") / "calibration.log", "1GiB") as server:
        _ready(server)
        client = httpclient.InferenceServerClient(server.url)
        for seed in range(6):
            _infer(client, seed)
        charges = _charges(server)
    sizes = sorted(charges[f"m{i}"] for i in range(1, 6))
    assert sizes[-1] - sizes[0] < 0.15 * sizes[-1], charges  # measured alike
    assert charges["m0"] >= sizes[-1]
    return Calibration(charges["m0"], sizes[2])


def test_the_least_recently_used_idle_model_makes_room(repo: Path, calibration: Calibration, tmp_path: Path) -> None:
    budget = calibration.first + int(3.5 * calibration.size)  # m0 and three more
    with _server(repo, tmp_path / "geserve.log", budget) as server:
        _ready(server)
        client = httpclient.InferenceServerClient(server.url)
        assert not _serving(client)  # explicit mode, no --load-model: nothing until requested
        for seed in (0, 1, 2, 3, 1, 4):  # 1 used again: 2 is the least recently used idle model when 4 comes
            _infer(client, seed)
        assert _serving(client) == {"m0", "m1", "m3", "m4"}
        index = {e["name"]: e for e in client.get_model_repository_index() if e.get("state") == "READY"}
        charges = _charges(server)
        assert {name: entry["memory"] for name, entry in index.items()} == charges
        assert sum(charges.values()) <= budget
        stats = client.get_inference_statistics("m4")["model_stats"][0]
        assert stats["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": charges["m4"]}]
        # The wait for the load is the request's queue time.
        assert stats["inference_stats"]["queue"]["ns"] >= 1_000_000
        text = _metrics(server)
        assert samples(text, "ge_memory_budget_bytes") == {"": budget}
        assert samples(text, "ge_model_evictions_total") == {'model="m2"': 1}
        assert samples(text, "ge_model_load_on_demand_total")['model="m1"'] == 1
        loads = samples(text, "ge_model_load_duration_seconds_count")
        assert loads == {'trigger="on_demand"': 5}
        assert "evicting model 'm2'" in server.log()
        # A worker that dies comes back with the server's models as they are now (m2 evicted), and their charges.
        kill_a_worker(server)
        for _ in range(4):  # new connections: the supervisor spreads them over both workers
            fresh = httpclient.InferenceServerClient(server.url)
            entries = [e for e in fresh.get_model_repository_index() if e.get("state") == "READY"]
            assert {e["name"]: e["memory"] for e in entries} == charges
            fresh.close()


def _grpc_load(server: RunningServer, name: str, pinned: bool) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(pb.RepositoryModelLoadRequest(
            model_name=name, parameters={"pinned": pb.ModelRepositoryParameter(bool_param=pinned)}
        ))


def test_pinned_models_stay_and_what_cannot_fit_is_refused(
    repo: Path, calibration: Calibration, tmp_path: Path
) -> None:
    budget = calibration.first + int(2.5 * calibration.size)
    with _server(repo, tmp_path / "geserve.log", budget) as server:
        _ready(server)
        client = httpclient.InferenceServerClient(server.url)
        _infer(client, 0)  # pinned by its config
        _grpc_load(server, "m1", pinned=True)  # pinned by its load request, over gRPC
        body = json.dumps({"parameters": {"pinned": True}}).encode()  # and over HTTP
        urllib.request.urlopen(urllib.request.Request(server.base + "/v2/repository/models/m2/load", body))
        assert _serving(client) == {"m0", "m1", "m2"}
        held = sum(_charges(server).values())
        words = f"; {held} of the budget ({budget} bytes) is held by models in use"
        request = urllib.request.Request(
            server.base + "/v2/models/m3/infer",
            json.dumps({"inputs": [{"name": "IN", "shape": [1, WIDTH], "datatype": "FP32",
                                    "data": _x(3).ravel().tolist()}]}).encode(),
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
        assert refused.value.code == 503
        error = json.loads(refused.value.read())["error"]
        assert error.startswith("model 'm3' needs ") and error.endswith(words)
        x = _x(3)
        tensor = grpcclient.InferInput("IN", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as unavailable:
            grpcclient.InferenceServerClient(server.grpc_url).infer("m3", [tensor])
        assert unavailable.value.status() == "StatusCode.UNAVAILABLE"
        assert unavailable.value.message().endswith(words)
        assert _serving(client) == {"m0", "m1", "m2"}  # nothing unloaded for a load that could not fit
        client.unload_model("m2")  # unloaded on purpose: pinned no more, and its room is free
        _infer(client, 3)
        _infer(client, 4)  # m3 was not pinned: it makes room
        assert _serving(client) == {"m0", "m1", "m4"}
        assert samples(_metrics(server), "ge_model_evictions_total") == {'model="m3"': 1}


def test_memory_comes_back_after_unloads(tmp_path: Path) -> None:
    """Load and unload an MLP, MiniLM (90 MiB of weights) and a Python model holding 32 MiB of its own, five times
    over two workers: the process tree's memory returns to where it was each time."""
    root = tmp_path / "models"
    budget_models.mlp(root, "mlp", 7, HIDDEN)
    minilm = models.example_onnx("minilm").parents[1]
    (root / "minilm" / "1").mkdir(parents=True)
    (root / "minilm" / "1" / "model.onnx").symlink_to(minilm / "1" / "model.onnx")
    (root / "minilm" / "config.pbtxt").write_text((minilm / "config.pbtxt").read_text())
    (root / "holder" / "1").mkdir(parents=True)
    (root / "holder" / "config.pbtxt").write_text(PYTHON_CONFIG)
    (root / "holder" / "1" / "model.py").write_text(HOLDER_MODEL)
    names = ("mlp", "minilm", "holder")
    with _server(root, tmp_path / "geserve.log", "4GiB") as server:
        _ready(server)
        client = httpclient.InferenceServerClient(server.url)

        def cycle() -> tuple[int, int]:
            for name in names:
                client.load_model(name)
            _infer(client, 7, "mlp")
            ids = np.random.default_rng(0).integers(0, 30522, (8, 128)).astype(np.int64)  # most embedding rows
            tensors = [httpclient.InferInput(n, [8, 128], "INT64") for n in ("input_ids", "attention_mask")]
            tensors[0].set_data_from_numpy(ids)
            tensors[1].set_data_from_numpy(np.ones_like(ids))
            client.infer("minilm", tensors)
            loaded = tree_pss(server.process.pid)
            for name in names:
                client.unload_model(name)
            time.sleep(0.5)  # the workers' unloads end as the calls answer; their last frees settle
            return loaded, tree_pss(server.process.pid)

        cycle()  # the first loads also start the runtime in each worker, for good
        base = tree_pss(server.process.pid)
        for _ in range(5):
            loaded, after = cycle()
            assert loaded - base > 150 << 20, (loaded, base)  # MiniLM's weights once, the Python model's twice
            assert after - base < 12 << 20, f"{(after - base) / 2**20:.1f} MiB stayed after unloading"


HOLDER_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.table = np.ones(32 << 18, dtype=np.float32)  # 32 MiB, and a cycle that only the collector frees
        self.me = self

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
'''


class _SlowRequest:
    """One request to the slow model that executes for `seconds`, on a thread."""

    def __init__(self, server: RunningServer, seconds: float) -> None:
        self.seconds = seconds
        self.answer: np.ndarray | None = None
        self._url = server.url
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        tensor = httpclient.InferInput("IN", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.full((1, 1), self.seconds, np.float32))
        client = httpclient.InferenceServerClient(self._url, network_timeout=self.seconds + 60)
        self.answer = client.infer("slow", [tensor]).as_numpy("OUT")


class _ZipfClients:
    """CLIENTS threads, each sending one request to every model it is given, then Zipf(1.1)-ordered requests until
    `stop_at`: answers checked, counted, and the first error of each kept."""

    def __init__(self, server: RunningServer, stop_at: float) -> None:
        self.answered = [0] * CLIENTS
        self.errors: list[BaseException] = []
        self._url, self._stop_at = server.url, stop_at
        self._order = np.random.default_rng(34).permutation(MODELS)  # rank -> model; m0 (pinned) among them
        self._popularity = budget_models.zipf(MODELS, 1.1)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        rng = np.random.default_rng(index)
        client = httpclient.InferenceServerClient(self._url, network_timeout=60)
        try:
            for seed in range(index, MODELS, CLIENTS):  # every model once, so that every one is charged
                _infer(client, seed)
                self.answered[index] += 1
            while time.monotonic() < self._stop_at:
                _infer(client, int(self._order[rng.choice(MODELS, p=self._popularity)]))
                self.answered[index] += 1
        except BaseException as exc:  # reported by the test, with the server's log
            self.errors.append(exc)

    def running(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)


def test_thirty_models_three_times_the_budget_under_zipf_traffic(
    repo: Path, calibration: Calibration, tmp_path: Path
) -> None:
    """8 clients for about a minute, requests in Zipf(1.1) order over 30 MLPs whose charges add up to three times the
    budget: every answer correct; the process tree's PSS never above (budget + the server's own base) x 1.15; the
    pinned model never evicted; the slow model, executing one request throughout, never evicted."""
    budget = (calibration.first + (MODELS - 1) * calibration.size) // 3
    with _server(repo, tmp_path / "geserve.log", budget) as server:
        _ready(server)
        base = tree_pss(server.process.pid)  # the server with no model loaded
        sampler = budget_models.PeakPss(server.process.pid)
        slow = _SlowRequest(server, DURATION_S + 12)  # loaded first, least recently used: the first victim if idle
        time.sleep(1.0)
        clients = _ZipfClients(server, time.monotonic() + DURATION_S)
        charged: dict[str, int] = {}  # each model's largest charge seen
        while clients.running():
            for name, size in _charges(server).items():
                charged[name] = max(size, charged.get(name, 0))
            time.sleep(1.0)
        evictions = samples(_metrics(server), "ge_model_evictions_total")
        assert slow.thread.is_alive()  # still executing when the clients were done
        slow.thread.join(DURATION_S + 60)
        peak = sampler.stop()
        assert not clients.errors, f"{clients.errors[:3]}\n{server.log()[-3000:]}"
    assert slow.answer is not None and float(slow.answer[0, 0]) == 2 * slow.seconds
    assert 'model="slow"' not in evictions and 'model="m0"' not in evictions
    assert sum(evictions.values()) > MODELS  # the models really took turns
    charged.pop("slow", None)
    ratio = sum(charged.values()) / budget
    assert len(charged) == MODELS and 2.7 < ratio < 3.3, (ratio, len(charged), budget)
    limit = (budget + base) * MARGIN
    print(f"\n{sum(clients.answered)} answers; {int(sum(evictions.values()))} evictions; budget "
          f"{budget / 2**20:.1f} MiB, base {base / 2**20:.1f} MiB, peak PSS {peak / 2**20:.1f} MiB "
          f"(limit {limit / 2**20:.1f})")
    assert peak <= limit
