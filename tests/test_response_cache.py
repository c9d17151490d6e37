"""Triton's response cache (`--cache-config local,size=<bytes>`, `response_cache { enable: true }`): the key and the
LRU on their own, then real servers through tritonclient over HTTP and gRPC: hits, what misses, eviction by bytes,
statistics and metrics as Triton keeps them, the configs Triton refuses, and ensembles (a cached step runs nothing;
a cached ensemble runs no step)."""

from __future__ import annotations

import asyncio
import queue
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve.cli import build_parser, settings_from_args
from geserve.config import ModelConfig
from geserve.repository.builder import LifecycleOptions
from geserve.repository.model import LoadedModel
from geserve.server import Server, StartupError
from geserve.service.response_cache import (
    ENTRY_OVERHEAD,
    TENSOR_OVERHEAD,
    CacheConfigError,
    ResponseCache,
    build_response_cache,
    entry_size,
    request_key,
    request_key_async,
)
from geserve.settings import ServerSettings
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, OutputTensor, RequestedOutput
from tests.support import ensembles, models
from tests.support.ensembles import Ensemble, chain
from tests.support.python_repo import PYTHON_MODELS
from tests.support.server import RunningServer, geserve

CACHED = "response_cache { enable: true }"
CACHE_SIZE = 1 << 20
# Python: Y = X * the request parameter `scale` (1 when absent); a negative X[0] fails the request.
SCALED_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x.reshape(-1)[0] < 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
                continue
            scale = float(json.loads(request.parameters()).get("scale", 1))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x * scale).astype(np.float32))]))
        return responses
"""


# ---- helpers -----------------------------------------------------------------------------------------------------


def _model(name: str = "m", version: int = 1, load: int = 1) -> LoadedModel:
    """Just what the key reads of a model: its name, version and the number of its load."""
    config = ModelConfig(name=name)
    model = LoadedModel(name, version, config, None, ModelStatistics(), {}, {})  # type: ignore[arg-type]
    model.response_cache = load
    return model


def _request(
    inputs: dict[str, np.ndarray], outputs: list[RequestedOutput] | None = None, **fields: Any
) -> InferenceRequest:
    tensors = [
        InputTensor(name, "BYTES" if a.dtype == object else _WIRE[a.dtype.str[1:]], a.shape, a)
        for name, a in inputs.items()
    ]
    return InferenceRequest("m", "", tensors, outputs, **fields)


_WIRE = {"i4": "INT32", "f4": "FP32", "u1": "UINT8", "i8": "INT64"}


def _output(name: str, data: np.ndarray, datatype: str = "FP32") -> OutputTensor:
    return OutputTensor(name, datatype, data.shape, data)


def _scaled(repo: Path, name: str = "scaled") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(SCALED_MODEL)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        f'output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n{CACHED}\n'
    )


def _stats(server: RunningServer, model: str) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.url)
    try:
        stats: dict[str, Any] = client.get_inference_statistics(model)["model_stats"][0]
        return stats
    finally:
        client.close()


def _counts(server: RunningServer, model: str) -> tuple[int, int, int, int, int]:
    """(success, cache hits, cache misses, inference_count, execution_count)."""
    stats = _stats(server, model)
    inference = stats["inference_stats"]
    return (inference["success"]["count"], inference["cache_hit"]["count"], inference["cache_miss"]["count"],
            stats["inference_count"], stats["execution_count"])


def _metric(text: str, family: str, model: str) -> float | None:
    match = re.search(rf'^{family}{{model="{model}",version="1"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _scrape(server: RunningServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text: str = response.read().decode()
        return text


def _simple_inputs(a: np.ndarray, b: np.ndarray, module: Any = httpclient) -> list[Any]:
    inputs = [module.InferInput("INPUT0", list(a.shape), "INT32"), module.InferInput("INPUT1", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _fp32_input(name: str, x: np.ndarray, module: Any = httpclient) -> list[Any]:
    tensor = module.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return [tensor]


# ---- configuration -----------------------------------------------------------------------------------------------


def test_no_cache_config_means_no_cache() -> None:
    assert build_response_cache({}) is None
    cache = build_response_cache({"local": {"size": "4096"}})
    assert cache is not None and cache.capacity == 4096


@pytest.mark.parametrize(("config", "words"), [
    ({"redis": {"host": "localhost"}}, "unknown cache 'redis'"),
    ({"local": {"size": "1"}, "redis": {"host": "x"}}, "multiple cache configurations"),
    ({"local": {}}, "needs its size"),
    ({"local": {"size": "lots"}}, "expects a number of bytes"),
    ({"local": {"size": "0"}}, "positive number of bytes"),
    ({"local": {"size": "1024", "ttl": "5"}}, "unknown setting(s) ttl"),
])
def test_bad_cache_configs_are_refused(config: dict[str, dict[str, str]], words: str) -> None:
    with pytest.raises(CacheConfigError, match=re.escape(words)):
        build_response_cache(config)


def test_cache_config_flag_parses_as_tritonserver_does() -> None:
    args = build_parser().parse_args(["serve", "--model-repository", "/r", "--cache-config", "local,size=1048576"])
    assert settings_from_args(args).cache_config == {"local": {"size": "1048576"}}
    args = build_parser().parse_args(["serve", "--cache-config=local,size=10", "--cache-config", "local,size=20"])
    assert settings_from_args(args).cache_config == {"local": {"size": "20"}}  # repeatable, the last one wins


@pytest.mark.parametrize(("flag", "words"), [
    ("local", "No cache specified. --cache-config option format is <cache name>,<setting>=<value>. Got local"),
    ("local,size", "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size"),
    ("local,size=", "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size="),
])
def test_malformed_cache_config_flag_gets_tritons_message(
    flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cache-config", flag])
    assert words in capsys.readouterr().err


def test_server_refuses_to_start_with_an_unusable_cache(tmp_path: Path) -> None:
    settings = ServerSettings(model_repositories=[tmp_path], cache_config={"redis": {"host": "localhost"}})
    with pytest.raises(StartupError, match="geserve has the 'local' cache only"):
        Server(settings)
    server = Server(ServerSettings(model_repositories=[tmp_path], cache_config={"local": {"size": "2048"}}))
    assert server.response_cache is not None and server.response_cache.capacity == 2048
    assert server.service.response_cache is server.response_cache


def test_lifecycle_options_default_to_no_cache() -> None:
    assert LifecycleOptions().response_cache is False


# ---- the key ------------------------------------------------------------------------------------------------------


def test_identical_requests_share_a_key_whatever_the_input_order() -> None:
    a, b = np.arange(16, dtype=np.int32), np.ones(16, np.int32)
    key = request_key(_model(), _request({"A": a, "B": b}))
    assert request_key(_model(), _request({"B": b.copy(), "A": a.copy()})) == key
    # A non-contiguous view is the same request as a contiguous array of the same values.
    strided = np.arange(32, dtype=np.int32)[::2]
    assert request_key(_model(), _request({"A": strided})) == request_key(_model(), _request({"A": strided.copy()}))


def test_any_input_byte_changes_the_key() -> None:
    x = np.arange(64, dtype=np.uint8)
    key = request_key(_model(), _request({"X": x}))
    for position in range(x.size):
        changed = x.copy()
        changed[position] ^= 1
        assert request_key(_model(), _request({"X": changed})) != key, position


def test_datatype_shape_and_name_change_the_key() -> None:
    x = np.arange(8, dtype=np.int32)
    key = request_key(_model(), _request({"X": x}))
    assert request_key(_model(), _request({"X": x.reshape(2, 4)})) != key  # same bytes, other shape
    assert request_key(_model(), _request({"X": x.view(np.float32)})) != key  # same bytes, other datatype
    assert request_key(_model(), _request({"Y": x})) != key
    assert request_key(_model("other"), _request({"X": x})) != key
    assert request_key(_model(version=2), _request({"X": x})) != key
    assert request_key(_model(load=2), _request({"X": x})) != key  # the same model, loaded again


def test_large_inputs_are_hashed_off_the_loop_to_the_same_key() -> None:
    big = {"X": np.arange(1 << 19, dtype=np.float32)}  # 2 MiB
    with ThreadPoolExecutor(1) as pool:
        loop = asyncio.new_event_loop()
        loop.set_default_executor(pool)
        try:
            key = loop.run_until_complete(request_key_async(_model(), _request(big)))
        finally:
            loop.close()
    assert key == request_key(_model(), _request(big))


def test_bytes_elements_keep_their_boundaries() -> None:
    one = np.array([b"ab", b"c"], dtype=object)
    other = np.array([b"a", b"bc"], dtype=object)
    assert request_key(_model(), _request({"S": one})) != request_key(_model(), _request({"S": other}))
    assert request_key(_model(), _request({"S": one})) == request_key(_model(), _request({"S": one.copy()}))


def test_inputs_do_not_run_into_each_other() -> None:
    # Two inputs whose bytes, joined, are the same: the length prefixes keep them apart.
    a = {"A": np.array([1, 2], np.uint8), "B": np.array([3], np.uint8)}
    b = {"A": np.array([1], np.uint8), "B": np.array([2, 3], np.uint8)}
    assert request_key(_model(), _request(a)) != request_key(_model(), _request(b))


def test_requested_outputs_and_classification_change_the_key() -> None:
    x = {"X": np.arange(4, dtype=np.float32)}
    every = request_key(_model(), _request(x))
    one = request_key(_model(), _request(x, [RequestedOutput("Y")]))
    both = request_key(_model(), _request(x, [RequestedOutput("Y"), RequestedOutput("Z")]))
    swapped = request_key(_model(), _request(x, [RequestedOutput("Z"), RequestedOutput("Y")]))
    classified = request_key(_model(), _request(x, [RequestedOutput("Y", {"classification": 3})]))
    assert len({every, one, both, swapped, classified}) == 5
    # How an output travels (binary or JSON, shared memory) does not change the tensors.
    binary = request_key(_model(), _request(x, [RequestedOutput("Y", {"binary_data": True})]))
    assert binary == one


def test_parameters_that_reach_the_model_change_the_key_and_scheduling_hints_do_not() -> None:
    x = {"X": np.arange(4, dtype=np.float32)}
    plain = request_key(_model(), _request(x))
    assert request_key(_model(), _request(x, parameters={"scale": 2})) != plain
    assert request_key(_model(), _request(x, parameters={"scale": 2})) != request_key(
        _model(), _request(x, parameters={"scale": 3})
    )
    assert request_key(_model(), _request(x, parameters={"scale": "2"})) != request_key(
        _model(), _request(x, parameters={"scale": 2})
    )
    hints = {"priority": 1, "timeout": 1000, "binary_data_output": True}
    assert request_key(_model(), _request(x, parameters=hints)) == plain


def test_the_callers_identity_changes_the_key() -> None:
    x = {"X": np.arange(4, dtype=np.float32)}
    assert request_key(_model(), _request(x, identity="alice")) != request_key(_model(), _request(x, identity="bob"))
    assert request_key(_model(), _request(x, identity="alice")) != request_key(_model(), _request(x))


# ---- the LRU -----------------------------------------------------------------------------------------------------


def _response(*arrays: np.ndarray) -> InferenceResponse:
    return InferenceResponse("m", "1", [_output(f"Y{i}", a) for i, a in enumerate(arrays)])


def test_entries_count_their_bytes_and_overhead() -> None:
    outputs = [_output("Y", np.zeros(100, np.float32)), _output("Z", np.zeros(3, np.int64), "INT64")]
    assert entry_size(outputs) == ENTRY_OVERHEAD + 400 + 24 + 2 * TENSOR_OVERHEAD
    strings = [_output("S", np.array([b"x" * 50, b"y" * 10], dtype=object), "BYTES")]
    assert entry_size(strings) >= ENTRY_OVERHEAD + TENSOR_OVERHEAD + 60


def test_least_recently_used_entries_go_first_by_bytes() -> None:
    one = entry_size(_response(np.zeros(100, np.float32)).outputs)
    cache = ResponseCache(2 * one + 10)
    for key in (b"a", b"b"):
        assert cache.insert(key, _response(np.full(100, key[0], np.float32)))
    assert cache.used == 2 * one and len(cache) == 2
    assert cache.lookup(b"a") is not None  # a is now the most recently used
    assert cache.insert(b"c", _response(np.zeros(100, np.float32)))
    assert b"b" not in cache and b"a" in cache and b"c" in cache
    assert cache.evictions == 1 and cache.used == 2 * one
    # Smaller entries: as many go as the new one needs, oldest first.
    small = entry_size(_response(np.zeros(10, np.float32)).outputs)
    assert cache.insert(b"d", _response(np.zeros(10, np.float32)))
    assert cache.used == one + small and list(cache._entries) == [b"c", b"d"]


def test_an_entry_larger_than_the_cache_is_not_stored_and_evicts_nothing() -> None:
    cache = ResponseCache(1000)
    assert cache.insert(b"small", _response(np.zeros(4, np.float32)))
    assert not cache.insert(b"big", _response(np.zeros(1000, np.float32)))
    assert b"big" not in cache and b"small" in cache and cache.evictions == 0


def test_storing_the_same_key_again_replaces_it() -> None:
    cache = ResponseCache(10_000)
    cache.insert(b"k", _response(np.zeros(10, np.float32)))
    cache.insert(b"k", _response(np.ones(20, np.float32)))
    assert len(cache) == 1 and cache.used == entry_size(_response(np.ones(20, np.float32)).outputs)
    found = cache.lookup(b"k")
    assert found is not None and found[0][0].data.shape == (20,)


def test_cached_arrays_are_private_and_read_only() -> None:
    cache = ResponseCache(10_000)
    batch = np.arange(40, dtype=np.float32).reshape(4, 10)
    response = InferenceResponse("m", "1", [_output("Y", batch[1:2])], parameters={"p": 1})
    cache.insert(b"k", response)
    batch[1, 0] = -1.0  # the model's (or the first caller's) array changes later: the entry does not
    found = cache.lookup(b"k")
    assert found is not None
    (output,), parameters = found
    assert output.data[0, 0] == 10.0 and output.data.base is None and parameters == {"p": 1}
    with pytest.raises(ValueError, match="read-only"):
        output.data[0, 0] = 0.0


# ---- a real server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("response_cache") / "models"
    repo.mkdir()
    models.simple(repo, "simple_cached", extra=CACHED)
    models.simple(repo, "simple_plain")
    models.identity_fp32(repo, "identity_cached", CACHED)
    _scaled(repo)
    # Ensembles: one whose steps cache (the ensemble does not), one that caches itself (its steps do not).
    ensembles.add_sub(repo, "add_sub_cached", extra=CACHED)
    chain("chain_steps_cached", "add_sub_cached").write(repo)
    ensembles.add_sub(repo, "add_sub_uncached")
    cached_chain = chain("chain_cached", "add_sub_uncached")
    Ensemble(cached_chain.name, cached_chain.inputs, cached_chain.outputs, cached_chain.steps,
             extra=CACHED).write(repo)
    return repo


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("response_cache_log") / "server.log"
    with geserve([repo], log, ["--cache-config", f"local,size={CACHE_SIZE}"]) as running:
        yield running


@pytest.fixture()
def http(server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(server.url)
    yield client
    client.close()


@pytest.fixture()
def grpc(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def test_a_hit_answers_the_same_outputs_without_running_the_model(
    server: RunningServer, http: httpclient.InferenceServerClient
) -> None:
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, np.int32)
    before = _counts(server, "simple_cached")
    first = http.infer("simple_cached", _simple_inputs(a, b), request_id="first")
    second = http.infer("simple_cached", _simple_inputs(a, b), request_id="second")
    np.testing.assert_array_equal(first.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT1"), a - b)
    assert second.get_response()["id"] == "second"  # the hit answers this request, not the one it stored
    assert second.get_response()["model_version"] == "1"
    after = _counts(server, "simple_cached")
    # success +2, one hit, one miss, and one inference and execution only: the hit ran nothing.
    assert [x - y for x, y in zip(after, before, strict=True)] == [2, 1, 1, 1, 1]


def test_hits_are_shared_between_http_and_grpc(
    server: RunningServer, http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    a, b = np.full((1, 16), 7, np.int32), np.arange(16, dtype=np.int32).reshape(1, 16)
    before = _counts(server, "simple_cached")
    http.infer("simple_cached", _simple_inputs(a, b))
    result = grpc.infer("simple_cached", _simple_inputs(a, b, grpcclient), request_id="g")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response().id == "g"
    after = _counts(server, "simple_cached")
    assert (after[1] - before[1], after[2] - before[2], after[4] - before[4]) == (1, 1, 1)


def test_a_grpc_stream_gets_hits_too(server: RunningServer, grpc: grpcclient.InferenceServerClient) -> None:
    a, b = np.full((1, 16), 13, np.int32), np.full((1, 16), 6, np.int32)
    answers: queue.Queue[Any] = queue.Queue()
    before = _counts(server, "simple_cached")
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for index in range(2):
            grpc.async_stream_infer("simple_cached", _simple_inputs(a, b, grpcclient), request_id=f"s{index}")
            result, error = answers.get(timeout=30)
            assert error is None
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
            assert result.get_response().id == f"s{index}"
    finally:
        grpc.stop_stream()
    after = _counts(server, "simple_cached")
    assert (after[1] - before[1], after[2] - before[2], after[4] - before[4]) == (1, 1, 1)


def test_a_change_in_any_input_byte_misses(server: RunningServer, grpc: grpcclient.InferenceServerClient) -> None:
    a, b = np.full((1, 16), 11, np.int32), np.full((1, 16), 5, np.int32)
    grpc.infer("simple_cached", _simple_inputs(a, b, grpcclient))
    before = _counts(server, "simple_cached")
    for position in (0, 7, 15):
        changed = b.copy()
        changed[0, position] += 1
        result = grpc.infer("simple_cached", _simple_inputs(a, changed, grpcclient))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + changed)
    after = _counts(server, "simple_cached")
    assert (after[1] - before[1], after[2] - before[2], after[4] - before[4]) == (0, 3, 3)


def test_a_change_of_shape_with_the_same_bytes_misses(
    server: RunningServer, http: httpclient.InferenceServerClient
) -> None:
    x = np.arange(8, dtype=np.float32) + 0.5
    before = _counts(server, "identity_cached")
    wide = http.infer("identity_cached", _fp32_input("INPUT0", x.reshape(1, 8)))
    tall = http.infer("identity_cached", _fp32_input("INPUT0", x.reshape(2, 4)))
    again = http.infer("identity_cached", _fp32_input("INPUT0", x.reshape(2, 4)))
    assert wide.as_numpy("OUTPUT0").shape == (1, 8)
    assert tall.as_numpy("OUTPUT0").shape == (2, 4) and again.as_numpy("OUTPUT0").shape == (2, 4)
    after = _counts(server, "identity_cached")
    assert (after[1] - before[1], after[2] - before[2]) == (1, 2)


def test_requested_outputs_and_classification_are_part_of_the_key(
    server: RunningServer, http: httpclient.InferenceServerClient
) -> None:
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16) * 2, np.ones((1, 16), np.int32)
    http.infer("simple_cached", _simple_inputs(a, b))  # every output: stored
    before = _counts(server, "simple_cached")
    only = http.infer("simple_cached", _simple_inputs(a, b), outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert only.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(only.as_numpy("OUTPUT1"), a - b)
    top = http.infer("simple_cached", _simple_inputs(a, b),
                     outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    top_again = http.infer("simple_cached", _simple_inputs(a, b),
                           outputs=[httpclient.InferRequestedOutput("OUTPUT0", class_count=2)])
    classes = top.as_numpy("OUTPUT0").reshape(-1).tolist()  # a + b = 2i + 1: the top two are at 15 and 14
    assert [c.split(b":")[-1] for c in classes] == [b"15", b"14"]
    assert top_again.as_numpy("OUTPUT0").reshape(-1).tolist() == classes
    # binary or JSON output does not change the tensors: the JSON request hits the binary one's entry.
    as_json = http.infer("simple_cached", _simple_inputs(a, b),
                         outputs=[httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)])
    np.testing.assert_array_equal(as_json.as_numpy("OUTPUT1"), a - b)
    after = _counts(server, "simple_cached")
    assert (after[1] - before[1], after[2] - before[2]) == (2, 2)


def test_parameters_that_reach_the_model_are_part_of_the_key(
    server: RunningServer, http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    x = np.array([1, 2, 3, 4], np.float32)
    before = _counts(server, "scaled")
    double = http.infer("scaled", _fp32_input("X", x), parameters={"scale": 2})
    triple = http.infer("scaled", _fp32_input("X", x), parameters={"scale": 3})
    double_again = grpc.infer("scaled", _fp32_input("X", x, grpcclient), parameters={"scale": 2})
    np.testing.assert_array_equal(double.as_numpy("Y"), x * 2)
    np.testing.assert_array_equal(triple.as_numpy("Y"), x * 3)
    np.testing.assert_array_equal(double_again.as_numpy("Y"), x * 2)
    # A priority changes when a request runs, not what it answers: a hit.
    prioritized = http.infer("scaled", _fp32_input("X", x), parameters={"scale": 3}, priority=1)
    np.testing.assert_array_equal(prioritized.as_numpy("Y"), x * 3)
    after = _counts(server, "scaled")
    assert (after[1] - before[1], after[2] - before[2], after[4] - before[4]) == (2, 2, 2)


def test_only_successful_responses_are_cached(server: RunningServer, http: httpclient.InferenceServerClient) -> None:
    x = np.array([-1, 2, 3, 4], np.float32)
    before = _stats(server, "scaled")
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="negative input"):
            http.infer("scaled", _fp32_input("X", x))
    after = _stats(server, "scaled")
    assert after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 2
    for kind in ("cache_hit", "cache_miss"):
        assert after["inference_stats"][kind]["count"] == before["inference_stats"][kind]["count"]


def test_statistics_count_a_hit_as_triton_does(server: RunningServer, http: httpclient.InferenceServerClient) -> None:
    a, b = np.full((1, 16), 21, np.int32), np.full((1, 16), 2, np.int32)
    before = _stats(server, "simple_cached")
    http.infer("simple_cached", _simple_inputs(a, b))
    http.infer("simple_cached", _simple_inputs(a, b))
    stats = _stats(server, "simple_cached")
    inference = stats["inference_stats"]
    old = before["inference_stats"]
    assert inference["cache_hit"]["count"] - old["cache_hit"]["count"] == 1
    assert inference["cache_hit"]["ns"] > old["cache_hit"]["ns"]
    assert inference["cache_miss"]["ns"] > old["cache_miss"]["ns"]
    # Triton reports queue and compute counts as the success count: a hit adds to each, with no time.
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[key]["count"] == inference["success"]["count"], key
    assert stats["execution_count"] - before["execution_count"] == 1
    assert sum(b["compute_infer"]["count"] for b in stats["batch_stats"]) == stats["execution_count"]
    plain = _stats(server, "simple_plain")["inference_stats"]
    assert plain["cache_hit"] == {"count": 0, "ns": 0} and plain["cache_miss"] == {"count": 0, "ns": 0}


def test_metrics_carry_tritons_cache_families_for_cached_models_only(
    server: RunningServer, http: httpclient.InferenceServerClient
) -> None:
    a, b = np.full((1, 16), 33, np.int32), np.full((1, 16), 4, np.int32)
    http.infer("simple_cached", _simple_inputs(a, b))
    http.infer("simple_cached", _simple_inputs(a, b))
    http.infer("simple_plain", _simple_inputs(a, b))
    text = _scrape(server)
    inference = _stats(server, "simple_cached")["inference_stats"]
    assert _metric(text, "nv_cache_num_hits_per_model", "simple_cached") == inference["cache_hit"]["count"]
    assert _metric(text, "nv_cache_num_misses_per_model", "simple_cached") == inference["cache_miss"]["count"]
    assert _metric(text, "nv_cache_hit_duration_per_model", "simple_cached") == inference["cache_hit"]["ns"] // 1000
    assert _metric(text, "nv_cache_miss_duration_per_model", "simple_cached") == (
        inference["cache_miss"]["ns"] // 1000
    )
    assert "# TYPE nv_cache_num_hits_per_model counter" in text
    assert "# HELP nv_cache_miss_duration_per_model Total cache miss (insert+lookup) duration per model, in " \
           "microseconds" in text
    assert _metric(text, "nv_cache_num_hits_per_model", "simple_plain") is None
    # The hit is a success but no inference: nv_inference_count counts executed requests only.
    stats = _stats(server, "simple_cached")
    assert _metric(text, "nv_inference_request_success", "simple_cached") == inference["success"]["count"]
    assert _metric(text, "nv_inference_count", "simple_cached") == stats["inference_count"]


def test_a_cached_step_skips_its_execution(server: RunningServer, http: httpclient.InferenceServerClient) -> None:
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 2, np.int32)
    inputs = _ab(a, b)
    first = http.infer("chain_steps_cached", inputs)
    step_before = _counts(server, "add_sub_cached")
    ensemble_before = _counts(server, "chain_steps_cached")
    second = http.infer("chain_steps_cached", _ab(a, b))
    np.testing.assert_array_equal(second.as_numpy("SUM"), first.as_numpy("SUM"))
    np.testing.assert_array_equal(second.as_numpy("SUM"), 2 * a)
    np.testing.assert_array_equal(second.as_numpy("DIFF"), 2 * b)
    step = _counts(server, "add_sub_cached")
    ensemble = _counts(server, "chain_steps_cached")
    # Both steps hit: the step model ran nothing; the ensemble (no cache of its own) ran its steps.
    assert [x - y for x, y in zip(step, step_before, strict=True)] == [2, 2, 0, 0, 0]
    assert [x - y for x, y in zip(ensemble, ensemble_before, strict=True)] == [1, 0, 0, 1, 1]


def test_a_cached_ensemble_runs_no_step_on_a_hit(server: RunningServer, grpc: grpcclient.InferenceServerClient) -> None:
    a, b = np.full((1, 16), 9, np.int32), np.arange(16, dtype=np.int32).reshape(1, 16)
    first = grpc.infer("chain_cached", _ab(a, b, grpcclient))
    step_before = _counts(server, "add_sub_uncached")
    ensemble_before = _counts(server, "chain_cached")
    second = grpc.infer("chain_cached", _ab(a, b, grpcclient))
    np.testing.assert_array_equal(second.as_numpy("SUM"), first.as_numpy("SUM"))
    np.testing.assert_array_equal(second.as_numpy("DIFF"), 2 * b)
    assert _counts(server, "add_sub_uncached") == step_before
    ensemble = _counts(server, "chain_cached")
    assert [x - y for x, y in zip(ensemble, ensemble_before, strict=True)] == [1, 1, 0, 0, 0]


def _ab(a: np.ndarray, b: np.ndarray, module: Any = httpclient) -> list[Any]:
    inputs = [module.InferInput("A", list(a.shape), "INT32"), module.InferInput("B", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


# ---- eviction on a small cache ---------------------------------------------------------------------------------


def test_eviction_by_bytes_least_recently_used_first(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.identity_fp32(repo, "identity_cached", CACHED)
    one = entry_size([_output("OUTPUT0", np.zeros((1, 1000), np.float32))])  # what a 1000-element answer costs
    size = 2 * one + 100  # room for two of them
    with geserve([repo], tmp_path / "server.log", ["--cache-config", f"local,size={size}"]) as server:
        client = httpclient.InferenceServerClient(server.url)
        try:
            def infer(value: float, n: int = 1000) -> None:
                result = client.infer("identity_cached", _fp32_input("INPUT0", np.full((1, n), value, np.float32)))
                assert float(result.as_numpy("OUTPUT0")[0, 0]) == value

            def hits_misses() -> tuple[int, int]:
                _, hits, misses, _, _ = _counts(server, "identity_cached")
                return hits, misses

            infer(1)
            infer(2)  # 1 and 2 stored: the cache is full
            infer(1)  # a hit, and 1 is now the most recently used
            assert hits_misses() == (1, 2)
            infer(3)  # stored by evicting 2, the least recently used, not 1
            infer(1)
            assert hits_misses() == (2, 3)
            infer(2)  # 2 was evicted: a miss, stored by evicting 3 (1 was used after it)
            infer(1)
            assert hits_misses() == (3, 4)
            infer(4, n=3000)  # larger than the whole cache: never stored, and it evicts nothing
            infer(4, n=3000)
            infer(2)
            infer(1)
            assert hits_misses() == (5, 6)
        finally:
            client.close()


# ---- what Triton refuses, and a model that enables the cache on a server without one -----------------------------


def test_refusals_and_a_server_without_a_cache(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "simple_cached", extra=CACHED)
    models.simple(repo, "sequence_cached", extra=f"sequence_batching {{ }}\n{CACHED}")
    for name in ("repeat", "inc"):  # repeat is decoupled
        (repo / name).mkdir()
        (repo / name / "1").mkdir()
        (repo / name / "1" / "model.py").write_bytes((PYTHON_MODELS / name / "1" / "model.py").read_bytes())
        (repo / name / "config.pbtxt").write_text((PYTHON_MODELS / name / "config.pbtxt").read_text())
    (repo / "repeat_cached").mkdir()
    (repo / "repeat_cached" / "1").mkdir()
    (repo / "repeat_cached" / "1" / "model.py").write_bytes((PYTHON_MODELS / "repeat" / "1" / "model.py").read_bytes())
    config = (PYTHON_MODELS / "repeat" / "config.pbtxt").read_text().replace('"repeat"', '"repeat_cached"')
    (repo / "repeat_cached" / "config.pbtxt").write_text(config + f"\n{CACHED}\n")
    decoupled_chain = ensembles.repeat_inc("repeat_inc_cached")
    Ensemble(decoupled_chain.name, decoupled_chain.inputs, decoupled_chain.outputs, decoupled_chain.steps,
             max_batch_size=0, extra=CACHED).write(repo)
    with geserve([repo], tmp_path / "server.log", ["--model-control-mode", "explicit"]) as server:
        client = httpclient.InferenceServerClient(server.url)
        try:
            refusals = {
                "sequence_cached": "Response Cache does not currently support model sequence_cached with sequence "
                                   "batching scheduler. Please disable the response cache.",
                "repeat_cached": "Response Cache does not currently support model repeat_cached with 'decoupled' "
                                 "transaction policy. Please disable the response cache.",
                "repeat_inc_cached": "Response Cache does not currently support model repeat_inc_cached with "
                                     "'decoupled' transaction policy. Please disable the response cache.",
            }
            for name, message in refusals.items():
                with pytest.raises(InferenceServerException) as refused:
                    client.load_model(name)
                assert message in str(refused.value), name
                assert not client.is_model_ready(name)
            # Triton serves a model that enables the cache on a server without one, uncached and without a word.
            client.load_model("simple_cached")
            a, b = np.ones((1, 16), np.int32), np.ones((1, 16), np.int32)
            for _ in range(2):
                np.testing.assert_array_equal(
                    client.infer("simple_cached", _simple_inputs(a, b)).as_numpy("OUTPUT0"), a + b
                )
            assert _counts(server, "simple_cached") == (2, 0, 0, 2, 2)
            assert "nv_cache_num_hits_per_model" not in _scrape(server)
        finally:
            client.close()


def test_a_reloaded_model_does_not_answer_from_the_one_it_replaced(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    models.simple(repo, "simple_cached", extra=CACHED)
    args = ["--model-control-mode", "explicit", "--load-model", "simple_cached", "--cache-config",
            f"local,size={CACHE_SIZE}"]
    with geserve([repo], tmp_path / "server.log", args) as server:
        client = httpclient.InferenceServerClient(server.url)
        try:
            a, b = np.full((1, 16), 2, np.int32), np.full((1, 16), 1, np.int32)
            client.infer("simple_cached", _simple_inputs(a, b))
            client.infer("simple_cached", _simple_inputs(a, b))
            assert _counts(server, "simple_cached")[1:3] == (1, 1)
            # The same version loaded again (its files may have changed, as poll mode would find): a new model
            # whose statistics start afresh, and whose first answer is computed, not taken from the old one's.
            config = repo / "simple_cached" / "config.pbtxt"
            config.write_text(config.read_text() + "\n# changed\n")
            client.load_model("simple_cached")
            client.infer("simple_cached", _simple_inputs(a, b))
            client.infer("simple_cached", _simple_inputs(a, b))
            assert _counts(server, "simple_cached") == (2, 1, 1, 1, 1)
        finally:
            client.close()
