"""Device selection: which ONNX Runtime execution provider serves an instance, and how many CPU threads.

CPU everywhere; CUDA and CANN (Ascend, through Graph Engine) where their execution providers exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort
from tritonclient.grpc import model_config_pb2

from geserve.errors import UnavailableError

KIND_CPU = model_config_pb2.ModelInstanceGroup.KIND_CPU
KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
KIND_MODEL = model_config_pb2.ModelInstanceGroup.KIND_MODEL

_ACCELERATOR_PROVIDERS = {
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "npu": "CANNExecutionProvider",
    "cann": "CANNExecutionProvider",
}


@dataclass(frozen=True, slots=True)
class ExecutionTarget:
    """The provider list for one ONNX Runtime session, most preferred first."""

    device: str  # "cpu", "cuda:0", "npu:1"
    providers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def available_providers() -> list[str]:
    return ort.get_available_providers()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def threads_per_instance(instance_count: int) -> int:
    """Split the machine's cores across a model's instances so parallel instances do not oversubscribe."""
    return max(1, cpu_count() // max(1, instance_count))


def default_instance_kind() -> int:
    """Triton places instances on GPUs when the machine has one; otherwise on the CPU."""
    return KIND_GPU if _accelerator_provider() else KIND_CPU


def _accelerator_provider() -> str | None:
    available = set(available_providers())
    for name in ("CUDAExecutionProvider", "CANNExecutionProvider"):
        if name in available:
            return name
    return None


def resolve_target(kind: int, device_id: int, accelerator: str | None = None) -> ExecutionTarget:
    """The execution target for an instance of `kind` on `device_id`.

    `accelerator` names a provider family ("cuda", "npu", "tensorrt"); "cpu" or None on a CPU instance.
    """
    cpu: tuple[str, dict[str, Any]] = ("CPUExecutionProvider", {})
    if kind != KIND_GPU and accelerator in (None, "", "cpu"):
        return ExecutionTarget("cpu", [cpu])
    provider = _ACCELERATOR_PROVIDERS.get(accelerator or "") if accelerator else _accelerator_provider()
    if accelerator and accelerator not in _ACCELERATOR_PROVIDERS and accelerator != "cpu":
        raise UnavailableError(
            f"unknown execution accelerator '{accelerator}'; expected one of cpu, "
            + ", ".join(sorted(_ACCELERATOR_PROVIDERS))
        )
    if provider is None or provider not in available_providers():
        raise UnavailableError(
            f"instance kind {model_config_pb2.ModelInstanceGroup.Kind.Name(kind)} needs an accelerator, "
            f"but this onnxruntime build only has {', '.join(available_providers())}"
        )
    prefix = "npu" if provider == "CANNExecutionProvider" else "cuda"
    return ExecutionTarget(f"{prefix}:{device_id}", [(provider, {"device_id": device_id}), cpu])
