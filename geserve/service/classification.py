"""Triton's classification extension: an output replaced by its top-k "value:index[:label]" strings."""

from __future__ import annotations

from typing import Any

import numpy as np

from geserve.errors import InvalidArgumentError
from geserve.types import OutputTensor


def classify(output: OutputTensor, k: int, labels: list[str] | None, batching: bool) -> OutputTensor:
    data = output.data
    if data.dtype.kind not in "biuf":
        raise InvalidArgumentError(f"class result not available for output '{output.name}' of type {output.datatype}")
    rows = data.reshape(data.shape[0], -1) if batching and data.ndim else data.reshape(1, -1)
    k = min(k, rows.shape[1])
    top = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    is_float = data.dtype.kind == "f"
    result: np.ndarray[Any, Any] = np.empty(top.shape, dtype=object)
    for r, indices in enumerate(top):
        for c, index in enumerate(indices):
            value = rows[r, index]
            text = f"{value:f}" if is_float else str(value)
            text = f"{text}:{index}"
            if labels is not None and index < len(labels):
                text = f"{text}:{labels[index]}"
            result[r, c] = text.encode()
    if not batching:
        result = result.reshape(k)
    return OutputTensor(output.name, "BYTES", result.shape, result)
