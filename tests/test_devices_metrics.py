"""Triton's GPU metric families from NVML, read through a stand-in for pynvml (no NVIDIA driver here); on a GPU,
tests/test_devices_gpu.py scrapes the real ones. Also: without nvidia-ml-py the families are simply absent."""

from __future__ import annotations

import types

from prometheus_client import CollectorRegistry

from geserve.devices.nvml import GPU_FAMILY_NAMES, GpuCollector, load_nvml
from geserve.metrics.exposition import render


class _NotSupported(Exception):
    pass


def _fake_nvml() -> types.SimpleNamespace:
    energy = {0: 5_000_000, 1: 1_000}

    def power(handle: int) -> int:
        if handle == 1:
            raise _NotSupported("NVML_ERROR_NOT_SUPPORTED")
        return 123_500

    return types.SimpleNamespace(
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetUUID=lambda handle: f"GPU-0000000{handle}-aaaa-bbbb-cccc-dddddddddddd".encode(),
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: energy[handle],
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=42, memory=10),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(total=141 << 30, used=2 << 30, free=139 << 30),
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetPowerManagementLimit=lambda handle: 700_000,
        energy=energy,
    )


def test_gpu_families_by_uuid_with_energy_since_start() -> None:
    nvml = _fake_nvml()
    collector = GpuCollector(nvml)
    nvml.energy[0] += 2_500  # 2.5 J since the collector started
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = render(registry).decode()  # as the server renders its registry
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    first = 'gpu_uuid="GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"'
    second = 'gpu_uuid="GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"'
    assert values[f"nv_gpu_utilization{{{first}}}"] == 0.42
    assert values[f"nv_gpu_memory_total_bytes{{{first}}}"] == 141 << 30
    assert values[f"nv_gpu_memory_used_bytes{{{second}}}"] == 2 << 30
    assert values[f"nv_gpu_power_usage{{{first}}}"] == 123.5
    assert f"nv_gpu_power_usage{{{second}}}" not in values  # not supported on that GPU: left out, not zero
    assert values[f"nv_gpu_power_limit{{{first}}}"] == 700.0
    assert values[f"nv_energy_consumption{{{first}}}"] == 2.5
    assert "# TYPE nv_energy_consumption counter" in text
    assert {name for name in GPU_FAMILY_NAMES if f"# TYPE {name} " in text} == GPU_FAMILY_NAMES


def test_only_listed_gpus_are_reported() -> None:
    assert GpuCollector(_fake_nvml(), devices=[1, 5]).gpu_count == 1


def test_without_nvml_there_is_nothing_to_register() -> None:
    assert load_nvml() is None  # nvidia-ml-py is not installed here (or finds no driver)
