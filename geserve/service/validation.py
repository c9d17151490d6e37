"""Checks an inference request against its model before it is queued (Triton's wording for each fault)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn

from geserve.errors import InvalidArgumentError
from geserve.repository.model import LoadedModel
from geserve.types import InferenceRequest, InputTensor, id_prefix


def _prefix(request: InferenceRequest) -> str:
    return id_prefix(request.id)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _names_text(names: Iterable[str]) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def prepare(model: LoadedModel, request: InferenceRequest) -> None:
    """Validate `request` and put its inputs in the model's order; sets `request.batch_size`."""
    if request.outputs:
        _refuse_repeated_outputs(request)
    by_name = _inputs_by_name(model, request)
    request.batch_size = _check_shapes(model, request, by_name)
    request.inputs = [by_name[n] for n in model.input_order if n in by_name]
    if request.outputs is not None:
        _check_outputs(model, request)


def _inputs_by_name(model: LoadedModel, request: InferenceRequest) -> dict[str, InputTensor]:
    """The request's inputs by name, each one the model has, once, of its datatype; none it requires missing."""
    specs = model.inputs
    by_name: dict[str, InputTensor] = {}
    for tensor in request.inputs:
        spec = specs.get(tensor.name)
        if spec is None:
            raise InvalidArgumentError(
                f"unexpected inference input '{tensor.name}' for model '{model.name}'"
            )
        if tensor.name in by_name:
            raise InvalidArgumentError(f"{_prefix(request)}input '{tensor.name}' already exists in request")
        if tensor.datatype != spec.wire_type:
            raise InvalidArgumentError(
                f"{_prefix(request)}inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                f"but model '{model.name}' expects '{spec.wire_type}'"
            )
        by_name[tensor.name] = tensor
    if len(by_name) != len(specs):
        missing = [n for n, s in specs.items() if n not in by_name and not s.optional]
        if missing:
            raise InvalidArgumentError(
                f"{_prefix(request)}expected {len(specs)} inputs but got {len(by_name)} inputs for model "
                f"'{model.name}'. Got input(s) {_names_text(by_name)}, but missing required input(s) "
                f"{_names_text(missing)}. "
                f"Please provide all required input(s)."
            )
    return by_name


def _check_outputs(model: LoadedModel, request: InferenceRequest) -> None:
    for output in request.outputs or ():
        if output.name not in model.outputs:
            raise InvalidArgumentError(
                f"unexpected inference output '{output.name}' for model '{model.name}'"
            )
        if output.classification < 0:
            raise InvalidArgumentError(
                f"{_prefix(request)}'classification' of output '{output.name}' must be a positive integer"
            )


def _refuse_repeated_outputs(request: InferenceRequest) -> None:
    """An output named twice is refused, as newer Triton does (triton-inference-server/core#493: the second one's
    buffers leaked there; 2.51 answered it once). Triton adds requested outputs as it reads the request, before
    its core checks the inputs, so this comes first. The wording is that of its input twin."""
    outputs = request.outputs or ()
    if len(outputs) < 2:
        return
    seen: set[str] = set()
    for output in outputs:
        if output.name in seen:
            raise InvalidArgumentError(f"{_prefix(request)}output '{output.name}' already exists in request")
        seen.add(output.name)


def _check_shapes(model: LoadedModel, request: InferenceRequest, inputs: dict[str, InputTensor]) -> int:
    """Triton's order: every input's batch dim first, then the batch size against the model, then the dims."""
    max_batch = model.max_batch_size
    if max_batch <= 0:
        for name, tensor in inputs.items():
            if not _dims_match(model.inputs[name].dims, tensor.shape):
                _bad_shape(model, request, name, model.inputs[name].dims, tensor.shape)
        return 1
    batch = _batch_dim(model, request, inputs)
    if batch is None:
        return 1
    if batch > max_batch:
        raise InvalidArgumentError(
            f"{_prefix(request)}inference request batch-size must be <= {max_batch} for '{model.name}'"
        )
    if batch < 1:
        raise InvalidArgumentError(f"{_prefix(request)}inference request batch-size must be >= 1 for '{model.name}'")
    for name, tensor in inputs.items():
        dims = model.inputs[name].dims
        if not _dims_match(dims, tensor.shape[1:]):
            _bad_shape(model, request, name, (-1, *dims), tensor.shape)
    return batch


def _batch_dim(model: LoadedModel, request: InferenceRequest, inputs: dict[str, InputTensor]) -> int | None:
    """The batch dim every input has, the same in all; None without inputs."""
    batch: int | None = None
    for name, tensor in inputs.items():
        if not tensor.shape:
            raise InvalidArgumentError(
                f"{_prefix(request)}input '{name}' has no shape but model requires batch dimension for '{model.name}'"
            )
        if batch is None:
            batch = tensor.shape[0]
        elif tensor.shape[0] != batch:
            raise InvalidArgumentError(
                f"{_prefix(request)}input '{name}' batch size does not match other inputs for '{model.name}'"
            )
    return batch


def _dims_match(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    if len(dims) != len(shape):
        return False
    return all(d == -1 or d == s for d, s in zip(dims, shape, strict=True))


def _bad_shape(
    model: LoadedModel, request: InferenceRequest, name: str, expected: Sequence[int], got: Sequence[int]
) -> NoReturn:
    note = ""
    if model.max_batch_size > 0:
        note = (
            "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
            "prepended to each input shape. If you want to specify the full shape including the batch dim in "
            "your input dims config, try setting max_batch_size to zero. See the model configuration docs for "
            "more info on max_batch_size."
        )
    raise InvalidArgumentError(
        f"{_prefix(request)}unexpected shape for input '{name}' for model '{model.name}'. "
        f"Expected {_shape_text(expected)}, got {_shape_text(got)}. {note}"
    )
