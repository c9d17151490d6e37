"""The response cache of a server of several workers (service/shared_cache.py): the shared table on its own (the
LRU by bytes as one process keeps it, answers as bytes, the arena under churn, processes at once, a holder that
dies), the loads the workers' keys name, then real servers with `--workers 2`: a response cached by one worker is a
hit on every worker, counted once."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import random
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient

from geserve.config import ModelConfig
from geserve.repository.model import LoadedModel
from geserve.service import shared_cache
from geserve.service.response_cache import ResponseCache, entry_size, request_key
from geserve.service.shared_cache import SharedResponseCache, SharedTable, create_segment, decode, encode
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, OutputTensor
from tests.support import models
from tests.support.server import RunningServer, geserve
from tests.test_workers import http_connections, kill_a_worker, wait_ready

CACHED = "response_cache { enable: true }"
ROUNDS = 24  # new connections, each held, so that the supervisor deals them out to both workers in turn


# ---- the table ----------------------------------------------------------------------------------------------------


@pytest.fixture()
def segment() -> Iterator[int]:
    fd = create_segment(64 * 1024)
    yield fd
    os.close(fd)


def _table(fd: int) -> SharedTable:
    """A worker's view: one description of its own, so two tables in one process lock each other out as two
    processes would."""
    return SharedTable(fd)


def _key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _answer(value: float, n: int = 100) -> list[OutputTensor]:
    return [OutputTensor("Y", "FP32", (n,), np.full(n, value, np.float32))]


def _store(table: SharedTable, key: bytes, outputs: list[OutputTensor], parameters: dict[str, Any] | None = None
           ) -> bool:
    return table.insert(key, encode(outputs, parameters or {}), entry_size(outputs))


def _value(table: SharedTable, key: bytes) -> float | None:
    blob = table.lookup(key)
    return None if blob is None else float(decode(blob)[0][0].data[0])


def check_arena(table: SharedTable) -> None:
    """The table's invariants: runs tile the arena with matching boundary tags, no two free runs touch, the free
    lists hold exactly the free runs, and the entries add up to the header's counts."""
    cells = table._cells
    offset, end = cells[shared_cache._H_ARENA], cells[shared_cache._H_END]
    free_bytes, entries, counted, last_free = 0, 0, 0, False
    while offset < end:
        tag = cells[offset >> 3]
        size = tag & ~shared_cache._USED
        assert size and size % shared_cache.UNIT == 0 and cells[(offset + size - 8) >> 3] == tag, offset
        if tag & shared_cache._USED:
            entries, counted, last_free = entries + 1, counted + cells[(offset >> 3) + shared_cache._E_COUNT], False
        else:
            assert not last_free, "two free runs side by side"
            free_bytes, last_free = free_bytes + size, True
        offset += size
    assert offset == end
    assert (entries, counted) == (cells[shared_cache._H_ENTRIES], cells[shared_cache._H_USED])
    listed = 0
    for size_class in range(shared_cache._BINS):
        run, previous = cells[shared_cache._H_BINS + size_class], 0
        while run:
            assert not cells[run >> 3] & shared_cache._USED
            assert cells[(run >> 3) + shared_cache._R_PREV_FREE] == previous
            assert shared_cache._size_class(cells[run >> 3]) == size_class
            listed += cells[run >> 3]
            run, previous = cells[(run >> 3) + shared_cache._R_NEXT_FREE], run
    assert listed == free_bytes


def test_an_entry_stored_by_one_worker_is_found_by_another(segment: int) -> None:
    one, other = _table(segment), _table(segment)
    assert _store(one, _key("a"), _answer(1.0), {"p": "q"})
    blob = other.lookup(_key("a"))
    assert blob is not None
    (output,), parameters = decode(blob)
    assert output.name == "Y" and output.datatype == "FP32" and output.shape == (100,)
    assert float(output.data[0]) == 1.0 and parameters == {"p": "q"}
    assert other.lookup(_key("b")) is None
    assert one.counts() == other.counts() == {"entries": 1, "used": entry_size(_answer(1.0)), "hits": 1,
                                              "misses": 1, "evictions": 0, "resets": 0}
    assert len(one) == 1 and _key("a") in other and _key("b") not in other


def test_the_lru_by_bytes_matches_one_process(segment: int) -> None:
    """The same steps as tests/test_response_cache.py's LRU test, through two workers' views: the same entries go."""
    one = entry_size(_answer(0.0))
    fd = create_segment(2 * one + 10)
    try:
        a, b = _table(fd), _table(fd)
        local = ResponseCache(2 * one + 10)
        steps: list[tuple[str, SharedTable, str, int]] = [
            ("insert", a, "a", 100), ("insert", b, "b", 100), ("lookup", b, "a", 0), ("insert", a, "c", 100),
            ("insert", b, "d", 10), ("lookup", a, "c", 0), ("insert", b, "e", 10), ("insert", a, "f", 40),
        ]
        for action, table, name, n in steps:
            if action == "insert":
                assert _store(table, _key(name), _answer(1.0, n))
                local.insert(_key(name), InferenceResponse("m", "1", _answer(1.0, n)))
            else:
                assert (table.lookup(_key(name)) is None) == (local.lookup(_key(name)) is None)
            assert [n for n in "abcdef" if _key(n) in a] == [n for n in "abcdef" if _key(n) in local], (action, name)
            assert a.counts()["used"] == local.used and len(a) == len(local)
            check_arena(a)
        assert a.counts()["evictions"] == local.evictions
    finally:
        os.close(fd)


def test_an_entry_larger_than_the_cache_is_refused_and_evicts_nothing(segment: int) -> None:
    table = _table(segment)
    assert _store(table, _key("small"), _answer(1.0, 4))
    assert not _store(table, _key("big"), _answer(2.0, 64 * 1024 // 4))
    assert _key("big") not in table and _key("small") in table and table.counts()["evictions"] == 0


def test_storing_a_key_again_replaces_its_answer(segment: int) -> None:
    table = _table(segment)
    _store(table, _key("k"), _answer(1.0, 10))
    _store(table, _key("k"), _answer(2.0, 20))
    assert len(table) == 1 and table.counts()["used"] == entry_size(_answer(2.0, 20))
    assert _value(table, _key("k")) == 2.0
    check_arena(table)


def test_answers_come_back_exactly_and_read_only() -> None:
    batch = np.arange(40, dtype=np.float32).reshape(4, 10)
    outputs = [
        OutputTensor("slice", "FP32", (1, 10), batch[1:2], {"o": 1}),  # a view of a larger array
        OutputTensor("strided", "FP32", (2, 4), batch[::2, :8:2]),  # not contiguous
        OutputTensor("scalar", "INT64", (), np.array(7, np.int64)),
        OutputTensor("empty", "INT32", (0, 3), np.zeros((0, 3), np.int32)),
        OutputTensor("half", "BF16", (3,), np.array([1.5, -2, 3], ml_dtypes.bfloat16)),
        OutputTensor("flags", "BOOL", (3,), np.array([True, False, True])),
        OutputTensor("strings", "BYTES", (3,), np.array([b"ab", "\u00e9", b""], dtype=object)),
    ]
    found, parameters = decode(b"".join(_joined(encode(outputs, {"p": [1, 2]}))))
    assert parameters == {"p": [1, 2]}
    for original, copy in zip(outputs, found, strict=True):
        assert (copy.name, copy.datatype, copy.shape, copy.parameters) == (
            original.name, original.datatype, original.shape, original.parameters)
        assert copy.data.dtype == original.data.dtype and copy.data.shape == original.data.shape
        assert copy.data.tolist() == original.data.tolist()
        assert not copy.data.flags.writeable, copy.name
    assert [type(v) for v in found[-1].data] == [bytes, str, bytes]  # elements as the model made them
    with pytest.raises(ValueError, match="read-only"):
        found[0].data[0, 0] = 0.0


def _joined(parts: list[memoryview]) -> list[bytes]:
    """The parts as `SharedTable.insert` lays them out (each 16-byte aligned)."""
    out, length = [], 0
    for part in parts:
        pad = -length % 16
        out += [bytes(pad), part.tobytes()]
        length += pad + part.nbytes
    return out


def test_the_arena_stays_whole_under_churn_of_mixed_sizes(segment: int) -> None:
    """Entries from 400 B to half the cache, stored, found and evicted in a random order by two views: every answer
    found is the one stored under its key, and the arena's invariants hold throughout."""
    tables, rng, stored = (_table(segment), _table(segment)), random.Random(7), {}
    for step in range(6000):
        table = tables[step % 2]
        key = _key(str(rng.randrange(200)))
        if rng.random() < 0.5:
            n = rng.choice([4, 50, 400, 1500, 8000])
            assert _store(table, key, _answer(float(step), n))
            stored[key] = float(step)
        else:
            value = _value(table, key)
            assert value is None or value == stored[key]
        if step % 300 == 0:
            check_arena(table)
    check_arena(tables[0])
    counts = tables[0].counts()
    assert counts["evictions"] > 100 and counts["hits"] > 100 and counts["resets"] == 0
    tables[1].clear()
    check_arena(tables[0])
    assert len(tables[0]) == 0


def test_emptying_a_large_cache_empties_every_bucket() -> None:
    fd = create_segment(300 << 20)  # 262144 buckets: emptied a slice at a time
    try:
        table = _table(fd)
        keys = [_key(str(i)) for i in range(300)]
        for key in keys:
            assert _store(table, key, _answer(1.0, 4))
        table.clear()
        assert len(table) == 0 and not any(key in table for key in keys)
        buckets = table._cells[shared_cache._H_BUCKETS]
        assert not any(table._cells[shared_cache._HEADER // 8: shared_cache._HEADER // 8 + buckets].tolist())
        check_arena(table)
    finally:
        os.close(fd)


def _churn(fd: int, seed: int, rounds: int) -> None:
    table, rng = SharedTable(fd), random.Random(seed)
    for _ in range(rounds):
        name = str(rng.randrange(100))
        if rng.random() < 0.4:
            n = rng.choice([4, 60, 700, 3000])
            _store(table, _key(name), [OutputTensor("Y", "INT32", (n,), np.full(n, int(name), np.int32))])
        else:
            blob = table.lookup(_key(name))
            if blob is not None:
                data = decode(blob)[0][0].data
                if not (data == int(name)).all():
                    os._exit(3)  # another key's answer, or a torn one
    os._exit(0)


def test_processes_at_once_never_see_a_torn_or_wrong_answer(segment: int) -> None:
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_churn, args=(segment, seed, 3000)) for seed in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    table = _table(segment)
    check_arena(table)
    assert table.counts()["resets"] == 0


def _die_holding_the_lock(fd: int) -> None:
    table = SharedTable(fd)
    with table._locked():
        table._cells[table._cells[shared_cache._H_LRU_HEAD] >> 3] = 12345  # half-way through a change
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_that_dies_holding_the_table_leaves_it_emptied_not_broken(segment: int) -> None:
    table = _table(segment)
    _store(table, _key("a"), _answer(1.0))
    child = multiprocessing.get_context("fork").Process(target=_die_holding_the_lock, args=(segment,))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    assert _value(table, _key("a")) is None  # the next holder found the mark and emptied the table
    counts = table.counts()
    assert counts["entries"] == 0 and counts["resets"] == 1
    check_arena(table)
    assert _store(table, _key("a"), _answer(2.0)) and _value(table, _key("a")) == 2.0


# ---- the loads in the key -------------------------------------------------------------------------------------------


def _model(load: int) -> LoadedModel:
    model = LoadedModel("m", 1, ModelConfig(name="m"), None, ModelStatistics(), {}, {})  # type: ignore[arg-type]
    model.response_cache = load
    return model


def _request() -> InferenceRequest:
    x = np.arange(4, dtype=np.float32)
    return InferenceRequest("m", "", [InputTensor("X", "FP32", (4,), x)])


def test_workers_key_a_load_by_the_servers_number_of_it(segment: int) -> None:
    """Two workers number their loads each their own way; the key names the server's number, so the same load keys
    alike in both and another load (a reload) does not."""
    first, second = SharedResponseCache(_table(segment)), SharedResponseCache(_table(segment))
    at_start_1, at_start_2 = _model(3), _model(5)
    first.loaded_at_start([at_start_1])
    second.loaded_at_start([at_start_2])

    def key(cache: SharedResponseCache, model: LoadedModel) -> bytes:
        return request_key(model, _request(), cache.load_of(model))

    assert key(first, at_start_1) == key(second, at_start_2)
    assert key(first, at_start_1) != request_key(at_start_1, _request())  # not the process's own number
    # Control call 7 reloads the model in both: seen by a request while the call runs, or only when it ended.
    first.control_started(7)
    reloaded_1 = _model(4)
    assert first.load_of(reloaded_1) == 7
    first.control_ended([reloaded_1])
    second.control_started(7)
    reloaded_2 = _model(9)
    second.control_ended([reloaded_2])
    assert key(first, reloaded_1) == key(second, reloaded_2) != key(first, at_start_1)
    assert key(first, at_start_1) == key(second, at_start_2)  # the old load keeps its number while it serves
    # A load no call made (none should be): a key of this process alone.
    stray = _model(11)
    assert first.load_of(stray) != second.load_of(_model(11))
    assert first.load_of(stray) == first.load_of(stray)


def test_a_failing_table_costs_the_entry_not_the_request(segment: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = SharedResponseCache(_table(segment))
    model = _model(1)
    cache.loaded_at_start([model])
    runs = []

    async def run(model: LoadedModel, request: InferenceRequest, started: int) -> InferenceResponse:
        runs.append(request)
        return InferenceResponse("m", "1", _answer(3.0, 4))

    def broken(*args: Any) -> None:
        raise RuntimeError("broken table")

    monkeypatch.setattr(cache.table, "lookup", broken)
    monkeypatch.setattr(cache.table, "insert", broken)
    for _ in range(2):
        response = asyncio.run(cache.execute(model, _request(), time.monotonic_ns(), run))
        assert float(response.outputs[0].data[0]) == 3.0
    assert len(runs) == 2  # both answered by the model: misses


# ---- a real server with two workers ---------------------------------------------------------------------------------


def _inputs(a: np.ndarray, b: np.ndarray) -> list[httpclient.InferInput]:
    inputs = [httpclient.InferInput("INPUT0", list(a.shape), "INT32"),
              httpclient.InferInput("INPUT1", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _stats(server: RunningServer, model: str) -> tuple[int, int, int, int]:
    """(success, cache hits, cache misses, executions), added up over the workers by whichever answers."""
    client = httpclient.InferenceServerClient(server.url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()
    inference = stats["inference_stats"]
    return (inference["success"]["count"], inference["cache_hit"]["count"], inference["cache_miss"]["count"],
            stats["execution_count"])


def _metric(server: RunningServer, family: str, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf'^{family}{{model="{model}",version="1"}} (\S+)$', text, re.MULTILINE)
    assert match is not None, text
    return float(match.group(1))


def _on_fresh_connections(server: RunningServer, a: np.ndarray, b: np.ndarray, rounds: int = ROUNDS) -> None:
    """The same request `rounds` times, each on a new connection held until all are answered: the supervisor
    hands each to the worker holding fewer, so both workers answer half of them."""
    clients = [httpclient.InferenceServerClient(server.url) for _ in range(rounds)]
    try:
        for client in clients:
            result = client.infer("simple_cached", _inputs(a, b))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert http_connections(server) == [rounds // 2, rounds // 2]
    finally:
        for client in clients:
            client.close()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shared_cache") / "models"
    models.simple(root, "simple_cached", extra=CACHED)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("shared_cache_logs") / "server.log"
    args = ["--workers", "2", "--model-control-mode", "explicit", "--load-model", "simple_cached",
            "--cache-config", "local,size=1048576"]
    with geserve([repo], log, args) as running:
        wait_ready(running)
        yield running


def test_a_response_cached_by_one_worker_is_a_hit_on_every_worker(server: RunningServer) -> None:
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 5, np.int32)
    before = _stats(server, "simple_cached")
    hits_before = _metric(server, "nv_cache_num_hits_per_model", "simple_cached")
    misses_before = _metric(server, "nv_cache_num_misses_per_model", "simple_cached")
    _on_fresh_connections(server, a, b)
    after = _stats(server, "simple_cached")
    # One miss (the first, which ran the model once), then a hit on whichever worker: counted once each.
    assert [x - y for x, y in zip(after, before, strict=True)] == [ROUNDS, ROUNDS - 1, 1, 1]
    assert _metric(server, "nv_cache_num_hits_per_model", "simple_cached") - hits_before == ROUNDS - 1
    assert _metric(server, "nv_cache_num_misses_per_model", "simple_cached") - misses_before == 1


def test_a_reload_through_one_worker_starts_every_worker_afresh(server: RunningServer) -> None:
    a, b = np.full((1, 16), 3, np.int32), np.full((1, 16), 2, np.int32)
    _on_fresh_connections(server, a, b, 4)
    client = httpclient.InferenceServerClient(server.url)
    try:
        client.load_model("simple_cached")  # the same version again: a new load in every worker
    finally:
        client.close()
    _on_fresh_connections(server, a, b)
    # A reloaded model's statistics start afresh: one miss (not an answer of the load it replaced), then hits.
    assert _stats(server, "simple_cached") == (ROUNDS, ROUNDS - 1, 1, 1)


def test_a_restarted_worker_finds_the_servers_entries(server: RunningServer) -> None:
    a, b = np.full((1, 16), 9, np.int32), np.full((1, 16), 4, np.int32)
    _on_fresh_connections(server, a, b, 2)
    before = _stats(server, "simple_cached")
    kill_a_worker(server)
    survivor = _stats(server, "simple_cached")
    _on_fresh_connections(server, a, b)
    after = _stats(server, "simple_cached")
    # The restarted worker replayed the reload (the server's number for it): every request hits, on both workers.
    assert (after[1] - survivor[1], after[2] - survivor[2], after[3] - survivor[3]) == (ROUNDS, 0, 0)
    assert survivor[1] <= before[1]  # the dead worker's counts went with it


def test_eviction_is_least_recently_used_across_the_server(repo: Path, tmp_path: Path) -> None:
    one = entry_size([OutputTensor(n, "INT32", (1, 16), np.zeros((1, 16), np.int32)) for n in ("O0", "O1")])
    args = ["--workers", "2", "--model-control-mode", "explicit", "--load-model", "simple_cached",
            "--cache-config", f"local,size={2 * one + 100}"]  # room for two answers
    with geserve([repo], tmp_path / "server.log", args) as running:
        wait_ready(running)
        clients = [httpclient.InferenceServerClient(running.url) for _ in range(2)]  # one on each worker
        try:
            def infer(worker: int, value: int) -> None:
                a = np.full((1, 16), value, np.int32)
                result = clients[worker].infer("simple_cached", _inputs(a, a))
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)

            def hits_misses() -> tuple[int, int]:
                return _stats(running, "simple_cached")[1:3]

            infer(0, 1)
            infer(1, 2)  # 1 and 2 stored, by one worker each: the cache is full
            assert http_connections(running) == [1, 1]
            infer(1, 1)  # a hit on the worker that did not store it, and 1 is the server's most recently used
            assert hits_misses() == (1, 2)
            infer(0, 3)  # stored by evicting 2, the least recently used, not 1
            infer(1, 1)
            infer(0, 3)
            assert hits_misses() == (3, 3)
            infer(1, 2)  # 2 was evicted: a miss
            assert hits_misses() == (3, 4)
        finally:
            for client in clients:
                client.close()
