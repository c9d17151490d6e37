"""A geserve process of our own on a temporary copy of the model, in explicit mode, so each configuration of
the sweep is one load (with the config as Triton's load override) instead of a new server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from google.protobuf import json_format

from geserve.config import ModelConfig

START_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 300.0  # a compiler variant compiles on its first load


class TuneServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def copy_model(source: Path, repository: Path) -> Path:
    """`repository/<model>` holding links to the model's files (nothing large is copied); its config.pbtxt is
    never read, as every load brings its own config."""
    dest = repository / source.name
    dest.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.pbtxt":
            (dest / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    return dest


class TuneServer:
    """`geserve serve --model-control-mode explicit` on `repository`, on free ports, its log in `log_path`."""

    def __init__(self, repository: Path, log_path: Path, extra_args: Sequence[str] = ()) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        args = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(repository),
                "--model-control-mode", "explicit", "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
                "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                "--allow-metrics", "false", *extra_args]  # fmt: skip
        self.log_path = log_path
        # One process: the config is tuned for one server process (a --server-arg=--workers=N overrides this).
        env = {**os.environ, "GESERVE_WORKERS": "1"}
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_live()
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> TuneServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.grpc_port if protocol == 'grpc' else self.http_port}"

    def _wait_live(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TuneServerError(f"geserve exited with {self.process.returncode}: {self.log_tail()}")
            live = f"http://127.0.0.1:{self.http_port}/v2/health/live"
            with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), urllib.request.urlopen(
                live, timeout=1
            ):
                return
            time.sleep(0.1)
        raise TuneServerError(f"geserve did not come up within {START_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def load(self, name: str, config: ModelConfig) -> None:
        """(Re)load `name` with `config` (Triton's `config` load parameter); raises with the server's reason."""
        body = json.dumps({"parameters": {"config": json_format.MessageToJson(config)}}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/v2/repository/models/{name}/load", data=body, method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=LOAD_TIMEOUT_S):
                return
        except urllib.error.HTTPError as exc:
            reason = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                reason = json.loads(reason)["error"]
            raise TuneServerError(reason) from None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
