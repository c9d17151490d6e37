"""Tracing in `mode=opentelemetry`: a real server exports its spans over OTLP/HTTP to a real receiver run by the test
(an http.server decoding ExportTraceServiceRequest with opentelemetry-proto). Checked: the span tree (InferRequest >
model > queue / compute, an ensemble's steps under its span), W3C traceparent continued from an HTTP header and from
gRPC metadata, links between the compute spans of requests that shared a batch, the order of the times."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.support import ensembles
from tests.support.server import RunningServer, start_geserve, stop_geserve

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP trace receiver: every span it was sent, with its resource's attributes."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.resources: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                message = ExportTraceServiceRequest()
                message.ParseFromString(body)
                receiver.add(message, self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, message: ExportTraceServiceRequest, path: str) -> None:
        assert path == "/v1/traces"
        with self._lock:
            for resource_spans in message.resource_spans:
                self.resources.append({a.key: a.value.string_value for a in resource_spans.resource.attributes})
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({
                            "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(), "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "events": {e.name: e.time_unix_nano for e in span.events},
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        })

    def wait_for(self, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"{len(self.spans)} spans received, {count} expected: {self.spans}")

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.close()


@pytest.fixture(scope="module")
def server(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("otel")
    repo = root / "models"
    ensembles.add_sub(repo, "simple")
    ensembles.chain("chain", "simple").write(repo)
    # A batching copy that waits for four requests (or 2 s): one execution, four requests.
    ensembles.add_sub(repo, "batched", extra="dynamic_batching { preferred_batch_size: [ 4 ] "
                                             "max_queue_delay_microseconds: 2000000 }")
    args = ["--trace-config", "mode=opentelemetry", "--trace-config", f"opentelemetry,url={receiver.url}",
            "--trace-config", "rate=1", "--trace-config", "level=TIMESTAMPS",
            "--trace-config", "opentelemetry,bsp_schedule_delay=50",
            "--trace-config", "opentelemetry,resource=service.name=geserve-under-test"]
    running = start_geserve([repo], root / "geserve.log", args)
    yield running
    stop_geserve(running)


def _inputs(module: Any, names: tuple[str, str] = ("INPUT0", "INPUT1")) -> list[Any]:
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in names]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    return inputs


def _tree(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    return by_name


def _check_request(spans: list[dict[str, Any]], model: str = "simple") -> dict[str, dict[str, Any]]:
    """One request's spans: InferRequest > model > (queue, compute), every time in order."""
    named = {span["name"]: span for span in spans}
    top, model_span, queue, compute = named["InferRequest"], named[model], named["queue"], named["compute"]
    assert model_span["parent"] == top["span_id"]
    assert queue["parent"] == compute["parent"] == model_span["span_id"]
    assert len({s["trace_id"] for s in spans}) == 1
    assert top["start"] <= model_span["start"] <= queue["start"] <= queue["end"] <= compute["start"]
    assert compute["start"] <= compute["end"] <= model_span["end"] <= top["end"]
    events = model_span["events"]
    assert events["REQUEST_START"] <= events["QUEUE_START"] <= events["REQUEST_END"]
    assert compute["start"] <= compute["events"]["COMPUTE_INPUT_END"] <= compute["events"]["COMPUTE_OUTPUT_START"]
    assert compute["events"]["COMPUTE_OUTPUT_START"] <= compute["end"]
    assert model_span["attributes"]["triton.model_name"] == model
    return named


def test_http_request_continues_traceparent(server: RunningServer, receiver: Receiver) -> None:
    receiver.clear()
    header = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}
    httpclient.InferenceServerClient(server.url).infer("simple", _inputs(httpclient), headers=header)
    named = _check_request(receiver.wait_for(4))
    top = named["InferRequest"]
    assert top["trace_id"] == TRACE_ID and top["parent"] == PARENT_SPAN
    events = top["events"]
    assert events["HTTP_RECV_START"] <= events["HTTP_RECV_END"] <= named["simple"]["start"]
    assert named["simple"]["end"] <= events["HTTP_SEND_START"] <= events["HTTP_SEND_END"]
    assert receiver.resources[-1]["service.name"] == "geserve-under-test"
    assert abs(top["start"] / 1e9 - time.time()) < 60  # on the wall clock


def test_grpc_request_continues_traceparent_from_metadata(server: RunningServer, receiver: Receiver) -> None:
    receiver.clear()
    header = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}
    grpcclient.InferenceServerClient(server.grpc_url).infer("simple", _inputs(grpcclient), headers=header)
    named = _check_request(receiver.wait_for(4))
    assert named["InferRequest"]["trace_id"] == TRACE_ID and named["InferRequest"]["parent"] == PARENT_SPAN
    assert {"GRPC_WAITREAD_START", "GRPC_SEND_END"} <= named["InferRequest"]["events"].keys()


def test_untraced_parent_starts_a_new_trace(server: RunningServer, receiver: Receiver) -> None:
    receiver.clear()
    httpclient.InferenceServerClient(server.url).infer("simple", _inputs(httpclient))
    named = _check_request(receiver.wait_for(4))
    assert named["InferRequest"]["parent"] == "" and named["InferRequest"]["trace_id"] != TRACE_ID


def test_ensemble_steps_are_children_of_the_ensemble_span(server: RunningServer, receiver: Receiver) -> None:
    receiver.clear()
    httpclient.InferenceServerClient(server.url).infer("chain", _inputs(httpclient, ("A", "B")))
    spans = receiver.wait_for(2 + 2 * 3)  # InferRequest + chain, and per step: model, queue, compute
    by_name = _tree(spans)
    (top,), (ensemble,) = by_name["InferRequest"], by_name["chain"]
    assert ensemble["parent"] == top["span_id"]
    steps = sorted(by_name["simple"], key=lambda s: s["start"])
    assert len(steps) == 2 and all(step["parent"] == ensemble["span_id"] for step in steps)
    assert all(step["attributes"]["triton.parent_id"] == ensemble["attributes"]["triton.trace_id"] for step in steps)
    assert ensemble["start"] <= steps[0]["start"] <= steps[0]["end"] <= steps[1]["start"] <= steps[1]["end"]
    assert steps[1]["end"] <= ensemble["end"]
    assert len({s["trace_id"] for s in spans}) == 1


def test_batched_execution_links_the_spans_that_shared_it(server: RunningServer, receiver: Receiver) -> None:
    receiver.clear()
    client = httpclient.InferenceServerClient(server.url, concurrency=4)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: client.infer("batched", _inputs(httpclient)), range(4)))
    spans = receiver.wait_for(16)
    computes = _tree(spans)["compute"]
    assert len(computes) == 4
    ids = {(c["trace_id"], c["span_id"]) for c in computes}
    for compute in computes:
        assert compute["attributes"]["geserve.batch_requests"] == 4
        assert set(compute["links"]) == ids - {(compute["trace_id"], compute["span_id"])}
    assert len({c["start"] for c in computes}) == 1  # one execution: the same compute span times
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    assert len(by_trace) == 4
    for request_spans in by_trace.values():
        _check_request(request_spans, "batched")
