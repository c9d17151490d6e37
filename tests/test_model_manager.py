"""The model manager in-process, without a server: ensembles load after their composing models, loads under way
are shared, cycles and missing or failed composing models are named, and unloads and reloads follow the graph."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import cast

import pytest
from google.protobuf import json_format

from geserve.backends.base import InferenceHost
from geserve.backends.registry import BackendRegistry
from geserve.config import ModelConfig, parse_config_text
from geserve.errors import GeserveError
from geserve.repository.builder import ModelBuilder, PreparedModel
from geserve.repository.lifecycle import LifecycleOptions, ModelManager
from geserve.repository.model import LoadedModel
from geserve.repository.store import ModelStore
from tests.support import ensembles
from tests.support.ensembles import AB, INT16, Ensemble, Step

OUTPUTS = [("SUM", *INT16), ("DIFF", *INT16)]


def _on(name: str, model: str, version: int = -1) -> Ensemble:
    """An ensemble with one step: `model`, which maps A, B to SUM, DIFF (as add_sub and its chains do)."""
    return Ensemble(name, AB, OUTPUTS, [Step(model, {"A": "A", "B": "B"}, {"SUM": "SUM", "DIFF": "DIFF"}, version)])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manager") / "models"
    root.mkdir()
    ensembles.add_sub(root, "add_sub")
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text('name: "broken"\nbackend: "onnxruntime"\nno_such_field: 1\n')
    for ensemble in (
        ensembles.chain("chain", "add_sub"),
        _on("nested", "chain", version=1),
        _on("loop_a", "loop_b"),
        _on("loop_b", "loop_a"),
        _on("on_loop", "loop_a"),
        _on("on_missing", "no_such_model"),
        ensembles.chain("on_broken", "broken"),
    ):
        ensemble.write(root)
    return root


class _Builds:
    """Every version the builder builds, by model name, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        build = ModelBuilder.build

        async def counted(
            builder: ModelBuilder, prepared: PreparedModel, version: int, steps: Mapping[str, ModelConfig]
        ) -> LoadedModel:
            self.names.append(prepared.config.name)
            return await build(builder, prepared, version, steps)

        monkeypatch.setattr(ModelBuilder, "build", counted)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> _Builds:
    return _Builds(monkeypatch)


def _run(repo: Path, body: Callable[[ModelManager], Awaitable[None]]) -> None:
    async def run() -> None:
        registry = BackendRegistry({})
        registry.attach_host(cast(InferenceHost, object()))  # ensembles only call it when they run
        manager = ModelManager(ModelStore([repo]), registry, LifecycleOptions())
        try:
            await body(manager)
        finally:
            await manager.shutdown()

    asyncio.run(run())


def _states(manager: ModelManager) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e.get("state", ""), e.get("reason", "")) for e in manager.index()}


def _state(manager: ModelManager, name: str) -> str:
    return _states(manager)[name][0]


def test_an_ensemble_loads_its_composing_models_first(repo: Path, builds: _Builds) -> None:
    async def body(manager: ModelManager) -> None:
        await manager.load("nested")
        assert [_state(manager, n) for n in ("add_sub", "chain", "nested")] == ["READY"] * 3
        assert _states(manager)["loop_a"] == ("", "")  # what nothing needs is left alone

    _run(repo, body)
    assert builds.names == ["add_sub", "chain", "nested"]


def test_concurrent_loads_wait_for_each_other_instead_of_loading_twice(repo: Path, builds: _Builds) -> None:
    async def body(manager: ModelManager) -> None:
        await asyncio.gather(manager.load("nested"), manager.load("chain"), manager.load("add_sub"))
        assert [_state(manager, n) for n in ("add_sub", "chain", "nested")] == ["READY"] * 3

    _run(repo, body)
    assert sorted(builds.names) == ["add_sub", "chain", "nested"]


def test_reloading_a_composing_model_reloads_the_ensembles_on_it(repo: Path, builds: _Builds) -> None:
    async def body(manager: ModelManager) -> None:
        await manager.load("nested")
        builds.names.clear()
        await manager.load("add_sub")
        assert [_state(manager, n) for n in ("add_sub", "chain", "nested")] == ["READY"] * 3

    _run(repo, body)
    assert builds.names == ["add_sub", "chain", "nested"]


def test_unloading_a_composing_model_unloads_its_ensembles_until_it_returns(repo: Path, builds: _Builds) -> None:
    async def body(manager: ModelManager) -> None:
        await manager.load("nested")
        await manager.unload("add_sub")
        states = _states(manager)
        assert {n: states[n] for n in ("add_sub", "chain", "nested")} == {
            n: ("UNAVAILABLE", "unloaded") for n in ("add_sub", "chain", "nested")
        }
        await manager.load("add_sub")
        assert [_state(manager, n) for n in ("add_sub", "chain", "nested")] == ["READY"] * 3
        # An ensemble unloaded on purpose stays down when its composing model comes back.
        await manager.unload("nested")
        await manager.load("add_sub")
        assert (_state(manager, "chain"), _state(manager, "nested")) == ("READY", "UNAVAILABLE")

    _run(repo, body)


def test_a_failed_reload_leaves_the_serving_versions_and_their_ensembles(repo: Path) -> None:
    async def body(manager: ModelManager) -> None:
        await manager.load("chain")
        serving = manager.get("add_sub")
        with pytest.raises(GeserveError, match=r"^load failed for model 'add_sub': failed to parse the 'config'"):
            await manager.load("add_sub", "{not json")
        assert manager.get("add_sub") is serving
        assert (_state(manager, "add_sub"), _state(manager, "chain")) == ("READY", "READY")

    _run(repo, body)


def test_a_failed_ensemble_reload_keeps_the_composing_models_that_serve(repo: Path) -> None:
    async def body(manager: ModelManager) -> None:
        await manager.load("chain")
        other = json_format.MessageToJson(parse_config_text(_on("chain", "no_such_model").config(), "test"))
        with pytest.raises(GeserveError, match="contains models that are not available or ambiguous: no_such_model"):
            await manager.load("chain", other)
        assert _state(manager, "chain") == "READY"
        # The graph still has the serving chain on add_sub: it goes down with it.
        await manager.unload("add_sub")
        assert _states(manager)["chain"] == ("UNAVAILABLE", "unloaded")

    _run(repo, body)


def test_cycles_are_refused_naming_them(repo: Path) -> None:
    async def body(manager: ModelManager) -> None:
        results = await asyncio.gather(manager.load("loop_a"), manager.load("loop_b"), return_exceptions=True)
        assert all(isinstance(r, GeserveError) for r in results)
        states = _states(manager)
        for name in ("loop_a", "loop_b"):  # which of the two finds the cycle depends on which plans last
            assert states[name][0] == "UNAVAILABLE"
            assert "circular dependency between ensembles: loop_" in states[name][1]
        with pytest.raises(GeserveError) as caught:
            await manager.load("loop_a")
        assert caught.value.message == (
            "load failed for model 'loop_a': circular dependency between ensembles: loop_a -> loop_b -> loop_a"
        )

    _run(repo, body)


def test_an_ensemble_on_a_cycle_names_the_model_that_failed(repo: Path) -> None:
    async def body(manager: ModelManager) -> None:
        with pytest.raises(GeserveError):
            await manager.load("on_loop")
        states = _states(manager)
        cycle = "circular dependency between ensembles: loop_a -> loop_b -> loop_a"
        assert states["loop_a"] == ("UNAVAILABLE", cycle)
        assert states["on_loop"] == (
            "UNAVAILABLE",
            f"ensemble 'on_loop' depends on 'loop_a' which is not valid. Model 'loop_a' failed with error: {cycle}",
        )

    _run(repo, body)


def test_missing_and_failed_composing_models_are_named(repo: Path) -> None:
    async def body(manager: ModelManager) -> None:
        missing = "ensemble on_missing contains models that are not available or ambiguous: no_such_model"
        with pytest.raises(GeserveError) as caught:
            await manager.load("on_missing")
        assert caught.value.message == f"load failed for model 'on_missing': {missing}"
        with pytest.raises(GeserveError):
            await manager.load("on_broken")
        states = _states(manager)
        assert states["on_missing"] == ("UNAVAILABLE", missing)
        broken = states["broken"]
        assert broken[0] == "UNAVAILABLE" and "no_such_field" in broken[1]
        assert states["on_broken"] == (
            "UNAVAILABLE",
            f"ensemble 'on_broken' depends on 'broken' which is not valid. Model 'broken' failed with error: "
            f"{broken[1]}",
        )

    _run(repo, body)


def test_an_unknown_model_fails_before_anything_is_recorded(repo: Path) -> None:
    async def body(manager: ModelManager) -> None:
        with pytest.raises(GeserveError, match="failed to load 'nope', failed to poll from model repository"):
            await manager.load("nope")
        assert manager.record("nope") is None
        await manager.unload("nope")  # as in Triton, unloading what is not loaded succeeds

    _run(repo, body)
