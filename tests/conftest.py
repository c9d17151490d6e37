"""Shared fixtures: test model repositories and a real geserve server process per session; a failed test's report
carries the log of each server it used."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import models
from tests.support.server import RunningServer, geserve

SERVER_LOG_TAIL = 6000  # characters: the last requests before a failure, not a whole module's history


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A failed test's report ends with the log of each server it used: CI keeps only what pytest prints, and a
    server-side cause (a traceback, a restart) is otherwise lost with the server's temporary folder."""
    report: pytest.TestReport = yield
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, RunningServer) and value.log_path.exists():
                report.sections.append((f"geserve log ({name}, last {SERVER_LOG_TAIL} characters)",
                                        value.log()[-SERVER_LOG_TAIL:]))
    return report


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
