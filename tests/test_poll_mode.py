"""Poll mode: the store's fingerprints see what changed on disk; the poller has the manager follow (new models and
versions load, removed ones unload, a changed config or model file reloads, a failed reload keeps the old version
serving and says why); and on a real server the load / unload API is refused and a reload under traffic fails no
request."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from geserve.backends.base import InferenceHost
from geserve.backends.registry import BackendRegistry
from geserve.repository.lifecycle import LifecycleOptions, ModelManager
from geserve.repository.poller import RepositoryPoller
from geserve.repository.store import ModelStore, fingerprint
from tests.support import ensembles, models
from tests.support.server import RunningServer, geserve

POLL = ["--model-control-mode=poll", "--repository-poll-secs=0.2"]


# ---- what the store sees -------------------------------------------------------------------------------------


def test_a_fingerprint_changes_with_every_file_that_matters(tmp_path: Path) -> None:
    model = models.simple(tmp_path, "m")
    first = fingerprint(model)
    assert fingerprint(model) == first

    # A config rewritten within the file system's mtime granularity, same size: the text still tells.
    config = model / "config.pbtxt"
    stat = config.stat()
    config.write_text(config.read_text().replace("count: 1", "count: 2"))
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(model) != first

    before = fingerprint(model)
    (model / "labels.txt").write_text("a\nb\n")  # a file beside the versions (labels, warmup data)
    assert fingerprint(model) != before
    before = fingerprint(model)
    (model / "2").mkdir()
    shutil.copy(model / "1" / "model.onnx", model / "2" / "model.onnx")
    assert fingerprint(model) != before
    before = fingerprint(model)
    shutil.rmtree(model / "2")
    assert fingerprint(model) != before


def test_a_fingerprint_ignores_what_changes_without_the_model(tmp_path: Path) -> None:
    model = models.simple(tmp_path, "m")
    first = fingerprint(model)
    (model / "1" / "__pycache__").mkdir()
    (model / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"compiled")  # a Python model's own load
    (model / ".config.pbtxt.swp").write_bytes(b"editor")
    (model / "config.pbtxt~").write_bytes(b"backup")
    assert fingerprint(model) == first


# ---- what the poller makes of it -----------------------------------------------------------------------------


def _run(repos: list[Path], body: Callable[[ModelManager, RepositoryPoller], Awaitable[None]]) -> None:
    """`body` on a manager that loaded every model of `repos`, with a poller that scans only when told to."""

    async def run() -> None:
        registry = BackendRegistry({})
        registry.attach_host(cast(InferenceHost, object()))
        store = ModelStore(repos)
        manager = ModelManager(store, registry, LifecycleOptions())
        poller = RepositoryPoller(store, manager, 0)
        await poller.snapshot()
        for name in store.scan():
            await manager.load(name)
        try:
            await body(manager, poller)
        finally:
            await manager.shutdown()

    asyncio.run(run())


def _index(manager: ModelManager) -> dict[tuple[str, str], tuple[str, str]]:
    return {(e["name"], e.get("version", "")): (e.get("state", ""), e.get("reason", "")) for e in manager.index()}


def test_the_poller_loads_reloads_and_unloads_what_changed(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo)

    async def body(manager: ModelManager, poller: RepositoryPoller) -> None:
        assert not await poller.poll()  # nothing changed: nothing to do
        original = manager.get("simple")

        models.simple(repo, "added")
        changes = await poller.poll()
        assert (changes.added, changes.modified, changes.removed) == (("added",), (), ())
        assert manager.is_ready("added") and manager.get("simple") is original  # the others are left alone

        # A new version: the latest policy serves it instead of version 1.
        shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")
        assert (await poller.poll()).modified == ("simple",)
        assert _index(manager)[("simple", "2")] == ("READY", "")
        assert _index(manager)[("simple", "1")] == ("UNAVAILABLE", "unloaded")

        # A changed config reloads.
        config = repo / "simple" / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
        await poller.poll()
        assert manager.get("simple").max_batch_size == 4

        # A broken config: the version loaded before keeps serving, and the index says why.
        good = config.read_text()
        serving = manager.get("simple")
        config.write_text(good + "\nno_such_field: 1\n")
        changes = await poller.poll()
        assert "no_such_field" in changes.failed["simple"]
        assert manager.get("simple") is serving
        state, reason = _index(manager)[("simple", "2")]
        assert state == "READY" and reason.startswith("reload failed, the version loaded before keeps serving: ")
        assert "no_such_field" in reason
        assert not await poller.poll()  # a failure is tried again when the folder changes, not every scan

        # A broken model file: the same, for a failure of the version itself.
        config.write_text(good)
        await poller.poll()
        assert _index(manager)[("simple", "2")] == ("READY", "")
        serving = manager.get("simple")
        (repo / "simple" / "2" / "model.onnx").write_bytes(b"not an onnx file")
        await poller.poll()
        assert manager.get("simple") is serving
        assert _index(manager)[("simple", "2")][1].startswith("reload failed, the version loaded before keeps serving")

        # A removed version goes, even though its reload failed; version 1 serves again.
        shutil.rmtree(repo / "simple" / "2")
        await poller.poll()
        assert _index(manager)[("simple", "1")] == ("READY", "")
        assert _index(manager)[("simple", "2")] == ("UNAVAILABLE", "unloaded")
        assert manager.get("simple").version == 1

        # A removed model unloads, and strict readiness no longer waits for it (as in Triton).
        shutil.rmtree(repo / "added")
        assert (await poller.poll()).removed == ("added",)
        assert not manager.is_ready("added")
        assert _index(manager)[("added", "1")] == ("UNAVAILABLE", "unloaded")
        assert manager.all_ready()

    _run([repo], body)


def test_ensembles_follow_their_composing_models_in_and_out(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    ensembles.add_sub(repo, "add_sub")
    ensembles.chain("chain", "add_sub").write(repo)

    async def body(manager: ModelManager, poller: RepositoryPoller) -> None:
        assert manager.is_ready("chain")
        shutil.move(repo / "add_sub", tmp_path / "add_sub")
        await poller.poll()
        assert not manager.is_ready("add_sub") and not manager.is_ready("chain")
        assert manager.all_ready()  # both unloaded: nothing is waited for
        shutil.move(tmp_path / "add_sub", repo / "add_sub")
        assert (await poller.poll()).added == ("add_sub",)
        assert manager.is_ready("add_sub") and manager.is_ready("chain")  # the ensemble comes back with it

        # A changed ensemble reloads alone: its composing model serves on untouched.
        serving = manager.get("add_sub")
        config = repo / "chain" / "config.pbtxt"
        config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
        assert (await poller.poll()).modified == ("chain",)
        assert manager.get("chain").max_batch_size == 4 and manager.get("add_sub") is serving

    _run([repo], body)


def test_a_repository_that_cannot_be_read_changes_nothing(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    models.simple(first)

    async def body(manager: ModelManager, poller: RepositoryPoller) -> None:
        serving = manager.get("simple")
        models.simple(second)  # the same name in two repositories: Triton refuses the poll
        assert not await poller.poll()
        assert manager.get("simple") is serving

    _run([first, second], body)


# ---- on a real server ----------------------------------------------------------------------------------------


def _request(server: RunningServer, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(server.base + path, data=body, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _server_index(server: RunningServer) -> dict[tuple[str, str], dict[str, str]]:
    status, body = _request(server, "/v2/repository/index", b"{}")
    assert status == 200, body
    return {(e["name"], e.get("version", "")): e for e in json.loads(body)}


def _until(condition: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Wait for `condition` to hold (a few poll intervals and a load), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not reached within {timeout} s")


def _ready(server: RunningServer, model: str) -> bool:
    return _request(server, f"/v2/models/{model}/ready")[0] == 200


SIMPLE_BODY = json.dumps({"inputs": [
    {"name": name, "shape": [1, 16], "datatype": "INT32", "data": [1] * 16} for name in ("INPUT0", "INPUT1")
]}).encode()


def test_a_polling_server_follows_the_repository_and_refuses_the_load_api(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo)
    with geserve([repo], tmp_path / "log", POLL) as server:
        assert _ready(server, "simple")
        for action in ("load", "unload"):
            status, body = _request(server, f"/v2/repository/models/simple/{action}", b"{}")
            assert status == 503
            assert json.loads(body) == {"error": "explicit model load / unload is not allowed if polling is enabled"}

        models.simple(repo, "added")
        _until(lambda: _ready(server, "added"))
        status, answer = _request(server, "/v2/models/added/infer", SIMPLE_BODY)
        assert status == 200 and json.loads(answer)["outputs"][0]["data"] == [2] * 16

        config = repo / "simple" / "config.pbtxt"
        good = config.read_text()
        config.write_text(good + "\nno_such_field: 1\n")
        entry = _until(lambda: _server_index(server)[("simple", "1")].get("reason") and
                       _server_index(server)[("simple", "1")])
        assert entry["state"] == "READY" and "no_such_field" in entry["reason"]
        assert _request(server, "/v2/models/simple/infer", SIMPLE_BODY)[0] == 200  # still served by the old one

        config.write_text(good.replace("max_batch_size: 8", "max_batch_size: 2"))
        _until(lambda: json.loads(_request(server, "/v2/models/simple/config")[1])["max_batch_size"] == 2)
        assert "reason" not in _server_index(server)[("simple", "1")]

        shutil.rmtree(repo / "added")
        _until(lambda: not _ready(server, "added"))
        status, body = _request(server, "/v2/models/added/infer", SIMPLE_BODY)
        assert status == 404 and b"has no available versions" in body
        assert _request(server, "/v2/health/ready")[0] == 200  # strict readiness waits for no removed model
    assert "model repository changes" in server.log()


def test_a_reload_under_traffic_fails_no_request(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo)
    config = repo / "simple" / "config.pbtxt"
    original = config.read_text()
    with geserve([repo], tmp_path / "log", POLL) as server:
        done = threading.Event()

        def traffic() -> int:
            # Plain HTTP: tritonclient.http's gevent pool must not cross threads.
            count = 0
            while not done.is_set():
                status, answer = _request(server, "/v2/models/simple/infer", SIMPLE_BODY)
                assert status == 200, answer
                assert json.loads(answer)["outputs"][0]["data"] == [2] * 16
                count += 1
            return count

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(traffic) for _ in range(2)]
            try:
                for reload in range(1, 4):  # instance counts 2, 1, 2: each change is a reload
                    config.write_text(original.replace("count: 1", f"count: {2 - reload % 2}"))
                    _until(lambda r=reload: server.log().count("successfully loaded 'simple' version 1") > r)
            finally:
                done.set()
            counts = [f.result() for f in futures]
        assert all(c > 0 for c in counts)
        assert server.log().count("successfully unloaded 'simple' version 1") >= 3


def test_poll_mode_without_an_interval_loads_and_never_polls(tmp_path: Path) -> None:
    """As Triton, which polls only with a non-zero --repository-poll-secs: the models load at start, then stay."""
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo)
    with geserve([repo], tmp_path / "log", ["--model-control-mode=poll", "--repository-poll-secs=0"]) as server:
        assert _ready(server, "simple")
        models.simple(repo, "added")
        time.sleep(1.0)
        assert not _ready(server, "added")


ROUNDS = 24  # new connections per check (urllib opens one per request): the supervisor spreads them on both workers


def _everywhere(check: Callable[[], bool]) -> bool:
    return all(check() for _ in range(ROUNDS))


def test_with_workers_the_supervisor_scans_once_and_every_worker_follows(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo)
    with geserve([repo], tmp_path / "log", ["--workers", "2", "--log-verbose=1", *POLL]) as server:
        _until(lambda: _everywhere(lambda: _request(server, "/v2/health/ready")[0] == 200), 60)

        added = models.simple(repo, "added")
        _until(lambda: _ready(server, "added"))
        assert _everywhere(lambda: _request(server, "/v2/models/added/infer", SIMPLE_BODY)[0] == 200)

        shutil.copytree(added / "1", added / "2")  # a new version: the latest (policy latest 1) replaces 1
        _until(lambda: _request(server, "/v2/models/added/versions/2/ready")[0] == 200)
        assert _everywhere(lambda: _request(server, "/v2/models/added/versions/2/ready")[0] == 200)
        assert _everywhere(lambda: _request(server, "/v2/models/added/versions/1/ready")[0] != 200)

        shutil.rmtree(added)
        _until(lambda: not _ready(server, "added"))
        assert _everywhere(lambda: not _ready(server, "added"))
        assert _everywhere(lambda: _ready(server, "simple"))
    log = server.log()
    for worker in ("w0", "w1"):  # each worker loaded each version, told by the supervisor
        assert f"{worker} " in log
        for version in ("1", "2"):
            assert any(f" {worker} " in line and f"successfully loaded 'added' version {version}" in line
                       for line in log.splitlines()), (worker, version)
    scans = [line for line in log.splitlines() if "scanned the model repositories" in line]
    assert len(scans) >= 3
    assert not any(f" {worker} " in line for line in scans for worker in ("w0", "w1"))  # the supervisor's alone
