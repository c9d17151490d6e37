"""Front ends: read an ONNX, PyTorch or TensorFlow model into an onnx.ModelProto (the compiler's IR)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import onnx

from geserve.compiler.errors import CompilerError, MissingDependencyError
from geserve.compiler.tensorflow import from_tensorflow, is_tensorflow_model

OPSET = 17
_SUFFIXES = {".onnx": "onnx", ".pt": "pytorch", ".pth": "pytorch"}


def detect_framework(path: Path) -> str:
    if is_tensorflow_model(path):
        return "tensorflow"
    framework = _SUFFIXES.get(path.suffix.lower())
    if framework is None:
        raise CompilerError(f"cannot tell the framework of {path}; give --framework onnx|pytorch|tensorflow")
    return framework


def load_model(
    path: Path, framework: str, input_shapes: dict[str, list[int]], out_nodes: list[str], signature: str = ""
) -> onnx.ModelProto:
    if not path.exists():
        raise CompilerError(f"model {path} not found")
    if framework == "onnx":
        try:
            return onnx.load(str(path))
        except Exception as exc:
            raise CompilerError(f"failed to read ONNX model {path}: {exc}") from None
    if framework == "pytorch":
        return _from_pytorch(path, input_shapes, out_nodes)
    return from_tensorflow(path, input_shapes, out_nodes, signature)


def _from_pytorch(path: Path, input_shapes: dict[str, list[int]], out_nodes: list[str]) -> onnx.ModelProto:
    """A TorchScript archive or a `torch.save`d full module; --input-shape names and sizes the inputs."""
    try:
        import torch
    except ImportError:
        raise MissingDependencyError("torch", "pytorch", "the PyTorch front end") from None
    if not input_shapes:
        raise CompilerError("the PyTorch front end needs --input-shape to name and size the model inputs")
    module = _load_torch_module(torch, path)
    module.eval()
    examples = tuple(torch.rand(*[1 if d == -1 else d for d in shape]) for shape in input_shapes.values())
    outputs = out_nodes or ["output"]
    buffer = io.BytesIO()
    try:
        with torch.no_grad():
            torch.onnx.export(
                module, examples, buffer, input_names=list(input_shapes), output_names=outputs,
                dynamic_axes=_dynamic_axes(input_shapes, outputs), opset_version=OPSET, dynamo=False,
            )
    except Exception as exc:
        raise CompilerError(f"torch.onnx.export failed for {path}: {str(exc).splitlines()[0]}") from None
    return onnx.load_from_string(buffer.getvalue())


def _load_torch_module(torch: Any, path: Path) -> Any:
    """The module a TorchScript archive, else a `torch.save` file, holds."""
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception:
        try:
            module = torch.load(str(path), map_location="cpu", weights_only=False)
        except Exception as exc:
            raise CompilerError(f"failed to load PyTorch model {path}: {exc}") from None
    if not isinstance(module, torch.nn.Module):
        raise CompilerError(
            f"{path} holds a {type(module).__name__}, not a module; save the whole module (torch.save(model)) "
            f"or a TorchScript archive (torch.jit.save), not a state_dict"
        )
    return module


def _dynamic_axes(input_shapes: dict[str, list[int]], outputs: list[str]) -> dict[str, dict[int, str]] | None:
    """torch.onnx.export's dynamic axes: each -1 of an input, and the outputs' first when an input's batch is -1."""
    dynamic = {n: {i: f"{n}_d{i}" for i, d in enumerate(s) if d == -1} for n, s in input_shapes.items()}
    dynamic.update({n: {0: "batch"} for n in outputs} if any(s[:1] == [-1] for s in input_shapes.values()) else {})
    return {k: v for k, v in dynamic.items() if v} or None
