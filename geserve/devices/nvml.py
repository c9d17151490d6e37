"""GPU metrics from NVML (nvidia-ml-py, import-guarded) with Triton's family names, labelled by GPU UUID.

Read at scrape time: each NVML query takes microseconds and none runs on the inference path. Energy is counted
from the collector's start, as Triton counts it from the server's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from prometheus_client.core import Metric

logger = logging.getLogger(__name__)

# (family, help, kind), in Triton's words.
FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "gauge"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "gauge"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the Triton Server started", "counter"),
)
GPU_FAMILY_NAMES = frozenset(name for name, _, _ in FAMILIES)


def load_nvml() -> ModuleType | None:
    """pynvml, initialised, or None (not installed, or no driver: then the GPU families are simply absent)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml.NVMLError: no driver, no device
        logger.info("GPU metrics are off: NVML did not start (%s)", exc)
        return None
    return pynvml


class GpuCollector:
    """Triton's nv_gpu_* / nv_energy_consumption families for `devices` (NVML indices; all by default)."""

    def __init__(self, nvml: Any, devices: Sequence[int] | None = None) -> None:
        self._nvml = nvml
        count = nvml.nvmlDeviceGetCount()
        indices = range(count) if devices is None else [i for i in devices if 0 <= i < count]
        self._gpus: list[tuple[str, Any]] = []
        self._energy_start: dict[str, float] = {}
        for index in indices:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            self._gpus.append((uuid, handle))
            energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy is not None:
                self._energy_start[uuid] = float(energy)

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    def collect(self) -> Iterator[Metric]:
        families = {name: Metric(name, documentation, kind) for name, documentation, kind in FAMILIES}
        nvml = self._nvml
        for uuid, handle in self._gpus:
            labels = {"gpu_uuid": uuid}
            utilization = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            if utilization is not None:
                _add(families["nv_gpu_utilization"], labels, utilization.gpu / 100.0)
            memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                _add(families["nv_gpu_memory_total_bytes"], labels, memory.total)
                _add(families["nv_gpu_memory_used_bytes"], labels, memory.used)
            power = self._read(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
            if power is not None:
                _add(families["nv_gpu_power_usage"], labels, power / 1000.0)
            limit = self._read(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            if limit is not None:
                _add(families["nv_gpu_power_limit"], labels, limit / 1000.0)
            energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # millijoules since driver load
            start = self._energy_start.get(uuid)
            if energy is not None and start is not None:
                _add(families["nv_energy_consumption"], labels, max(0.0, (energy - start) / 1000.0))
        yield from (family for family in families.values() if family.samples)

    @staticmethod
    def _read(query: Any, handle: Any) -> Any:
        """A query's value, or None where the GPU does not support it (NVML_ERROR_NOT_SUPPORTED and kin)."""
        try:
            return query(handle)
        except Exception:
            return None


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    family.add_sample(family.name, labels, value)  # Triton's counters carry no _total suffix
