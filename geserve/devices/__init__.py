"""Devices: where an instance runs (placement), which ONNX Runtime execution provider runs it and with what options
(CPU, CUDA, TensorRT, CANN), the compute threads' CPU priority below the event loop, device memory shared with
clients (CUDA IPC) and device metrics (NVML).

Every accelerator library is imported where it is used and guarded: a CPU-only install imports none of them.
"""

from geserve.devices.placement import Placement, placements
from geserve.devices.target import (
    KIND_CPU,
    KIND_GPU,
    KIND_MODEL,
    ExecutionTarget,
    available_providers,
    cpu_count,
    default_instance_kind,
    resolve_target,
    share_cores,
    threads_per_instance,
)

__all__ = [
    "KIND_CPU",
    "KIND_GPU",
    "KIND_MODEL",
    "ExecutionTarget",
    "Placement",
    "available_providers",
    "cpu_count",
    "default_instance_kind",
    "placements",
    "resolve_target",
    "share_cores",
    "threads_per_instance",
]
