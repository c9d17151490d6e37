"""The execution target of one instance: ONNX Runtime's provider list for its session, most preferred first, with
each provider's options; and the CPU thread share of an instance."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort
from tritonclient.grpc import model_config_pb2

from geserve.errors import UnavailableError

KIND_CPU = model_config_pb2.ModelInstanceGroup.KIND_CPU
KIND_GPU = model_config_pb2.ModelInstanceGroup.KIND_GPU
KIND_MODEL = model_config_pb2.ModelInstanceGroup.KIND_MODEL

CPU_PROVIDER = "CPUExecutionProvider"
CUDA_PROVIDER = "CUDAExecutionProvider"
TENSORRT_PROVIDER = "TensorrtExecutionProvider"
CANN_PROVIDER = "CANNExecutionProvider"

# An accelerator name (execution_accelerator / --backend-config=ge,execution_accelerators=...) -> the providers that
# run it, in ONNX Runtime's order of preference: TensorRT leaves the nodes it cannot take to CUDA, then to the CPU.
_ACCELERATOR_PROVIDERS = {
    "cuda": (CUDA_PROVIDER,),
    "gpu": (CUDA_PROVIDER,),
    "tensorrt": (TENSORRT_PROVIDER, CUDA_PROVIDER),
    "npu": (CANN_PROVIDER,),
    "cann": (CANN_PROVIDER,),
}
ACCELERATORS = ("cpu", *_ACCELERATOR_PROVIDERS)

ProviderOptions = Mapping[str, Mapping[str, str]]
"""Options by provider name, device_id excepted (the placement gives it)."""


@dataclass(frozen=True, slots=True)
class ExecutionTarget:
    """The provider list for one ONNX Runtime session, most preferred first."""

    device: str  # "cpu", "cuda:0", "npu:1"
    providers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda:")

    @property
    def device_id(self) -> int:
        return int(self.device.partition(":")[2] or 0)


def available_providers() -> list[str]:
    return ort.get_available_providers()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


_processes_sharing_cores = 1


def share_cores(processes: int) -> None:
    """This process is one of `processes` that serve on the same cores (--workers): each takes its share."""
    global _processes_sharing_cores
    _processes_sharing_cores = max(1, processes)


def threads_per_instance(instance_count: int) -> int:
    """Split this process's share of the cores across a model's instances so parallel instances (and the other
    workers' instances) do not oversubscribe them."""
    return max(1, cpu_count() // _processes_sharing_cores // max(1, instance_count))


def default_instance_kind() -> int:
    """Triton places instances on GPUs when the machine has one; otherwise on the CPU."""
    return KIND_GPU if _accelerator_provider() else KIND_CPU


def _accelerator_provider() -> str | None:
    available = set(available_providers())
    for name in (CUDA_PROVIDER, CANN_PROVIDER):
        if name in available:
            return name
    return None


def accelerator_of(kind: int, accelerator: str | None) -> str:
    """The accelerator family an instance of `kind` runs on: "cpu", "cuda", "tensorrt" or "npu"."""
    if accelerator in ("npu", "cann"):
        return "npu"
    if accelerator == "gpu":
        return "cuda"
    if accelerator not in (None, ""):
        return accelerator
    if kind != KIND_GPU:
        return "cpu"
    return "npu" if _accelerator_provider() == CANN_PROVIDER else "cuda"


def _require_providers(kind: int, family: str, wanted: Sequence[str]) -> None:
    """Refuse a family whose providers this onnxruntime build lacks, naming the package that brings them."""
    available = available_providers()
    missing = [name for name in wanted if name not in available]
    if missing:
        extra = "geserve[cuda] (onnxruntime-gpu)" if family != "npu" else "onnxruntime-cann with the CANN toolkit"
        raise UnavailableError(
            f"instance kind {model_config_pb2.ModelInstanceGroup.Kind.Name(kind)} on '{family}' needs "
            f"{', '.join(missing)}, but this onnxruntime build only has {', '.join(available)}; install {extra}"
        )


def resolve_target(
    kind: int, device_id: int, accelerator: str | None = None, options: ProviderOptions | None = None
) -> ExecutionTarget:
    """The execution target for an instance of `kind` on `device_id`.

    `accelerator` names a provider family ("cuda", "tensorrt", "npu"); "cpu" or None on a CPU instance, and None on
    a GPU instance means the machine's accelerator. `options` adds each provider's own options.
    """
    cpu: tuple[str, dict[str, Any]] = (CPU_PROVIDER, {})
    if accelerator and accelerator not in ACCELERATORS:
        raise UnavailableError(
            f"unknown execution accelerator '{accelerator}'; expected one of {', '.join(sorted(ACCELERATORS))}"
        )
    family = accelerator_of(kind, accelerator)
    if family == "cpu":
        return ExecutionTarget("cpu", [cpu])
    wanted = _ACCELERATOR_PROVIDERS[family]
    _require_providers(kind, family, wanted)
    given = options or {}
    providers = [(name, {"device_id": device_id, **given.get(name, {})}) for name in wanted]
    prefix = "npu" if family == "npu" else "cuda"
    return ExecutionTarget(f"{prefix}:{device_id}", [*providers, cpu])
