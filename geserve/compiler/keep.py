"""`--keep-fp32 NAMES|@file` (atc's --keep_dtype): node names or op types kept out of FP16 conversion and INT8
quantization, named as `compile --check --layers` reports them."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from pathlib import Path

import onnx

from geserve.compiler.errors import CompilerError


def parse_keep_fp32(text: str, base: Path | None = None) -> list[str]:
    """Comma-separated names, or `@file` with one name a line (`#` starts a comment); a relative file is read from
    `base` when given (a served model's folder)."""
    text = text.strip()
    if not text.startswith("@"):
        return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    return _names_in_file(_keep_path(text[1:], base))


def _keep_path(name: str, base: Path | None) -> Path:
    path = Path(name)
    if base is not None and not path.is_absolute():
        return base / path
    return path


def _names_in_file(path: Path) -> list[str]:
    """The file's names, one a line, without comments or blank lines, each once."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CompilerError(f"--keep-fp32 @{path}: cannot read it: {exc.strerror or exc}") from None
    # A comment starts a line or follows a blank; a '#' inside a name (rare, but legal) stays.
    names = (re.sub(r"(^|\s)#.*$", "", line).strip() for line in lines)
    return list(dict.fromkeys(n for n in names if n))


def check_keep_fp32(model: onnx.ModelProto, names: list[str]) -> None:
    """Every name must be a node or an op type of the source graph: a typo must not silently keep nothing."""
    known = {node.name for node in model.graph.node} | {node.op_type for node in model.graph.node}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise CompilerError(f"--keep-fp32: no node or op type named {', '.join(repr(n) for n in unknown)} in "
                            f"{model.graph.name or 'the graph'}")


def kept_nodes_and_ops(model: onnx.ModelProto, names: list[str]) -> tuple[list[str], list[str]]:
    """The names that are nodes of this graph, and the rest that are its op types. A node the optimizer folded
    into another (a BatchNormalization into its Conv) is no longer there, and keeps nothing."""
    nodes = {node.name for node in model.graph.node if node.name}
    op_types = {node.op_type for node in model.graph.node}
    return [n for n in names if n in nodes], [n for n in names if n not in nodes and n in op_types]


def excluded_nodes(model: onnx.ModelProto, names: list[str]) -> list[str]:
    """The node names that `names` keep in FP32 (an op type stands for its nodes), for the quantizer, which
    excludes nodes by name only: an unnamed node of a kept op type is given one."""
    nodes, op_types = kept_nodes_and_ops(model, names)
    taken = {node.name for node in model.graph.node}
    of_kept_types = (node for node in model.graph.node if node.op_type in op_types)
    return list(dict.fromkeys([*nodes, *name_nodes(of_kept_types, taken, "keep_fp32")]))


def name_nodes(nodes: Iterable[onnx.NodeProto], taken: set[str], tag: str) -> list[str]:
    """The nodes' names, a node without one given `<op_type>_<tag>_<k>` not in `taken` (which grows): the FP16
    converter and the quantizer exclude nodes by name only."""
    names = []
    for node in nodes:
        if not node.name:
            node.name = next(name for k in itertools.count() if (name := f"{node.op_type}_{tag}_{k}") not in taken)
            taken.add(node.name)
        names.append(node.name)
    return names
