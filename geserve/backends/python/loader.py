"""Imports a model's `model.py` as a module of its own, once per instance (as each Triton stub process does).

Every import gets a unique module name, so two models whose files share a name (they all are `model.py`)
never see each other's globals, nor do two instances of one model. The version folder goes on `sys.path`
so a model can import helper modules placed beside it, as under Triton.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
import sysconfig
import traceback
import types
from pathlib import Path

from geserve.backends.python import metrics
from geserve.errors import GeserveError, UnavailableError

_counter = itertools.count()
# Frames inside geserve and the standard library (futures, asyncio) are not the model's.
_NOT_THE_MODEL = (str(Path(__file__).resolve().parents[2]), sysconfig.get_paths()["stdlib"], "<frozen")


def import_model_file(path: Path, model_name: str) -> types.ModuleType:
    """Import `path` (a model.py); raise UnavailableError with the fault and where it is."""
    if not path.is_file():
        raise UnavailableError(f"Python model file {path} not found for model '{model_name}'")
    safe = re.sub(r"\W", "_", model_name)
    module_name = f"geserve_python_model_{safe}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UnavailableError(f"cannot import {path} for model '{model_name}'")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses, pickle and typing look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(module_name, None)
        raise UnavailableError(f"failed to load Python model '{model_name}' from {path}: {describe(exc)}") from None
    if not isinstance(getattr(module, "TritonPythonModel", None), type):
        sys.modules.pop(module_name, None)
        raise UnavailableError(f"{path} of model '{model_name}' defines no class TritonPythonModel")
    return module


def import_for_instance(
    store: metrics.MetricStore, path: Path, model_name: str, instance_name: str
) -> tuple[types.ModuleType, metrics.MetricScope]:
    """A fresh import of model.py for one instance, with the metrics scope its import-time families go to."""
    scope = metrics.MetricScope(store, instance_name)
    try:
        with metrics.bound(scope):  # families made at import belong to the instance
            module = import_model_file(path, model_name)
    except GeserveError:
        scope.close()
        raise
    return module, scope


def forget(module: types.ModuleType) -> None:
    sys.modules.pop(module.__name__, None)


def describe(exc: BaseException) -> str:
    """`Type: message` then the model's own frames, innermost first, as Triton words a model's exception:
    `ValueError: boom\\n\\nAt:\\n  /models/m/1/model.py(17): execute\\n`."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{text}\n\nAt:\n  {exc.filename}({exc.lineno}): <module>\n"
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(_NOT_THE_MODEL)
    ]
    if not frames:
        return text
    return text + "\n\nAt:\n" + "".join(f"  {f.filename}({f.lineno}): {f.name}\n" for f in reversed(frames))
