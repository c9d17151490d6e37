"""Shared fixtures: test model repositories and a real geserve server process per session."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import models
from tests.support.server import RunningServer, geserve


@pytest.fixture(scope="module", autouse=True)
def _collect_clients_on_the_main_thread() -> Iterator[None]:
    """tritonclient's HTTP client closes itself in `__del__` through a gevent pool that only its own thread may
    join. One left in a reference cycle would otherwise be collected later on whatever thread runs the collector
    (an in-process server's, say) and warn there; collecting after each module keeps that on the main thread."""
    yield
    gc.collect()


# The example models' ONNX files, for the compiler tests (built once per session if the bootstrap has not).
@pytest.fixture(scope="session")
def mlp() -> Path:
    return models.example_onnx("mlp")


@pytest.fixture(scope="session")
def digits() -> Path:
    return models.example_onnx("digits")


@pytest.fixture(scope="session")
def efficientnet() -> Path:
    return models.example_onnx("efficientnet_lite0")


@pytest.fixture(scope="session")
def minilm() -> Path:
    return models.example_onnx("minilm")


@pytest.fixture(scope="session")
def good_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.good_repository(tmp_path_factory.mktemp("repo") / "models")


@pytest.fixture(scope="session")
def server(good_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """geserve serving every good test model, shared by the read-mostly integration tests."""
    log = tmp_path_factory.mktemp("logs") / "geserve.log"
    with geserve([good_repo], log) as running:
        yield running
