"""CUDA execution provider options from a model's parameters, with the names Triton's onnxruntime backend reads, and
the GPUs this process can see.

Triton's parameters: `cudnn_conv_algo_search` (0 exhaustive, 1 heuristic, 2 default), `gpu_mem_limit` (bytes),
`arena_extend_strategy` (0 next power of two, 1 same as requested), `do_copy_in_default_stream`,
`cudnn_conv_use_max_workspace`, `enable_cuda_graph`, `tunable_op_enable`, `use_tf32`; and `optimization { cuda {
graphs: true } }` for CUDA graphs. Values reach ONNX Runtime as its own option strings.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from geserve.errors import InvalidArgumentError

_ALGO_SEARCH = {"0": "EXHAUSTIVE", "1": "HEURISTIC", "2": "DEFAULT"}
_ARENA = {"0": "kNextPowerOfTwo", "1": "kSameAsRequested"}
_FLAGS = ("do_copy_in_default_stream", "cudnn_conv_use_max_workspace", "enable_cuda_graph", "tunable_op_enable",
          "use_tf32")
CUDA_PARAMETERS = frozenset({"cudnn_conv_algo_search", "gpu_mem_limit", "arena_extend_strategy", *_FLAGS})


def cuda_options(parameters: Mapping[str, str], cuda_graphs: bool = False) -> dict[str, str]:
    """CUDAExecutionProvider options for the CUDA_PARAMETERS among `parameters` (others are not looked at)."""
    options: dict[str, str] = {}
    for key, raw in parameters.items():
        if key not in CUDA_PARAMETERS:
            continue
        value = raw.strip()
        if key == "cudnn_conv_algo_search":
            options[key] = _choice(key, value, _ALGO_SEARCH)
        elif key == "arena_extend_strategy":
            options[key] = _choice(key, value, _ARENA)
        elif key == "gpu_mem_limit":
            if not value.isdigit():
                raise InvalidArgumentError(f"parameter 'gpu_mem_limit' expects a byte count, got '{raw}'")
            options[key] = value
        else:
            options[key] = "1" if flag(key, value) else "0"
    if cuda_graphs:
        options.setdefault("enable_cuda_graph", "1")
    return options


def flag(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise InvalidArgumentError(f"parameter '{key}' expects true/false or 1/0, got '{value}'")


def _choice(key: str, value: str, choices: Mapping[str, str]) -> str:
    if value in choices:
        return choices[value]
    if value in choices.values():  # ONNX Runtime's own spelling is accepted too
        return value
    raise InvalidArgumentError(
        f"parameter '{key}' expects one of {', '.join(f'{k} ({v})' for k, v in choices.items())}, got '{value}'"
    )


@functools.cache
def visible_gpus() -> tuple[int, ...] | None:
    """The CUDA device ids this process can see; None when it cannot tell (no NVML, no CUDA runtime)."""
    from geserve.devices.cuda_runtime import device_count

    count = device_count()
    return None if count is None else tuple(range(count))
