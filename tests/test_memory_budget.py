"""Load on demand and the memory budget's rules that need no exact charge, in one process without frontends: real ONNX
Runtime and Python models, the real model manager and its decider (repository/budget.py). Eviction, pinning and the
charges themselves are tested against server processes (tests/test_memory_budget_server.py): a process measures its
loads exactly only with one malloc arena from its start (repository/memory.py), which a test process does not have."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from geserve import GeserveError, InferenceRequest, InputTensor, Server, ServerSettings
from geserve.errors import DeadlineExceededError
from geserve.repository.budget import parse_size
from geserve.server import StartupError
from tests.support import budget_models, ensembles
from tests.support.budget_models import PYTHON_CONFIG, WIDTH

HIDDEN = 512
SLOW_INIT = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(0.4)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("budget") / "models"
    root.mkdir()
    (root / "slow_start" / "1").mkdir(parents=True)
    (root / "slow_start" / "config.pbtxt").write_text(PYTHON_CONFIG)
    (root / "slow_start" / "1" / "model.py").write_text(SLOW_INIT)
    ensembles.add_sub(root, "add_sub")
    ensembles.chain("chain", "add_sub").write(root)
    return root


def _run(test: Callable[[Server], Awaitable[None]], repo: Path, **settings: object) -> None:
    async def run() -> None:
        options = {"model_control_mode": "explicit", "load_on_demand": True, **settings}
        server = Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False, **options))  # type: ignore[arg-type]
        await server.start()
        try:
            await test(server)
        finally:
            await server.stop()

    asyncio.run(run())


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, WIDTH)).astype(np.float32)


async def _mlp(server: Server, name: str) -> None:
    """One request to MLP `m<seed>`, its answer checked against numpy."""
    seed = int(name[1:])
    x = _x(seed)
    response = await server.service.infer(InferenceRequest(name, "", [InputTensor("IN", "FP32", x.shape, x)]))
    np.testing.assert_allclose(response.outputs[0].data, budget_models.expected(seed, HIDDEN, x), rtol=1e-4,
                               atol=1e-4)


def _python(server: Server, name: str, value: float, deadline: float | None = None) -> Awaitable[object]:
    x = np.full((1, 1), value, np.float32)
    request = InferenceRequest(name, "", [InputTensor("IN", "FP32", x.shape, x)], deadline=deadline)
    return server.service.infer(request)


def _serving(server: Server) -> set[str]:
    return {model.name for model in server.manager.models()}


def test_sizes() -> None:
    assert parse_size("800MiB") == 800 << 20
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5G") == 3 << 29
    assert parse_size("500MB") == 500_000_000
    assert parse_size("1048576") == 1 << 20
    for bad in ("", "lots", "12 parsecs", "-1GiB"):
        with pytest.raises(ValueError, match="expected a size"):
            parse_size(bad)


@pytest.mark.parametrize("settings", [
    {"model_control_mode": "none", "load_on_demand": True},
    {"model_control_mode": "none", "model_memory_budget": "1GiB"},
    {"model_control_mode": "explicit", "model_memory_budget": "a lot"},
])
def test_settings_it_cannot_start_with(repo: Path, settings: dict[str, object]) -> None:
    with pytest.raises(StartupError, match=r"model-memory-budget|load-on-demand"):
        Server(ServerSettings(model_repositories=[repo], allow_http=False, allow_grpc=False, allow_metrics=False,
                              **settings))  # type: ignore[arg-type]


def test_a_request_loads_its_model_once_for_every_request_waiting(repo: Path) -> None:
    async def test(server: Server) -> None:
        assert "slow_start" not in _serving(server)
        started = time.monotonic()
        answers = await asyncio.gather(*(_python(server, "slow_start", float(i)) for i in range(6)))
        assert [float(a.outputs[0].data[0, 0]) for a in answers] == [2.0 * i for i in range(6)]  # type: ignore[attr-defined]
        assert time.monotonic() - started >= 0.4
        assert server.loads is not None
        assert server.loads.snapshot().on_demand == {"slow_start": 1}
        # The wait for the load is each request's queue time.
        stats = (await server.service.statistics("slow_start"))["model_stats"][0]["inference_stats"]
        assert stats["queue"]["count"] == 6 and stats["queue"]["ns"] / 6 >= 0.35e9
        # A known model that is not loaded, or one no repository has, is refused as before.
        with pytest.raises(GeserveError, match="unknown model"):
            await _python(server, "nowhere", 1.0)

    _run(test, repo)


def test_a_request_waits_for_the_load_no_longer_than_its_deadline(repo: Path) -> None:
    async def test(server: Server) -> None:
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await _python(server, "slow_start", 1.0, deadline=time.monotonic() + 0.1)
        assert time.monotonic() - started < 0.35
        answer = await _python(server, "slow_start", 3.0)  # the load went on: this one waits for it
        assert float(answer.outputs[0].data[0, 0]) == 6.0  # type: ignore[attr-defined]
        assert server.loads is not None and server.loads.snapshot().on_demand == {"slow_start": 1}

    _run(test, repo)


def test_an_ensemble_loads_its_steps_on_demand(repo: Path) -> None:
    async def test(server: Server) -> None:
        assert not _serving(server) & {"chain", "add_sub"}
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.full((1, 16), 3, np.int32)
        response = await server.service.infer(InferenceRequest(
            "chain", "", [InputTensor("A", "INT32", a.shape, a), InputTensor("B", "INT32", b.shape, b)]
        ))
        outputs = {o.name: o.data for o in response.outputs}
        np.testing.assert_array_equal(outputs["SUM"], 2 * a)
        np.testing.assert_array_equal(outputs["DIFF"], 2 * b)
        assert {"chain", "add_sub"} <= _serving(server)

    _run(test, repo, model_memory_budget="1GiB")


def test_poll_mode_loads_on_demand_and_reloads_only_what_serves(repo: Path, tmp_path: Path) -> None:
    own = tmp_path / "models"
    for i in range(2):
        budget_models.mlp(own, f"m{i}", i, HIDDEN)

    async def test(server: Server) -> None:
        assert not _serving(server)  # nothing at start
        await _mlp(server, "m0")
        assert server.poller is not None
        config = own / "m1" / "config.pbtxt"  # m1 changes but does not serve: it is left for a request
        config.write_text(config.read_text() + "\n# changed\n")
        config = own / "m0" / "config.pbtxt"
        config.write_text(config.read_text() + "\n# changed\n")
        changes = await server.poller.poll()
        assert set(changes.modified) == {"m0", "m1"} and not changes.failed
        assert _serving(server) == {"m0"}
        await _mlp(server, "m1")

    _run(test, own, model_control_mode="poll", repository_poll_secs=0, model_memory_budget="1GiB")
