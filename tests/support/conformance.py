"""The conformance suites' pair of servers: geserve and the real Triton serving the same test models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import models
from tests.support.reference import (
    build_python_backend_repository,
    free_port,
    reference_available,
    reference_unavailable_reason,
    start_reference_triton,
    stop_process,
    wait_ready,
)
from tests.support.server import RunningServer, start_geserve, stop_geserve
from tests.support.shm import Region

MODELS = ("simple", "digits", "nobatch", "identity_fp16", "identity_bool", "identity_bytes")
STATS_MODEL = "stats_probe"  # a second `simple` that only the statistics test sends traffic to


@dataclass(frozen=True)
class ServerPair:
    geserve: RunningServer
    triton_http: str  # host:port
    triton_grpc: str  # host:port
    regions: tuple[Region, Region]  # system shared memory for inputs and outputs, 256 bytes each


@contextlib.contextmanager
def server_pair(root: Path) -> Iterator[ServerPair]:
    """Both servers on the same ONNX models (Triton through Python-backend copies); shm allowed in geserve."""
    if not reference_available():
        pytest.skip(reference_unavailable_reason() or "reference Triton unavailable")
    source = root / "onnx"
    source.mkdir()
    models.simple(source)
    models.simple(source, STATS_MODEL)
    models.nobatch(source)
    models.digits(source)
    for kind in ("fp16", "bool", "bytes"):
        models.identity(source, kind)
    python_repo = build_python_backend_repository(source, root / "python", [*MODELS, STATS_MODEL])
    # Both boot at once: Triton in the background while geserve starts.
    http_port, grpc_port = free_port(), free_port()
    triton = start_reference_triton(python_repo, http_port, grpc_port, free_port(), root / "triton.log")
    regions = (Region(256), Region(256))
    try:
        server = start_geserve([source], root / "geserve.log", ["--allow-system-shared-memory=true"])
        try:
            try:
                wait_ready(f"http://127.0.0.1:{http_port}", process=triton, log_path=root / "triton.log")
            except RuntimeError:
                # The reference, not geserve, is what failed: its Python-backend stub sometimes dies at start
                # under load (boost interprocess lock). One fresh start, then its error stands.
                stop_process(triton)
                http_port, grpc_port = free_port(), free_port()
                triton = start_reference_triton(python_repo, http_port, grpc_port, free_port(), root / "triton2.log")
                wait_ready(f"http://127.0.0.1:{http_port}", process=triton, log_path=root / "triton2.log")
            wait_ready(server.base, process=server.process, log_path=root / "geserve.log")
            yield ServerPair(server, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", regions)
        finally:
            stop_geserve(server)
    finally:
        stop_process(triton)
        for region in regions:
            region.close()
