"""Tracing in `mode=triton` (service/tracing/): the --trace-config syntax, the settings and their sampling, the trace
file a real server writes (timestamps in order, TENSORS, an ensemble's steps as child traces) and the trace setting
endpoints answered as the real Triton answers them (side by side, when the reference is installed); with --workers,
one trace file and one count for the whole server."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb

from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.service.tracing.config import TraceConfigError, parse_trace_config
from geserve.service.tracing.ledger import Ledger
from geserve.service.tracing.settings import TraceSettings
from geserve.service.tracing.trace import Trace
from geserve.service.tracing.trace_file import TraceFile
from tests.support import ensembles
from tests.support.reference import BootingTriton, build_python_backend_repository, reference_available
from tests.support.server import RunningServer, start_geserve, stop_geserve

ORDER = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
         "REQUEST_END")
HTTP_ORDER = ("HTTP_RECV_START", "HTTP_RECV_END", *ORDER, "HTTP_SEND_START", "HTTP_SEND_END")
GRPC_ORDER = ("GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *ORDER, "GRPC_SEND_START", "GRPC_SEND_END")
X = np.arange(16, dtype=np.int32).reshape(1, 16)
Y = np.full((1, 16), 3, dtype=np.int32)


# ---- the flag and the settings, without a server ------------------------------------------------------------


def test_trace_config_syntax() -> None:
    config = parse_trace_config([
        "triton,file=/tmp/t.json", "triton,log-frequency=50", "rate=100", "level=TIMESTAMPS", "level=TENSORS",
        "count=-1", "opentelemetry,url=http://collector:4318/v1/traces", "opentelemetry,resource=service.name=a",
        "opentelemetry,resource=deployment=b", "opentelemetry,bsp_schedule_delay=100",
    ])
    assert (config.mode, config.rate, config.count, config.file, config.log_frequency) == (
        "triton", 100, -1, "/tmp/t.json", 50)
    assert config.level == ("TIMESTAMPS", "TENSORS")
    assert config.url == "http://collector:4318/v1/traces" and config.bsp_schedule_delay == 100
    assert config.resource == {"service.name": "a", "deployment": "b"}
    assert parse_trace_config(["level=TIMESTAMPS", "level=OFF"]).level == ("OFF",)
    assert parse_trace_config(["mode=opentelemetry"]).mode == "opentelemetry"
    for bad in ("rate", "rate=x", "file=/x", "triton,url=x", "jaeger,url=x", "level=ALL", "count=-2", "mode=zipkin",
                "opentelemetry,resource=novalue"):
        with pytest.raises(TraceConfigError):
            parse_trace_config([bad])


def test_settings_sample_every_rate_th_request_until_count_runs_out() -> None:
    settings = TraceSettings(parse_trace_config(["triton,file=/tmp/t.json", "rate=3", "level=TIMESTAMPS",
                                                 "count=2"]))
    scope = settings.scope("m")
    assert [scope.sample() for _ in range(9)] == [0, 0, 1, 0, 0, 1, 0, 0, 0]
    assert settings.get()["trace_count"] == ["0"] and not settings.on
    settings.update({"trace_count": ["-1"], "trace_rate": ["1"]}, "m")  # the model's own scope, its own counters
    assert settings.on and settings.get("m")["trace_count"] == ["-1"] and settings.get()["trace_count"] == ["0"]
    assert all(settings.scope("m").sample() for _ in range(5))
    assert settings.update({"trace_level": ["OFF"]})["trace_level"] == ["OFF"]
    assert settings.get("m")["trace_level"] == ["OFF"]  # not overridden by the model: the global value


def test_settings_refuse_as_triton() -> None:
    settings = TraceSettings(parse_trace_config(["triton,file=/tmp/t.json"]))
    refusals = [
        ({"trace_level": ["TIMESTAMPS", "OFF"]}, "Expect only one trace level 'OFF' is specified"),
        ({"trace_rate": ["x"]}, "Unable to parse 'trace_rate', got: x"),
        ({"trace_count": ["-2"]}, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
    ]
    for changes, message in refusals:
        with pytest.raises(InvalidArgumentError) as info:
            settings.update(changes)
        assert info.value.message == message
    settings.update({"trace_rate": ["0"]})
    with pytest.raises(InvalidArgumentError, match="sample rate must be non-zero"):
        settings.update({"trace_level": ["TIMESTAMPS"]})
    with pytest.raises(UnsupportedError, match="can not be updated through network protocol"):
        settings.update({"trace_file": ["/tmp/other.json"]})
    assert settings.update({"trace_rate": ["-1"]})["trace_rate"] == ["4294967295"]  # unsigned, as Triton reads it
    settings.update({"trace_rate": ["1"], "trace_level": ["TIMESTAMPS"]})
    assert settings.update({"trace_level": ["BOGUS"]})["trace_level"] == ["TIMESTAMPS"]  # unknown: left as it is


# ---- the trace file a real server writes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trace_repo")
    ensembles.add_sub(root, "simple")
    ensembles.chain("chain", "simple").write(root)
    return root


def _trace_args(path: Path, *extra: str) -> list[str]:
    return ["--trace-config", f"triton,file={path}", "--trace-config", "rate=1", *extra]


def _inputs(module: Any, names: tuple[str, str] = ("INPUT0", "INPUT1")) -> list[Any]:
    inputs = [module.InferInput(names[0], [1, 16], "INT32"), module.InferInput(names[1], [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(X)
    inputs[1].set_data_from_numpy(Y)
    return inputs


def _traces(path: Path) -> dict[int, dict[str, Any]]:
    """The file's objects gathered by trace id: header, timestamps (name -> ns, and their order), tensors."""
    traces: dict[int, dict[str, Any]] = {}
    for entry in json.loads(path.read_text()):
        trace = traces.setdefault(entry["id"], {"times": {}, "order": [], "tensors": []})
        if "model_name" in entry:
            trace["header"] = entry
        elif "timestamps" in entry:
            for stamp in entry["timestamps"]:
                trace["times"][stamp["name"]] = stamp["ns"]
                trace["order"].append(stamp["name"])
        else:
            trace["tensors"].append((entry["activity"], entry["tensor"]))
    return traces


def _in_order(times: dict[str, int], names: tuple[str, ...]) -> None:
    assert set(names) <= times.keys(), set(names) - times.keys()
    stamps = [times[n] for n in names]
    assert stamps == sorted(stamps), list(zip(names, stamps, strict=True))


@pytest.fixture
def traced(repo: Path, tmp_path: Path) -> Iterator[tuple[RunningServer, Path]]:
    path = tmp_path / "trace.json"
    server = start_geserve([repo], tmp_path / "geserve.log",
                           _trace_args(path, "--trace-config", "level=TIMESTAMPS", "--trace-config", "level=TENSORS"))
    try:
        yield server, path
    finally:
        stop_geserve(server)


def test_trace_file_timestamps_tensors_and_ensemble_children(traced: tuple[RunningServer, Path]) -> None:
    server, path = traced
    http = httpclient.InferenceServerClient(server.url)
    result = http.infer("simple", _inputs(httpclient), request_id="req-1")
    http.infer("chain", _inputs(httpclient, ("A", "B")))
    grpcclient.InferenceServerClient(server.grpc_url).infer("simple", _inputs(grpcclient))
    assert stop_geserve(server) == 0  # log-frequency 0: the file is written when the server stops, as Triton's
    traces = _traces(path)
    by_model: dict[str, list[dict[str, Any]]] = {}
    for trace in traces.values():
        by_model.setdefault(trace["header"]["model_name"], []).append(trace)
    assert len(by_model["chain"]) == 1 and len(by_model["simple"]) == 4  # two calls, two ensemble steps

    over_http, *steps, over_grpc = sorted(by_model["simple"], key=lambda t: t["times"]["REQUEST_START"])
    assert over_http["header"] == {"id": over_http["header"]["id"], "model_name": "simple", "model_version": 1,
                                   "request_id": "req-1"}
    _in_order(over_http["times"], HTTP_ORDER)
    _in_order(over_grpc["times"], GRPC_ORDER)
    tensors = {(activity, t["name"]): t for activity, t in over_http["tensors"]}
    assert tensors["TENSOR_QUEUE_INPUT", "INPUT0"] == {
        "name": "INPUT0", "data": ",".join(map(str, X.ravel())), "shape": "1,16", "dtype": "INT32"}
    assert tensors["TENSOR_BACKEND_OUTPUT", "OUTPUT0"]["data"] == ",".join(
        map(str, result.as_numpy("OUTPUT0").ravel()))
    assert tensors["TENSOR_BACKEND_OUTPUT", "OUTPUT1"]["data"] == ",".join(map(str, (X - Y).ravel()))

    (ensemble,) = by_model["chain"]
    _in_order(ensemble["times"], ("HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "REQUEST_END",
                                  "HTTP_SEND_START", "HTTP_SEND_END"))
    for step in steps:
        assert step["header"]["parent_id"] == ensemble["header"]["id"]
        _in_order(step["times"], ORDER)
        assert ensemble["times"]["REQUEST_START"] <= step["times"]["REQUEST_START"]
        assert step["times"]["REQUEST_END"] <= ensemble["times"]["REQUEST_END"]
    assert steps[0]["times"]["REQUEST_END"] <= steps[1]["times"]["REQUEST_START"]  # the chain runs in order
    first_inputs = {t["name"]: t["data"] for a, t in steps[0]["tensors"] if a == "TENSOR_QUEUE_INPUT"}
    assert first_inputs == {"INPUT0": ",".join(map(str, X.ravel())), "INPUT1": ",".join(map(str, Y.ravel()))}


def test_log_frequency_count_and_run_time_changes(repo: Path, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    args = _trace_args(path, "--trace-config", "triton,log-frequency=2")
    server = start_geserve([repo], tmp_path / "geserve.log", args)
    try:
        http = httpclient.InferenceServerClient(server.url)
        http.infer("simple", _inputs(httpclient))
        assert not list(tmp_path.glob("trace.json*"))  # level OFF: nothing traced
        # Per model at run time: `simple` traced, twice more, the global settings untouched.
        changed = http.update_trace_settings("simple", {"trace_level": ["TIMESTAMPS"], "trace_count": "2"})
        assert changed["trace_level"] == ["TIMESTAMPS"] and changed["trace_count"] == "2"
        assert http.get_trace_settings()["trace_level"] == ["OFF"]
        for _ in range(3):
            http.infer("simple", _inputs(httpclient))
        assert http.get_trace_settings("simple")["trace_count"] == "0"  # what is left, as Triton reports it
        deadline = time.monotonic() + 5
        while not (tmp_path / "trace.json.0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        traces = _traces(tmp_path / "trace.json.0")  # log-frequency 2: every two traces, a file <file>.<index>
        assert len(traces) == 2 and all(_in_order(t["times"], HTTP_ORDER) is None for t in traces.values())
        assert all(not t["tensors"] for t in traces.values())  # TIMESTAMPS only
    finally:
        stop_geserve(server)
    assert not (tmp_path / "trace.json.1").exists()


# ---- the setting endpoints, side by side with the real Triton ------------------------------------------------


def _call(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# (method, path, body): run in this order on both servers; each answer (status and JSON) must be the same.
SETTING_CALLS: list[tuple[str, str, Any]] = [
    ("GET", "/v2/trace/setting", None),
    ("GET", "/v2/models/simple/trace/setting", None),
    ("POST", "/v2/models/simple/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/models/simple/trace/setting", {"trace_level": ["TIMESTAMPS", "OFF"]}),
    ("POST", "/v2/models/simple/trace/setting", {"trace_level": ["BOGUS"]}),
    ("POST", "/v2/trace/setting", {"trace_count": "-2"}),
    ("POST", "/v2/trace/setting", {"log_frequency": "-1"}),
    ("POST", "/v2/trace/setting", {"trace_file": "/tmp/elsewhere.json"}),
    ("POST", "/v2/trace/setting", {"trace_mode": "opentelemetry"}),
    ("POST", "/v2/models/simple/trace/setting", {"trace_rate": "0"}),
    ("POST", "/v2/models/simple/trace/setting", {"trace_level": ["TENSORS"]}),
    ("POST", "/v2/models/simple/trace/setting", {"trace_rate": None, "trace_level": None}),
    ("POST", "/v2/trace/setting", {"trace_rate": "1", "trace_level": ["TIMESTAMPS"], "trace_count": "2"}),
    ("GET", "/v2/models/simple/trace/setting", None),
    ("INFER", "simple", 3),  # three requests sampled at rate 1 with two traces left: the count left is reported
    ("GET", "/v2/models/simple/trace/setting", None),
    ("GET", "/v2/trace/setting", None),
    ("POST", "/v2/trace/setting", {"log_frequency": None, "trace_rate": None}),
]


def test_setting_endpoints_as_triton(repo: Path, tmp_path: Path) -> None:
    if not reference_available():
        pytest.skip("reference Triton unavailable")
    source = tmp_path / "onnx"
    ensembles.add_sub(source, "simple")
    python_repo = build_python_backend_repository(source, tmp_path / "python", ["simple"])
    args = ["--trace-config", f"triton,file={tmp_path / 'shared.json'}", "--trace-config", "rate=5"]
    triton = BootingTriton(python_repo, tmp_path, extra_args=args)
    try:
        server = start_geserve([source], tmp_path / "geserve.log", args)
        try:
            triton.wait()
            for method, path, body in SETTING_CALLS:
                if method == "INFER":
                    for address in (triton.http, server.url):
                        client = httpclient.InferenceServerClient(address)
                        for _ in range(body):
                            client.infer(path, _inputs(httpclient))
                    continue
                theirs = _call(triton.url, method, path, body)
                ours = _call(server.base, method, path, body)
                assert ours == theirs, (method, path, body, ours, theirs)
            for model in ("", "simple"):
                request = pb.TraceSettingRequest(model_name=model)
                request.settings["trace_count"].value.append("-5")
                errors = []
                for address in (triton.grpc, server.grpc_url):
                    client = grpcclient.InferenceServerClient(address)
                    try:
                        client._client_stub.TraceSetting(request)
                    except Exception as exc:  # grpc.RpcError
                        errors.append((exc.code(), exc.details()))  # type: ignore[attr-defined]
                    answers = client.get_trace_settings(model, as_json=True)
                    errors.append(answers)
                assert errors[0] == errors[2] and errors[1] == errors[3]
        finally:
            stop_geserve(server)
    finally:
        triton.stop()


def test_file_written_when_the_count_runs_out(repo: Path, tmp_path: Path) -> None:
    """log-frequency 0: Triton writes the file when the last trace asked for is taken, not only at exit."""
    path = tmp_path / "trace.json"
    server = start_geserve([repo], tmp_path / "geserve.log",
                           _trace_args(path, "--trace-config", "level=TIMESTAMPS", "--trace-config", "count=1"))
    try:
        http = httpclient.InferenceServerClient(server.url)
        http.infer("chain", _inputs(httpclient, ("A", "B")))  # one trace, with its two steps as children
        http.infer("simple", _inputs(httpclient))  # no trace left to take
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        headers = [trace["header"] for trace in _traces(path).values()]
        assert sorted(h["model_name"] for h in headers) == ["chain", "simple", "simple"]
        assert http.get_trace_settings()["trace_count"] == "0"
    finally:
        stop_geserve(server)


# ---- --workers: one server, one trace file ------------------------------------------------------------------


def test_ledgers_on_one_file_number_count_and_start_as_one(tmp_path: Path) -> None:
    """What two workers share (service/tracing/ledger.py), here two ledgers on one file: ids, `<index>` numbers, the
    count (a restarted worker's second creation of a count keeps its value), and one start of the trace file."""
    first, second = Ledger(str(tmp_path / "ledger")), Ledger(str(tmp_path / "ledger"))
    assert [first.next_id(), second.next_id(), first.next_id()] == [1, 2, 3]
    assert [second.next_index(), first.next_index()] == [0, 1]
    count, again = first.remaining(2), second.remaining(5)  # the same (first) count cell of each
    assert [count.take(), again.take(), count.take()] == [True, True, False] and again.left == 0
    unlimited = first.remaining(-1)
    assert all(unlimited.take() for _ in range(3)) and second.remaining(7).left == -1
    assert [first.start_file(), second.start_file(), first.start_file()] == [True, False, False]


def test_trace_files_of_two_workers_append_to_one_array(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("left by an earlier run")
    ledgers = [Ledger(str(tmp_path / "ledger")) for _ in range(2)]
    files = [TraceFile(str(path), ledger) for ledger in ledgers]
    for index in range(6):
        ledger, writer = ledgers[index % 2], files[index % 2]
        trace = Trace(lambda _: None, 1, None, ids=ledger.next_id)
        trace.request_id = f"r{index}"
        trace.mark("REQUEST_START")
        writer.add(trace, 0)
        headers = [e for e in json.loads(path.read_text()) if "request_id" in e]  # a whole array after every write
        assert [h["id"] for h in headers] == list(range(1, index + 2))
    for writer in files:
        writer.close()


def test_workers_write_one_trace_file_with_every_request(repo: Path, tmp_path: Path) -> None:
    """--workers 2: the file named holds every request's trace, whichever worker served it, numbered as one
    server's; trace_count, changed at run time, counts the server's traces."""
    path = tmp_path / "trace.json"
    server = start_geserve([repo], tmp_path / "geserve.log",
                           ["--workers", "2", *_trace_args(path, "--trace-config", "level=TIMESTAMPS")])
    try:
        workers = server.children()
        assert len(workers) == 2
        sent = _infer_on_new_connections(server, [f"r{i}" for i in range(16)])
        headers = _wait_for_headers(path, len(sent))
        assert sorted(h["request_id"] for h in headers) == sorted(sent)
        assert all(str(path) in _open_files(pid) for pid in workers)  # both workers wrote to it
        _three_more_traces_for_the_server(server, path, len(sent))
    finally:
        assert stop_geserve(server) == 0
    assert len(_wait_for_headers(path, len(sent) + 3)) == len(sent) + 3
    assert [p.name for p in tmp_path.glob("trace.json*")] == ["trace.json"]  # no `<file>.w<index>`


def _three_more_traces_for_the_server(server: RunningServer, path: Path, before: int) -> None:
    """trace_count 3, set at run time: three traces in all, whichever workers take them, then none on any."""
    changed = httpclient.InferenceServerClient(server.url).update_trace_settings(settings={"trace_count": "3"})
    assert changed["trace_count"] == "3"
    _infer_on_new_connections(server, [f"c{i}" for i in range(8)])
    headers = _wait_for_headers(path, before + 3)
    assert sorted(h["id"] for h in headers) == list(range(1, before + 4))  # numbered as one server's
    left = {httpclient.InferenceServerClient(server.url).get_trace_settings()["trace_count"] for _ in range(4)}
    assert left == {"0"}


def _infer_on_new_connections(server: RunningServer, request_ids: list[str]) -> list[str]:
    """Each request on a new connection (the supervisor hands each to the worker holding fewest)."""
    for request_id in request_ids:
        client = httpclient.InferenceServerClient(server.url)
        client.infer("simple", _inputs(httpclient), request_id=request_id)
        client.close()
    return request_ids


def _wait_for_headers(path: Path, count: int) -> list[dict[str, Any]]:
    """The trace headers in the file once it holds `count` (a trace is written after its response is sent)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            headers = [t["header"] for t in _traces(path).values()] if path.exists() else []
        except ValueError:  # read while a worker's write was half copied: the next read sees it whole
            headers = []
        if len(headers) >= count or time.monotonic() > deadline:
            return headers
        time.sleep(0.05)


def _open_files(pid: int) -> set[str]:
    files = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            files.add(os.readlink(fd))
    return files
