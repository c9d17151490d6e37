"""`geserve tune` on the example MLP, for real: the command starts geserve, perf_analyzer measures each point, and
what it writes is checked — the winning config.pbtxt loads in a fresh server and answers, the report lists every
point, the plot is a readable PNG. The sweep is tiny (two configurations, two concurrency levels, 300 ms windows) and
the budget generous, so a winner exists on a busy machine; a budget nothing can meet shows the early stop. Busy-machine
repeats are not exercised here (whether the machine is busy is not the test's to choose)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from geserve.tune import perf_analyzer
from geserve.tune.perf_analyzer import Measurement
from geserve.tune.report import pareto_front, winner
from geserve.tune.server import copy_model
from geserve.tune.space import Candidate, Space, apply, candidates
from geserve.tune.sweep import MEASURED, OVER_BUDGET, SKIPPED, Point
from tests.support.models import REPO_ROOT, example_onnx
from tests.support.server import geserve

needs_perf_analyzer = pytest.mark.skipif(
    perf_analyzer.unavailable_reason() is not None, reason=str(perf_analyzer.unavailable_reason())
)
# Three 300 ms windows a point, any spread accepted, no busy repeats: this checks the tool, not the figures.
SMALL_SWEEP = ["--instances", "1", "--max-batch-sizes", "1,8", "--queue-delays-us", "200", "--concurrency", "1,4",
               "--measurement-interval-ms", "300", "--max-trials", "3", "--stability-percentage", "1000",
               "--max-repeats", "0"]


def tune(repository: Path, output: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geserve", "tune", "--model-repository", str(repository), "--model", "mlp",
         "--output-dir", str(output), *SMALL_SWEEP, *extra],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mlp_repository() -> Path:
    return example_onnx("mlp").parents[2]


@needs_perf_analyzer
def test_a_small_sweep_writes_a_config_that_serves_a_report_and_a_plot(mlp_repository: Path, tmp_path: Path) -> None:
    out = tmp_path / "tune"
    result = tune(mlp_repository, out, "--latency-budget-ms", "2000")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "best: inst=1 mbs=" in result.stdout
    # Not a terminal: one plain progress line per point, with the point and the time left.
    assert "tune: [1/4] inst=1 mbs=1 no batcher" in result.stderr and "left)" in result.stderr
    assert "\r" not in result.stderr

    config = text_format.Parse((out / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.name == "mlp" and config.max_batch_size in (1, 8)
    assert config.instance_group[0].count == 1
    assert config.HasField("dynamic_batching") == (config.max_batch_size == 8)

    report = (out / "report.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and "instances" not in line]
    assert len(rows) == 4, report  # every point, measured or not
    assert sum("★" in row for row in rows) == 1 and "## Winner" in report and "![" in report

    import matplotlib.image

    image = matplotlib.image.imread(out / "tune.png")
    assert image.shape[0] >= 400 and image.shape[1] >= 600
    assert image[..., :3].std() > 0.05  # not a blank canvas

    # The winner, written into a repository of its own, loads in a fresh geserve and answers.
    repository = tmp_path / "repository"
    copy_model(mlp_repository / "mlp", repository)
    (repository / "mlp" / "config.pbtxt").write_text((out / "config.pbtxt").read_text())
    with geserve([repository], tmp_path / "winner.log") as server:
        client = httpclient.InferenceServerClient(server.url)
        assert client.get_model_config("mlp")["max_batch_size"] == config.max_batch_size
        data = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
        tensor = httpclient.InferInput("input", [1, 256], "FP32")
        tensor.set_data_from_numpy(data)
        assert client.infer("mlp", [tensor]).as_numpy("logits").shape == (1, 10)
        client.close()


@needs_perf_analyzer
def test_a_budget_nothing_meets_stops_each_configuration_at_its_first_level(
    mlp_repository: Path, tmp_path: Path
) -> None:
    out = tmp_path / "tune"
    result = tune(mlp_repository, out, "--latency-budget-ms", "0.001", "--max-batch-sizes", "1")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "no configuration kept p99 within 0.001 ms" in result.stdout
    assert not (out / "config.pbtxt").exists()
    report = (out / "report.md").read_text()
    assert " | over budget" in report and "| 4 |  |  |  |  | 0 | skipped: p99 over budget at c=1 |" in report
    assert "higher concurrency skipped" in result.stderr


def test_the_space_follows_the_model() -> None:
    base = model_config_pb2.ModelConfig(name="m", platform="graph_executor", max_batch_size=16)
    base.dynamic_batching.preferred_batch_size.extend([4, 16])
    space = Space(instances=(1, 2), max_batch_sizes=(1, 8, 64), queue_delays_us=(0, 100),
                  precisions=("allow_fp32_to_fp16",), gears=True)
    found = candidates(base, space)
    # 64 is capped at the model's 16; no delays without batching; gears only with batching; fp16 as a variant.
    assert {c.max_batch_size for c in found} == {1, 8, 16}
    assert Candidate(1, 1, None) in found and Candidate(1, 1, 0) not in found
    assert Candidate(2, 8, 100, (1, 2, 4, 8), "allow_fp32_to_fp16") in found
    assert len(found) == 2 * 2 * (1 + 2 * 2 * 2)
    config = apply(base, Candidate(2, 8, 100, (1, 2, 4, 8), "allow_fp32_to_fp16"))
    assert config.instance_group[0].count == 2 and config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 100
    assert list(config.dynamic_batching.preferred_batch_size) == [4]  # 16 no longer fits
    assert config.parameters["compile_dynamic_batch_size"].string_value == "1,2,4,8"
    assert config.parameters["compile_precision_mode"].string_value == "allow_fp32_to_fp16"
    assert not apply(base, Candidate(1, 1, None)).HasField("dynamic_batching")
    # A model without batching is swept over instances only; compiler variants are for GE models only.
    onnx_free = model_config_pb2.ModelConfig(name="p", backend="python", max_batch_size=0)
    assert candidates(onnx_free, space) == [Candidate(1, 0, None), Candidate(2, 0, None)]


def test_the_winner_is_the_fastest_point_within_budget_and_the_front_is_not_dominated() -> None:
    def point(delay: int, c: int, throughput: float, p99_ms: float, status: str = MEASURED) -> Point:
        return Point(Candidate(1, 8, delay), c, status, Measurement(throughput, p99_ms * 500, p99_ms * 1000))

    points = [point(0, 1, 100, 1), point(0, 4, 300, 3), point(0, 16, 900, 30, OVER_BUDGET),
              point(500, 1, 80, 2), point(500, 4, 350, 4), Point(Candidate(1, 8, 500), 16, SKIPPED)]
    assert winner(points) == points[4]
    assert [p.throughput for p in pareto_front(points)] == [100, 300, 350, 900]
