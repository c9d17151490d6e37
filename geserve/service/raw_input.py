"""Triton's raw binary HTTP request (no JSON header): the body is the model's single input, its shape deduced."""

from __future__ import annotations

import numpy as np

from geserve.errors import InvalidArgumentError
from geserve.repository.model import LoadedModel
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
    variable = [k for k, d in enumerate(shape) if d == -1]
    if len(variable) > 1:
        raise InvalidArgumentError(
            f"{prefix}The shape of the raw input '{spec.name}' can not be deduced because there are more than one "
            f"variable-sized dimension"
        )
    if datatype.wire == "BYTES":
        if variable or fixed != 1:
            raise InvalidArgumentError(
                f"{prefix}For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        data = np.empty(1, dtype=object)
        data[0] = body
    else:
        if variable:
            shape[variable[0]] = len(body) // (fixed * datatype.itemsize) if fixed else 0
        count = 1
        for dim in shape:
            count *= dim
        if count * datatype.itemsize != len(body):
            raise InvalidArgumentError(
                f"{prefix}input byte size mismatch for input '{spec.name}' for model '{model.name}'. "
                f"Expected {count * datatype.itemsize}, got {len(body)}"
            )
        data = np.frombuffer(body, dtype=datatype.numpy, count=count)
    shape_t = tuple(shape)
    request.inputs = [InputTensor(spec.name, datatype.wire, shape_t, data.reshape(shape_t))]
    request.parameters = {"binary_data_output": True}
