"""reference/parameters.md: every model-config parameter the GE backend, its scheduler and its compiler read, and
the Python backend's own.

The names come from the sets the code reads them with (geserve/backends/ge/parameters.py, compiled.py, the CUDA and
CANN device modules, backends/python/isolation); each one's line from the PARAMETER_DESCRIPTIONS next to them. A name
without a line fails the build.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from reference_markdown import GENERATED_NOTE, anchor, code, table, text

from geserve.backends.ge import parameters as ge
from geserve.backends.ge.compiled import COMPILE_PARAMETERS
from geserve.backends.python import isolation
from geserve.devices.cann import CANN_PARAMETERS
from geserve.devices.cuda import CUDA_PARAMETERS

_INTRO = """\
# Model parameters

{note}

Every `parameters` key of a model's `config.pbtxt` that the GE backend, its scheduler or its compiler reads, and
the one the Python backend reads for itself (every other key of a Python model is the model's own, in
`args["model_config"]`), generated from the code when this site is built. Values are strings:

```
parameters {{ key: "instance_exec_blocks" value: {{ string_value: "2" }} }}
```

A model in the GE dialects (`platform: "graph_executor"`, `backend: "ge"` or `"npu_ge"`) that names any other key
fails to load, with the list of accepted names; a model of Triton's ONNX Runtime or TensorFlow platforms loads with
unknown keys ignored (one warning per model names them), as Triton's own backends ignore them.
"""


DESCRIPTIONS = {**ge.PARAMETER_DESCRIPTIONS, **isolation.PARAMETER_DESCRIPTIONS}


class MissingDescriptionError(RuntimeError):
    """A parameter the code reads has no line in PARAMETER_DESCRIPTIONS."""


def prefixes() -> list[str]:
    """The key patterns accepted by prefix (`session.ge.*`), as PARAMETER_DESCRIPTIONS names them."""
    return [f"{prefix}*" for prefix in (*ge._GE_PREFIXES, ge._ORT_PREFIX)]


def sections() -> list[tuple[str, list[str]]]:
    """(title, names) for each layer that reads parameters, the names sorted case-insensitively."""
    compiled = set(COMPILE_PARAMETERS)
    groups = [
        ("GE backend", set(ge._SETTERS)),
        ("CUDA execution provider", set(CUDA_PARAMETERS)),
        ("CANN execution provider (Ascend)", set(CANN_PARAMETERS)),
        ("Compile on first load", compiled),
        ("Scheduler and model formats", set(ge._HANDLED_ELSEWHERE) - compiled),
    ]
    python = ("Python backend", sorted(isolation.PARAMETER_DESCRIPTIONS))
    return [(title, sorted(names, key=str.lower)) for title, names in groups] + [("Prefixes", prefixes()), python]


def row_id(name: str) -> str:
    """`executor_type`, `session-ge`: the name lowercased, other characters as dashes."""
    return re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-")


def page() -> str:
    groups = sections()
    _check([name for _, names in groups for name in names])
    lines = [_INTRO.format(note=GENERATED_NOTE.format(source=Path(__file__).name))]
    for title, names in groups:
        rows = [[f"{anchor(row_id(name))}{code(name)}", text(DESCRIPTIONS[name])] for name in names]
        lines += ["", f"## {title}", "", *table(["parameter", "description"], rows)]
    return "\n".join(lines) + "\n"


def _check(names: Iterable[str]) -> None:
    names = list(names)
    missing = sorted(set(names) - set(DESCRIPTIONS))
    if missing:
        raise MissingDescriptionError(
            f"no line in the PARAMETER_DESCRIPTIONS of geserve.backends.ge.parameters (or of "
            f"geserve.backends.python.isolation) for: {', '.join(missing)}"
        )
    ids = [row_id(name) for name in names]
    clashing = sorted({i for i in ids if ids.count(i) > 1})
    if clashing:
        raise MissingDescriptionError(f"parameters share an anchor on the page: {', '.join(clashing)}")
