"""Completes a ModelConfig from an ONNX graph's signature, as Triton's onnxruntime backend does."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from tritonclient.grpc import model_config_pb2

from geserve.cachekeys import cache_dir
from geserve.compiler.errors import CompilerError
from geserve.compiler.package import is_package, read_manifest
from geserve.config import ModelConfig
from geserve.config.sequence import sequence_inputs, sequence_outputs
from geserve.errors import InvalidArgumentError
from geserve.types.datatypes import BY_WIRE, ONNX_TO_WIRE

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
    from tritonclient.grpc.model_config_pb2 import ModelInput, ModelOutput


@dataclass(frozen=True, slots=True)
class GraphTensor:
    name: str
    wire_type: str
    shape: tuple[int, ...]  # -1 for a dynamic dimension


# A graph's real inputs, its outputs, and its overridable initializers (inputs with a default value).
_Signature = tuple[list[GraphTensor], list[GraphTensor], list[GraphTensor]]


def read_signature(model_path: Path) -> tuple[list[GraphTensor], list[GraphTensor]]:
    """The graph's real inputs (initializers excluded) and outputs, without loading external weights.

    A load asks twice (auto-complete, then the instance layout): the file is parsed once per content."""
    inputs, outputs, _ = _cached_signature(model_path)
    return list(inputs), list(outputs)  # the cached lists stay unshared


def read_overridable_inputs(model_path: Path) -> list[GraphTensor]:
    """Graph inputs that have an initializer: a request may feed them or leave them to their default, so a config
    may list them as (optional) inputs, as Triton's onnxruntime backend allows. Auto-complete never adds them."""
    return list(_cached_signature(model_path)[2])


def _cached_signature(model_path: Path) -> _Signature:
    stat = model_path.stat()
    return _signature(model_path, f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}")


@functools.lru_cache(maxsize=1024)
def _signature(model_path: Path, identity: str) -> _Signature:
    """The signature, read once per file content on this machine: parsing an ONNX file holds all its inline weights
    in memory (90 MiB for MiniLM, in every worker that loads it: as much again as the model costs, for the length of
    the load), so what it found is kept in the cache folder, keyed by the file's identity, for every later load."""
    if is_package(model_path):
        return (*_package_signature(model_path), [])
    key = hashlib.sha256(f"{model_path.resolve()}\0{identity}".encode()).hexdigest()[:40]
    stored = cache_dir() / "signatures" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return _from_json(json.loads(stored.read_text()))
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ... for a broken file
        raise InvalidArgumentError(f"failed to read ONNX model {model_path}: {exc}") from None
    initializers = {init.name for init in model.graph.initializer}
    inputs = [_tensor(v, model_path) for v in model.graph.input if v.name not in initializers]
    outputs = [_tensor(v, model_path) for v in model.graph.output]
    overridable = [_tensor(v, model_path) for v in model.graph.input if v.name in initializers]
    del model
    with contextlib.suppress(OSError):
        _store(stored, (inputs, outputs, overridable))
    return inputs, outputs, overridable


def _store(path: Path, signature: _Signature) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps([[[t.name, t.wire_type, list(t.shape)] for t in part] for part in signature]))
    temporary.replace(path)  # whole or not at all, for a worker reading it meanwhile


def _from_json(parts: Any) -> _Signature:
    inputs, outputs, overridable = (
        [GraphTensor(str(name), str(wire), tuple(int(d) for d in shape)) for name, wire, shape in part]
        for part in parts
    )
    return inputs, outputs, overridable


def _package_signature(path: Path) -> tuple[list[GraphTensor], list[GraphTensor]]:
    """A compiled model's signature, from its clear-text manifest (no key needed)."""
    try:
        manifest = read_manifest(path)
    except CompilerError as exc:
        raise InvalidArgumentError(str(exc)) from None
    inputs, outputs = (
        [GraphTensor(name, ONNX_TO_WIRE[t["onnx_type"]], tuple(t["shape"])) for name, t in tensors.items()]
        for tensors in (manifest.inputs, manifest.outputs)
    )
    return inputs, outputs


def _tensor(value: onnx.ValueInfoProto, model_path: Path) -> GraphTensor:
    tensor_type = value.type.tensor_type
    wire = ONNX_TO_WIRE.get(tensor_type.elem_type)
    if wire is None:
        raise InvalidArgumentError(
            f"{model_path}: tensor '{value.name}' has ONNX element type {tensor_type.elem_type}, "
            f"which has no Triton datatype"
        )
    shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    return GraphTensor(value.name, wire, shape)


def auto_complete(config: ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
    inputs, outputs = _client_tensors(config, *read_signature(model_path))
    graph = inputs + outputs
    batchable = _batchable(graph)
    if config.max_batch_size == 0 and batchable and not _dims_given_with_batch(config, graph):
        _choose_max_batch_size(config, default_max_batch_size)
    if config.max_batch_size > 0 and not batchable:
        raise InvalidArgumentError(
            f"model '{config.name}': max_batch_size is {config.max_batch_size} but the first dimension of "
            f"{model_path} is not dynamic for every input and output, so it cannot batch"
        )
    skip = 1 if config.max_batch_size > 0 else 0
    _complete(config.input, inputs, skip)
    _complete(config.output, outputs, skip)


def _client_tensors(
    config: ModelConfig, inputs: list[GraphTensor], outputs: list[GraphTensor]
) -> tuple[list[GraphTensor], list[GraphTensor]]:
    # A sequence model's control and state tensors are fed and read by the sequence batcher, never by a client.
    hidden = {t.name for t in (*sequence_inputs(config), *sequence_outputs(config))}
    if hidden:
        inputs = [t for t in inputs if t.name not in hidden]
        outputs = [t for t in outputs if t.name not in hidden]
    return inputs, outputs


def _batchable(graph: list[GraphTensor]) -> bool:
    """Every input and output has a dynamic first dimension: the batch."""
    return bool(graph) and all(t.shape and t.shape[0] == -1 for t in graph)


def _choose_max_batch_size(config: ModelConfig, default_max_batch_size: int) -> None:
    config.max_batch_size = default_max_batch_size
    if default_max_batch_size > 1 and config.WhichOneof("scheduling_choice") is None:
        config.dynamic_batching.SetInParent()  # as Triton does when it chose the batch size itself


def _dims_given_with_batch(config: ModelConfig, graph: list[GraphTensor]) -> bool:
    """A config that already lists full-rank dims means the user chose max_batch_size 0 on purpose."""
    ranks = {t.name: len(t.shape) for t in graph}
    given = [t for t in list(config.input) + list(config.output) if t.dims]
    return bool(given) and all(len(t.dims) == ranks.get(t.name, -1) for t in given)


def _complete(
    configured: RepeatedCompositeFieldContainer[ModelInput] | RepeatedCompositeFieldContainer[ModelOutput],
    graph: list[GraphTensor],
    skip: int,
) -> None:
    by_name = {t.name: t for t in configured}
    for tensor in graph:
        entry = by_name.get(tensor.name)
        if entry is None:
            if configured and len(configured) == len(graph):
                continue  # every tensor already configured (possibly under a reshape); keep the user's list
            entry = configured.add()
            entry.name = tensor.name
        _fill_entry(entry, tensor, skip)


def _fill_entry(entry: ModelInput | ModelOutput, tensor: GraphTensor, skip: int) -> None:
    """The graph's datatype and dims (past the batch dimension) where the config entry gives none."""
    if entry.data_type == model_config_pb2.TYPE_INVALID:
        entry.data_type = BY_WIRE[tensor.wire_type].config
    if not entry.dims and not entry.HasField("reshape"):
        dims = tensor.shape[skip:]
        entry.dims.extend(dims if dims else [1])
        if not dims:
            entry.reshape.SetInParent()
