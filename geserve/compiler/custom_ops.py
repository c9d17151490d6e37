"""Custom-operator libraries (onnxruntime-extensions and the like) in the compiler: registered in every ONNX Runtime
session it makes, the custom-op domains a graph needs, and the library names a package records."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

import onnx
import onnxruntime as ort

from geserve.compiler.errors import CompilerError
from geserve.compiler.keep import name_nodes

# Domains ONNX Runtime implements itself: ONNX's, ONNX-ML's and its own contrib ops, plus the internal ones its
# optimizer may write (NCHWc, NHWC layouts). Any other domain needs a library.
STANDARD_DOMAINS = frozenset({
    "", "ai.onnx", "ai.onnx.ml", "ai.onnx.training", "ai.onnx.preview.training",
    "com.microsoft", "com.microsoft.nchwc", "com.microsoft.experimental", "com.ms.internal.nhwc",
})


def session_options(libraries: Sequence[Path]) -> ort.SessionOptions:
    """Session options with the libraries registered; a library ONNX Runtime cannot load is named in one line."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for library in libraries:
        try:
            _pinned(str(library))
            options.register_custom_ops_library(str(library))
        except Exception as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0].rpartition("with error: ")[2]
            raise CompilerError(f"cannot load custom-op library {library}: {reason}") from None
    return options


@cache
def _pinned(library: str) -> ort.SessionOptions:
    """A registration kept for the life of the process. ONNX Runtime unloads a library when the last options that
    registered it go, and loading it again crashes some (onnxruntime-extensions' copy does, in a process that has
    imported that package); a compile opens several sessions in a row."""
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    return options


def library_names(libraries: Sequence[Path]) -> list[str]:
    """What a package records, to be found relative to the served model's folder: a relative path as given, else
    the file name."""
    return [str(library) if not library.is_absolute() else library.name for library in libraries]


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node, those of subgraphs (If / Loop / Scan bodies) too."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                yield from _nodes(subgraph)


def custom_domains(model: onnx.ModelProto) -> list[str]:
    """The non-standard domains of the graph's nodes. Not its opset imports: ONNX Runtime's optimizer writes every
    domain it has registered there (org.pytorch.aten, a library's others), used or not."""
    return sorted({node.domain for node in _nodes(model.graph)} - STANDARD_DOMAINS)


def custom_node_names(model: onnx.ModelProto) -> list[str]:
    """The names of the custom-domain nodes, naming those that have none (the FP16 converter blocks nodes by name)."""
    taken = {node.name for node in _nodes(model.graph)}
    return name_nodes((n for n in _nodes(model.graph) if n.domain not in STANDARD_DOMAINS), taken, "custom")
