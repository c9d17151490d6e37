"""NVIDIA's real perf_analyzer (from the tritonclient wheel) drives geserve over HTTP with binary tensors."""

from __future__ import annotations

import re

import pytest

from tests.support.reference import perf_analyzer_path, run_perf_analyzer
from tests.support.server import RunningServer

pytestmark = pytest.mark.skipif(not perf_analyzer_path().exists(), reason="perf_analyzer is not installed")

# These tests check that perf_analyzer completes (stability 100%: any window counts); bench/ measures.
_ROW = re.compile(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec, latency (\d+) usec")


def test_concurrency_sweep_1_to_16_completes(server: RunningServer) -> None:
    result = run_perf_analyzer(
        ["-m", "simple", "-u", server.url, "--concurrency-range", "1:16",
         "--measurement-interval", "300", "--stability-percentage", "100"],
        timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    rows = {int(c): float(t) for c, t, _ in _ROW.findall(output)}
    assert sorted(rows) == list(range(1, 17)), output[-3000:]
    assert all(throughput > 0 for throughput in rows.values())
    # perf_analyzer prints the server side only when it could parse geserve's /stats.
    assert "Server: " in output and "compute infer" in output


def test_batched_requests_to_the_real_classifier(server: RunningServer) -> None:
    result = run_perf_analyzer(
        ["-m", "digits", "-u", server.url, "-b", "8", "--concurrency-range", "2",
         "--measurement-interval", "300", "--stability-percentage", "100"],
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    match = _ROW.search(output)
    assert match and float(match.group(2)) > 0, output[-3000:]
