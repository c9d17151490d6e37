"""Prometheus metrics: the pieces in isolation, then /metrics of real server processes after known traffic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from geserve.errors import CancelledError, InternalError, InvalidArgumentError, UnavailableError
from geserve.metrics import MetricsConfig, render
from geserve.metrics.collector import batch_bounds
from geserve.metrics.config import DEFAULT_QUANTILES
from geserve.metrics.latency import BucketHistogram, LatencyRecorder, WindowedQuantiles
from geserve.metrics.system import CpuSampler
from geserve.statistics import FAILURE_REASONS, ModelStatistics, failure_reason
from tests.support import models
from tests.support.reference import free_port
from tests.support.server import REPO_ROOT, RunningServer, geserve

Families = dict[str, list]  # family name -> its parsed samples

# ------------------------------------------------------------------------------------------- units


def test_metrics_config_parses_tritons_keys() -> None:
    assert MetricsConfig.from_pairs({}) == MetricsConfig()
    assert MetricsConfig().summary_quantiles == DEFAULT_QUANTILES and not MetricsConfig().observes_latencies
    config = MetricsConfig.from_pairs({
        "summary_latencies": "true", "summary_quantiles": "0.5:0.05,0.9:0.01,0.99:0.001",
        "counter_latencies": "false", "histogram_latencies": "true", "some_future_key": "x",
    })
    assert config.summary_latencies and config.histogram_latencies and not config.counter_latencies
    assert config.summary_quantiles == ((0.5, 0.05), (0.9, 0.01), (0.99, 0.001))
    for bad in ({"summary_latencies": "maybe"}, {"summary_quantiles": "0.5"}, {"summary_quantiles": "2:0.1"}):
        with pytest.raises(ValueError, match="--metrics-config"):
            MetricsConfig.from_pairs(bad)


def test_failure_reasons_follow_the_error() -> None:
    assert failure_reason(UnavailableError("queue full")) == "REJECTED"
    assert failure_reason(CancelledError("cancelled")) == "CANCELED"
    assert failure_reason(InternalError("onnxruntime failed")) == "BACKEND"
    assert failure_reason(InvalidArgumentError("bad")) == "OTHER"
    assert failure_reason(None) == "OTHER"
    tagged = InvalidArgumentError("the backend refused it", failure_reason="BACKEND")
    assert failure_reason(tagged) == "BACKEND"


def test_statistics_count_failures_by_reason_and_feed_an_observer() -> None:
    stats = ModelStatistics()
    assert stats.latency_observer is None  # off unless latency summaries / histograms are configured
    stats.record_request(False, 10, reason="REJECTED")
    stats.record_failure(10, InternalError("execution failed"))  # the reason comes from the error
    stats.record_request(True, 10)
    assert stats.failures_by_reason() == {
        "REJECTED": 1, "CANCELED": 0, "BACKEND": 1, "OTHER": 0, "DEADLINE_EXCEEDED": 0}
    assert stats.as_json("m", "1")["inference_stats"]["fail"]["count"] == 2

    config = MetricsConfig(summary_latencies=True, histogram_latencies=True)
    observed = ModelStatistics(LatencyRecorder(config))
    recorder = observed.latency_observer
    assert isinstance(recorder, LatencyRecorder)
    observed.record_request(True, 3_000_000)
    observed.record_request(False, 9_000_000, reason="OTHER")  # failures are not in the latency summaries
    observed.record_execution(2, 3, [1000, 3000], 2000, 5000, 1000)
    assert recorder.summaries["request"].snapshot([0.5])[:2] == (1, 3000)
    assert recorder.summaries["queue"].snapshot([0.5])[:2] == (2, 4)
    assert recorder.summaries["compute_infer"].snapshot([0.5]) == (2, 10, [5.0])
    assert recorder.first_response is not None and recorder.first_response.snapshot() == ([1, 1, 1, 1, 1], 3.0)


def test_windowed_quantiles_and_histogram() -> None:
    window = WindowedQuantiles()
    assert all(math.isnan(v) for v in window.snapshot([0.5, 0.9])[2])
    for value in range(1, 101):
        window.observe(value)
    count, total, (median, p90, p99) = window.snapshot([0.5, 0.9, 0.99])
    assert (count, total, median, p90, p99) == (100, 5050, 50, 90, 99)
    sampled = WindowedQuantiles(cap=64)  # past the cap, a uniform sample stands for the window
    for value in range(10_000):
        sampled.observe(value % 100)
    count, _, (median,) = sampled.snapshot([0.5])
    assert count == 10_000 and 10 <= median <= 90
    histogram = BucketHistogram([1, 4, 2])
    for value in (0.5, 1, 3, 7):
        histogram.observe(value)
    assert histogram.bounds == (1, 2, 4) and histogram.snapshot() == ([2, 2, 3, 4], 11.5)


def test_batch_size_bounds() -> None:
    assert batch_bounds(0) == [1]
    assert batch_bounds(1) == [1]
    assert batch_bounds(8) == [1, 2, 4, 8]
    assert batch_bounds(12) == [1, 2, 4, 8, 12]


def test_exposition_keeps_tritons_counter_names() -> None:
    class One:
        def collect(self):
            from prometheus_client.core import Metric

            family = Metric("nv_inference_count", "Number of inferences", "counter")
            family.add_sample("nv_inference_count", {"model": 'a"b', "version": "1"}, 3.0)
            yield family
            yield Metric("empty", "no samples: not written", "gauge")

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    text = render(registry).decode()
    assert text == (
        "# HELP nv_inference_count Number of inferences\n"
        "# TYPE nv_inference_count counter\n"
        'nv_inference_count{model="a\\"b",version="1"} 3\n'
    )
    (family,) = text_string_to_metric_families(text)
    assert family.name == "nv_inference_count" and family.type == "counter"


def test_cpu_sampler_reads_proc(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n")
    (tmp_path / "meminfo").write_text("MemTotal:  1000 kB\nMemFree: 10 kB\nMemAvailable:  250 kB\n")
    sampler = CpuSampler(tmp_path)
    assert sampler.available
    first = sampler.sample()
    assert first is not None and first.utilization == 0.0  # no interval yet
    assert (first.memory_total_bytes, first.memory_used_bytes) == (1024_000, 750 * 1024)
    (tmp_path / "stat").write_text("cpu  160 0 120 780 100 0 0 0 0 0\n")  # +80 busy of +160 jiffies
    second = sampler.sample()
    assert second is not None and second.utilization == 0.5


# ------------------------------------------------------------------------------------ real servers


def _add_any(repo: Path) -> None:
    """`add_any`: OUTPUT0 = INPUT0 + INPUT1 over variable-length INT32 rows; unequal lengths fail in the
    model (ONNX Runtime cannot broadcast them), after validation let the request through."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"])],
        "add_any",
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, ["batch", "a"]),
         helper.make_tensor_value_info("INPUT1", TensorProto.INT32, ["batch", "b"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, ["batch", "c"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / "add_any" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "add_any" / "1" / "model.onnx"))
    (repo / "add_any" / "config.pbtxt").write_text("""
name: "add_any"
backend: "onnxruntime"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ -1 ] }
]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
""")


@pytest.fixture(scope="module")
def metrics_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("metrics") / "models"
    repo.mkdir()
    models.simple(repo)
    _add_any(repo)
    broken = models.simple(repo, "broken")
    (broken / "1" / "model.onnx").write_bytes(b"not an onnx file")
    return repo


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def _infer(server: RunningServer, model: str, rows: int, width0: int = 16, width1: int = 16) -> int:
    inputs = [
        {"name": name, "datatype": "INT32", "shape": [rows, width], "data": list(range(rows * width))}
        for name, width in (("INPUT0", width0), ("INPUT1", width1))
    ]
    request = urllib.request.Request(
        f"{server.base}/v2/models/{model}/infer", json.dumps({"inputs": inputs}).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _scrape(port: int) -> Families:
    status, headers, body = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    assert headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {family.name: family.samples for family in text_string_to_metric_families(body.decode())}


def _value(families: Families, name: str, **labels: str) -> float:
    """The one sample of `name` (a family, or a family's `_bucket` / `_sum` / `_count`) with these labels."""
    family = name
    for suffix in ("_bucket", "_count", "_sum"):
        if name not in families and name.endswith(suffix):
            family = name[: -len(suffix)]
    matches = [
        s.value for s in families[family]
        if s.name in (name, name + "_total") and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (name, labels, families.get(family))
    return matches[0]


@pytest.fixture(scope="module")
def traffic_server(metrics_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, int]]:
    port = free_port()
    log = tmp_path_factory.mktemp("metrics-logs") / "geserve.log"
    with geserve([metrics_repo], log, ["--metrics-port", str(port), "--metrics-interval-ms", "100"]) as server:
        assert _infer(server, "simple", 1) == 200
        assert _infer(server, "simple", 1) == 200
        assert _infer(server, "simple", 3) == 200
        assert _infer(server, "simple", 9) == 400  # refused before the model: no failure (as Triton)
        assert _infer(server, "add_any", 1, 3, 5) == 500  # reaches the model, which fails
        yield server, port


def test_metrics_count_known_traffic_exactly(traffic_server: tuple[RunningServer, int]) -> None:
    server, port = traffic_server
    families = _scrape(port)
    simple = {"model": "simple", "version": "1"}
    assert _value(families, "nv_inference_request_success", **simple) == 3
    for reason in FAILURE_REASONS:
        assert _value(families, "nv_inference_request_failure", reason=reason, **simple) == 0
    assert _value(families, "nv_inference_count", **simple) == 5
    assert _value(families, "nv_inference_exec_count", **simple) == 3
    assert _value(families, "nv_inference_pending_request_count", **simple) == 0
    assert _value(families, "nv_model_load_duration_secs", **simple) > 0

    add_any = {"model": "add_any", "version": "1"}
    assert _value(families, "nv_inference_request_success", **add_any) == 0
    expected = {"REJECTED": 0, "CANCELED": 0, "BACKEND": 1, "OTHER": 0, "DEADLINE_EXCEEDED": 0}
    for reason, count in expected.items():
        assert _value(families, "nv_inference_request_failure", reason=reason, **add_any) == count

    # The same figures as /stats reports.
    _, _, body = _get(server.base + "/v2/models/simple/stats")
    stats = json.loads(body)["model_stats"][0]
    assert stats["inference_count"] == 5 and stats["inference_stats"]["success"]["count"] == 3
    for family, key in (("request", "success"), ("queue", "queue"), ("compute_input", "compute_input"),
                        ("compute_infer", "compute_infer"), ("compute_output", "compute_output")):
        microseconds = _value(families, f"nv_inference_{family}_duration_us", **simple)
        assert microseconds == stats["inference_stats"][key]["ns"] // 1000

    buckets = {"1": 2, "2": 2, "4": 3, "8": 3, "+Inf": 3}
    for bound, count in buckets.items():
        assert _value(families, "ge_batch_size_bucket", le=bound, **simple) == count
    assert _value(families, "ge_batch_size_sum", **simple) == 5
    assert _value(families, "ge_batch_size_count", **simple) == 3

    assert _value(families, "ge_model_instances", **simple) == 1
    assert _value(families, "ge_model_state", state="READY", **simple) == 1
    assert _value(families, "ge_model_state", state="UNAVAILABLE", **simple) == 0
    # A model that failed before any version was tried reports its state with an empty version.
    assert _value(families, "ge_model_state", model="broken", version="", state="UNAVAILABLE") == 1
    assert not any(s.labels.get("model") == "broken" for s in families["nv_inference_request_success"])

    assert 0.0 <= _value(families, "nv_cpu_utilization") <= 1.0
    assert 0 < _value(families, "nv_cpu_memory_used_bytes") < _value(families, "nv_cpu_memory_total_bytes")
    assert not [name for name in families if "summary" in name or "first_response" in name]


def test_metrics_endpoint_answers_only_metrics(traffic_server: tuple[RunningServer, int]) -> None:
    server, port = traffic_server
    assert _get(f"http://127.0.0.1:{port}/v2/health/live")[0] == 404
    assert _get(server.base + "/metrics")[0] == 404  # not on the inference port, as in Triton
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", b"", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405


def test_summaries_and_histograms_only_when_configured(metrics_repo: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ["--metrics-port", str(port), "--metrics-config", "summary_latencies=true",
            "--metrics-config", "summary_quantiles=0.5:0.05,0.99:0.001",
            "--metrics-config", "histogram_latencies=true", "--metrics-config", "counter_latencies=false"]
    with geserve([metrics_repo], tmp_path / "log", args) as server:
        assert _infer(server, "simple", 2) == 200
        assert _infer(server, "simple", 1) == 200
        families = _scrape(port)
    simple = {"model": "simple", "version": "1"}
    assert _value(families, "nv_inference_request_summary_us_count", **simple) == 2
    assert _value(families, "nv_inference_queue_summary_us_count", **simple) == 2
    assert _value(families, "nv_inference_compute_infer_summary_us_count", **simple) == 2
    quantiles = {s.labels["quantile"] for s in families["nv_inference_request_summary_us"] if "quantile" in s.labels}
    assert quantiles == {"0.5", "0.99"}
    median = _value(families, "nv_inference_request_summary_us", quantile="0.5", **simple)
    assert 0 < median <= _value(families, "nv_inference_request_summary_us_sum", **simple)
    assert _value(families, "nv_inference_first_response_histogram_ms_count", **simple) == 2
    assert _value(families, "nv_inference_first_response_histogram_ms_bucket", le="+Inf", **simple) == 2
    assert not [name for name in families if name.endswith("_duration_us")]  # counter_latencies=false
    assert _value(families, "nv_inference_request_success", **simple) == 2


def test_metrics_off_binds_nothing(metrics_repo: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ["--metrics-port", str(port), "--allow-metrics=false"]
    with geserve([metrics_repo], tmp_path / "log", args) as server:
        assert _infer(server, "simple", 1) == 200
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert "Metrics Service" not in server.log()


def test_cpu_metrics_can_be_turned_off(metrics_repo: Path, tmp_path: Path) -> None:
    port = free_port()
    with geserve([metrics_repo], tmp_path / "log", ["--metrics-port", str(port), "--allow-cpu-metrics=false"]):
        families = _scrape(port)
    assert "nv_inference_request_success" in families
    assert not [name for name in families if name.startswith("nv_cpu_")]


def test_bad_metrics_config_fails_clearly(metrics_repo: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "geserve", "serve", "--model-repository", str(metrics_repo), "--http-port", "0",
         "--metrics-config", "summary_quantiles=half"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert result.returncode == 1
    assert "summary_quantiles" in result.stderr
