"""Finds NVIDIA perf_analyzer (tritonclient 2.41.0's wheel data), runs it with the libraries it needs, reads its CSV."""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PATH_ENV = "GESERVE_PERF_ANALYZER"  # an explicit binary wins over the search
INSTALL_HINT = (
    "perf_analyzer comes with `pip install tritonclient[all]==2.41.0` (wheel data, put in the venv's bin/); it needs "
    "Debian's libb64-0d and libcudart.so.12 from `pip install nvidia-cuda-runtime-cu12` "
    "(scripts/install_reference.sh installs both)"
)


ANY_SPREAD = 1000  # a --stability-percentage no spread of windows exceeds (100 still refuses a noisy machine's)


@dataclass(frozen=True)
class Measurement:
    throughput: float  # inferences/s
    p50_us: float
    latency_us: float  # the percentile perf_analyzer was asked for (p99 unless told otherwise)


def site_packages(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return found[0] if found else None


def perf_analyzer_path(venv: Path | None = None) -> Path:
    """$GESERVE_PERF_ANALYZER, else `<venv>/bin/perf_analyzer` (where pip puts the wheel's data; default: this
    interpreter's environment), else the first one on PATH; the venv's path when none exists."""
    if os.environ.get(PATH_ENV):
        return Path(os.environ[PATH_ENV])
    in_venv = (venv or Path(sys.prefix)) / "bin" / "perf_analyzer"
    if in_venv.is_file():
        return in_venv
    on_path = shutil.which("perf_analyzer")
    return Path(on_path) if on_path else in_venv


def cuda_runtime_lib_dir(venv: Path | None = None) -> Path | None:
    """Directory of `libcudart.so.12` from the `nvidia-cuda-runtime-cu12` wheel (importable here, or in `venv`)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("nvidia.cuda_runtime") if importlib.util.find_spec("nvidia") else None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "lib" for p in spec.submodule_search_locations]
    site = site_packages(venv or Path(sys.prefix))
    if site is not None:
        candidates.append(site / "nvidia" / "cuda_runtime" / "lib")
    return next((c for c in candidates if any(c.glob("libcudart.so.12*"))), None)


def perf_analyzer_env(venv: Path | None = None) -> dict[str, str]:
    """This environment with the wheel's libcudart directory first on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    cudart = cuda_runtime_lib_dir(venv)
    if cudart is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(cudart), env.get("LD_LIBRARY_PATH", "")]))
    return env


def run_perf_analyzer(
    args: Sequence[str], timeout: float, venv: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run perf_analyzer with `args`; output captured as text, never raises on a non-zero exit."""
    return subprocess.run(
        [str(perf_analyzer_path(venv)), *args], env=perf_analyzer_env(venv),
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def unavailable_reason() -> str | None:
    """Why perf_analyzer cannot run here (missing binary or library), or None when it runs."""
    path = perf_analyzer_path()
    if not path.is_file():
        return f"perf_analyzer not found at {path}: {INSTALL_HINT}"
    try:
        result = run_perf_analyzer(["--version"], timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"perf_analyzer does not run: {exc}"
    output = result.stdout + result.stderr
    if "error while loading shared libraries" in output:
        return f"perf_analyzer does not run ({output.strip()[-200:]}): {INSTALL_HINT}"
    return None


def measure(model: str, url: str, protocol: str, concurrency: int, *, window_ms: int, percentile: int,
            stability: int, max_trials: int, extra_args: Sequence[str] = ()) -> tuple[Measurement | None, str]:
    """One concurrency level; (its figures, or None, and perf_analyzer's output). perf_analyzer writes nothing
    when its windows never settle within `stability` %; on a busy machine a tail percentile rarely does, so it is
    run once more settling on the average latency, accepting any spread, over windows twice as long (the CSV still
    carries the percentile)."""
    output = ""
    settle_on_percentile = ["--percentile", str(percentile)]
    tries: list[tuple[int, int, int, list[str]]] = [
        (stability, window_ms, max_trials, settle_on_percentile), (ANY_SPREAD, 2 * window_ms, max_trials + 2, [])
    ]
    for stable, window, trials, settle_on in tries:
        with tempfile.TemporaryDirectory(prefix="geserve-tune-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = ["-m", model, "-u", url, "-i", protocol, "--concurrency-range", str(concurrency),
                    "--measurement-interval", str(window), "--stability-percentage", str(stable),
                    "--max-trials", str(trials), *settle_on, "-f", str(csv_path), *extra_args]  # fmt: skip
            try:
                result = run_perf_analyzer(args, timeout=60 + 2 * trials * window / 1000)
            except subprocess.TimeoutExpired:
                output = f"perf_analyzer did not finish within {60 + 2 * trials * window / 1000:.0f} s"
                continue
            output = result.stdout + result.stderr
            point = read_csv(csv_path, percentile)
        if point is not None:
            return point, output
    return None, output


def read_csv(path: Path, percentile: int) -> Measurement | None:
    if not path.is_file():
        return None
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return None
    row = rows[0]
    return Measurement(float(row["Inferences/Second"]), float(row["p50 latency"]),
                       float(row.get(f"p{percentile} latency") or row["p99 latency"]))
