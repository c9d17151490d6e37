"""The conformance suites' pair of servers: geserve and the real Triton serving the same test models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import models
from tests.support.reference import (
    BootingTriton,
    build_python_backend_repository,
    reference_available,
    reference_unavailable_reason,
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
    triton = BootingTriton(python_repo, root)
    regions = (Region(256), Region(256))
    try:
        server = start_geserve([source], root / "geserve.log", ["--allow-system-shared-memory=true"])
        try:
            triton.wait()
            yield ServerPair(server, triton.http, triton.grpc, regions)
        finally:
            stop_geserve(server)
    finally:
        triton.stop()
        for region in regions:
            region.close()
