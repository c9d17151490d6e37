"""CompileOptions: every choice a compile takes, parsed from atc-style strings, and hashed for the cache."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from geserve.cachekeys import file_hash
from geserve.compiler.errors import CompilerError

PRECISION_MODES = ("force_fp32", "must_keep_origin_dtype", "allow_fp32_to_fp16", "force_fp16", "allow_mix_precision")
TARGETS = ("cpu", "cuda", "npu")
FRAMEWORKS = ("onnx", "pytorch", "tensorflow")
QUANTIZE = ("none", "int8")


@dataclass(slots=True)
class CompileOptions:
    model: Path
    framework: str = ""  # "" : from the file suffix
    input_shapes: dict[str, list[int]] = field(default_factory=dict)  # -1: dynamic
    batch_gears: list[int] = field(default_factory=list)
    out_nodes: list[str] = field(default_factory=list)
    signature: str = ""  # a TensorFlow SavedModel's signature; "": serving_default (or its only one)
    precision_mode: str = "force_fp32"
    keep_io_types: bool = True
    keep_fp32: list[str] = field(default_factory=list)  # node names or op types kept out of FP16 / INT8 (keep.py)
    quantize: str = "none"
    calibration_data: Path | None = None
    per_channel: bool = True
    insert_op_conf: Path | None = None
    target: str = "cpu"
    optimize: bool = True
    # Custom-op libraries (.so) registered in every ONNX Runtime session of the compile; the package records their
    # names (custom_ops.library_names) and the served model finds them relative to its model folder.
    custom_op_libraries: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        _check("precision mode", self.precision_mode, PRECISION_MODES)
        _check("target", self.target, TARGETS)
        _check("quantize", self.quantize, QUANTIZE)
        if self.framework:
            _check("framework", self.framework, FRAMEWORKS)
        if self.quantize == "int8" and self.precision_mode not in ("force_fp32", "must_keep_origin_dtype"):
            raise CompilerError("--quantize int8 works on an FP32 graph; leave --precision-mode at force_fp32")
        if self.batch_gears and (min(self.batch_gears) < 1):
            raise CompilerError(f"batch gears must be >= 1, got {self.batch_gears}")
        self.batch_gears = sorted(set(self.batch_gears))
        self.custom_op_libraries = [Path(library) for library in self.custom_op_libraries]
        for library in self.custom_op_libraries:  # checked here: the cache key hashes them before any compile
            if not library.is_file():
                raise CompilerError(f"custom-op library {library} not found")

    def cache_fields(self) -> dict[str, Any]:
        """Everything that changes the compiled bytes, the model path excepted (its content hash is used)."""
        fields = asdict(self)
        fields.pop("model")
        for name in ("calibration_data", "insert_op_conf"):
            path = getattr(self, name)
            fields[name] = _tree_hash(path) if path else None
        fields["custom_op_libraries"] = [file_hash(library) for library in self.custom_op_libraries]
        return fields

    def fingerprint(self, source_hash: str, compiler_version: str) -> str:
        text = json.dumps([source_hash, compiler_version, self.cache_fields()], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


def _check(what: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise CompilerError(f"unknown {what} '{value}'; choose one of: {', '.join(allowed)}")


def parse_input_shapes(text: str) -> dict[str, list[int]]:
    """`name:d0,d1;name2:d0,...` (atc's --input_shape); -1 marks a dynamic dimension."""
    shapes: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, shape = _parse_input_shape(part)
        shapes[name] = shape
    return shapes


def _parse_input_shape(part: str) -> tuple[str, list[int]]:
    """One `name:d0,d1,...` entry."""
    name, sep, dims = part.rpartition(":")
    if not sep or not name:
        raise CompilerError(f"--input-shape expects 'name:d0,d1,...' entries separated by ';', got '{part}'")
    try:
        shape = [int(d) for d in dims.split(",") if d.strip()]
    except ValueError:
        raise CompilerError(f"--input-shape: dimensions of '{name}' must be integers, got '{dims}'") from None
    if any(d < -1 or d == 0 for d in shape):
        raise CompilerError(f"--input-shape: dimensions of '{name}' must be positive or -1, got '{dims}'")
    return name, shape


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(";", ",").split(",") if v.strip()]
    except ValueError:
        raise CompilerError(f"{what} expects comma-separated integers like 1,2,4,8, got '{text}'") from None


def parse_bool(text: str, what: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise CompilerError(f"{what} expects true or false, got '{text}'")


def _tree_hash(path: Path) -> str:
    path = Path(path)
    if not path.exists() and ":" in str(path):  # a calibration callable, `file.py:function` or `module:function`
        module, _, function = str(path).rpartition(":")
        source = Path(module)
        identity = (file_hash(source) if source.is_file() else module) + ":" + function
        return hashlib.sha256(identity.encode()).hexdigest()
    if path.is_file():
        return file_hash(path)
    digest = hashlib.sha256()
    for child in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(child.relative_to(path)).encode() + b"\0" + file_hash(child).encode())
    return digest.hexdigest()
