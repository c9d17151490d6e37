"""The Python-backend test models (tests/support/python_models) as repositories for geserve and the real Triton.

The model files are copied, never served from the source tree (both servers write `__pycache__` beside them).
BLS calls the ONNX model `simple`: geserve serves the ONNX file itself, Triton a generated Python-backend copy.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from tests.support import models
from tests.support.reference import build_python_backend_repository

PYTHON_MODELS = Path(__file__).resolve().parent / "python_models"
SHARED = ("add_sub", "identity", "bls", "repeat", "inc", "auto_complete")  # run unchanged on both servers


def _copy(names: Iterable[str], dest: Path) -> None:
    for name in names:
        shutil.copytree(PYTHON_MODELS / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))


def geserve_repository(dest: Path, names: Iterable[str] = SHARED) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    _copy(names, dest)
    models.simple(dest)
    return dest


def triton_repository(dest: Path, names: Iterable[str] = SHARED) -> Path:
    source = dest.parent / f"{dest.name}-onnx"
    source.mkdir(parents=True, exist_ok=True)
    models.simple(source)
    build_python_backend_repository(source, dest, ["simple"])
    _copy(names, dest)
    return dest


# A Python model's config line that runs each of its instances in a process of its own (backends/python/isolation).
ISOLATION = 'parameters { key: "isolation" value: { string_value: "process" } }\n'


def isolate(repo: Path) -> Path:
    """Every Python model of `repo` runs isolated: its config asks for a process of its own per instance."""
    for config in repo.glob("*/config.pbtxt"):
        text = config.read_text()
        if 'backend: "python"' in text and '"isolation"' not in text:
            config.write_text(text.rstrip("\n") + "\n" + ISOLATION)
    return repo
