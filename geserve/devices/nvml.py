"""GPU metrics from NVML (nvidia-ml-py, import-guarded) with Triton's family names, labelled by GPU UUID.

Read at scrape time: each NVML query takes microseconds and none runs on the inference path. Energy is counted
from the collector's start, as Triton counts it from the server's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
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
# NVML query -> the gauges its reading gives, each (family, value from the reading); one query feeds both memory
# gauges, so the two describe the same moment. Power readings are in milliwatts.
_GAUGES: tuple[tuple[str, tuple[tuple[str, Callable[[Any], float]], ...]], ...] = (
    ("nvmlDeviceGetUtilizationRates", (("nv_gpu_utilization", lambda reading: reading.gpu / 100.0),)),
    ("nvmlDeviceGetMemoryInfo", (("nv_gpu_memory_total_bytes", lambda reading: reading.total),
                                 ("nv_gpu_memory_used_bytes", lambda reading: reading.used))),
    ("nvmlDeviceGetPowerUsage", (("nv_gpu_power_usage", lambda reading: reading / 1000.0),)),
    ("nvmlDeviceGetPowerManagementLimit", (("nv_gpu_power_limit", lambda reading: reading / 1000.0),)),
)


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
        for uuid, handle in self._gpus:
            self._sample(families, uuid, handle)
        yield from (family for family in families.values() if family.samples)

    def _sample(self, families: dict[str, Metric], uuid: str, handle: Any) -> None:
        """One GPU's readings added to `families`; a query the GPU does not support adds nothing."""
        labels = {"gpu_uuid": uuid}
        for query, gauges in _GAUGES:
            reading = self._read(getattr(self._nvml, query), handle)
            if reading is None:
                continue
            for family, value in gauges:
                _add(families[family], labels, value(reading))
        energy = self._read(self._nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # millijoules since driver load
        start = self._energy_start.get(uuid)
        if energy is not None and start is not None:
            _add(families["nv_energy_consumption"], labels, max(0.0, (energy - start) / 1000.0))

    @staticmethod
    def _read(query: Any, handle: Any) -> Any:
        """A query's value, or None where the GPU does not support it (NVML_ERROR_NOT_SUPPORTED and kin)."""
        try:
            return query(handle)
        except Exception:
            return None


def _add(family: Metric, labels: dict[str, str], value: float) -> None:
    family.add_sample(family.name, labels, value)  # Triton's counters carry no _total suffix
