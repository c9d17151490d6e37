"""Triton's raw binary HTTP request (no JSON header): the body is the model's single input, its shape deduced."""

from __future__ import annotations

import numpy as np

from geserve.errors import InvalidArgumentError
from geserve.repository.model import LoadedModel, TensorSpec
from geserve.types import BY_WIRE, InferenceRequest, InputTensor, id_prefix


def expand_raw_input(model: LoadedModel, request: InferenceRequest, body: bytes) -> None:
    """Make `body` the request's single input, shaped as Triton deduces it: batch 1 for a batching model, the
    model's dims, and one variable-size dim (if any) from the body's length; a BYTES input must have dims [1]."""
    prefix = id_prefix("")
    if len(model.inputs) != 1:
        raise InvalidArgumentError(
            f"{prefix}Raw request must only have 1 input (found 1) to be deduced but got {len(model.inputs)} "
            f"inputs in '{model.name}' model configuration"
        )
    spec = next(iter(model.inputs.values()))
    datatype = BY_WIRE[spec.wire_type]
    shape = [1, *spec.dims] if model.max_batch_size > 0 else list(spec.dims)
    fixed = 1
    for dim in spec.dims:
        fixed *= 1 if dim == -1 else dim
    variable = _variable_dim(spec, shape)
    if datatype.wire == "BYTES":
        data = _bytes_input(spec, body, variable is not None or fixed != 1)
    else:
        data = _fixed_size_input(model, spec, shape, variable, fixed, body)
    shape_t = tuple(shape)
    request.inputs = [InputTensor(spec.name, datatype.wire, shape_t, data.reshape(shape_t))]
    request.parameters = {"binary_data_output": True}


def _variable_dim(spec: TensorSpec, shape: list[int]) -> int | None:
    """The one variable-size dim of the input's shape, if any (more cannot be deduced)."""
    variable = [k for k, d in enumerate(shape) if d == -1]
    if len(variable) > 1:
        raise InvalidArgumentError(
            f"{id_prefix('')}The shape of the raw input '{spec.name}' can not be deduced because there are more than "
            f"one variable-sized dimension"
        )
    return variable[0] if variable else None


def _bytes_input(spec: TensorSpec, body: bytes, not_one: bool) -> np.ndarray:
    """A raw BYTES input: the body is its one element; the model's shape must be [1] (`not_one` when not)."""
    if not_one:
        raise InvalidArgumentError(
            f"{id_prefix('')}For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
        )
    data = np.empty(1, dtype=object)
    data[0] = body
    return data


def _fixed_size_input(
    model: LoadedModel, spec: TensorSpec, shape: list[int], variable: int | None, fixed: int, body: bytes
) -> np.ndarray:
    """The elements of a raw input of a fixed-size datatype, setting its variable dim (`shape[variable]`) from the
    body's length; the body must fill the shape exactly."""
    datatype = BY_WIRE[spec.wire_type]
    if variable is not None:
        shape[variable] = len(body) // (fixed * datatype.itemsize) if fixed else 0
    count = 1
    for dim in shape:
        count *= dim
    if count * datatype.itemsize != len(body):
        raise InvalidArgumentError(
            f"{id_prefix('')}input byte size mismatch for input '{spec.name}' for model '{model.name}'. "
            f"Expected {count * datatype.itemsize}, got {len(body)}"
        )
    return np.frombuffer(body, dtype=datatype.numpy, count=count)
