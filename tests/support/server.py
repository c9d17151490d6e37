"""Starts a real `geserve serve` process on free ports for integration tests, and stops it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.reference import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningServer:
    process: subprocess.Popen
    http_port: int
    log_path: Path
    grpc_port: int = 0
    metrics_port: int = 0

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        """The server's child processes: with `--workers`, its workers."""
        pid = self.process.pid
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _wait_live(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"geserve exited with {server.process.returncode}:\n{server.log()[-4000:]}")
        try:
            with urllib.request.urlopen(server.base + "/v2/health/live", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"geserve did not come up within {timeout} s:\n{server.log()[-4000:]}")


def start_geserve(repos: Sequence[Path], log_path: Path, extra_args: Sequence[str] = ()) -> RunningServer:
    # Every server gets its own ports, so the suite's servers (and a developer's) never collide.
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    args = [sys.executable, "-m", "geserve", "serve", "--http-port", str(http_port),
            "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    for repo in repos:
        args += ["--model-repository", str(repo)]
    if not any(arg.startswith("--workers") for arg in extra_args):
        # One process unless a test asks for workers: the default (one per core) would double every server's
        # start-up and memory in the suite; tests/test_workers.py covers the default.
        args += ["--workers", "1"]
    args += list(extra_args)
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=dict(os.environ))
    server = RunningServer(process, http_port, log_path, grpc_port, metrics_port)
    try:
        _wait_live(server, 60)
    except Exception:
        stop_geserve(server)
        raise
    return server


def stop_geserve(server: RunningServer, timeout: float = 15) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


@contextlib.contextmanager
def geserve(repos: Sequence[Path], log_path: Path, extra_args: Sequence[str] = ()) -> Iterator[RunningServer]:
    server = start_geserve(repos, log_path, extra_args)
    try:
        yield server
    finally:
        stop_geserve(server)
