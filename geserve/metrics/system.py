"""CPU utilization and memory read from /proc (Linux), sampled once per `--metrics-interval-ms` as in Triton."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client.metrics_core import Metric


@dataclass(frozen=True, slots=True)
class CpuReading:
    utilization: float
    """Busy share of all cores over the last interval, 0.0 - 1.0."""
    memory_total_bytes: int
    memory_used_bytes: int


class CpuSampler:
    """Keeps the latest reading; `sample()` is called on the metrics interval, off the inference path."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._previous: tuple[int, int] | None = None
        self.latest: CpuReading | None = None

    @property
    def available(self) -> bool:
        return (self._proc / "stat").is_file() and (self._proc / "meminfo").is_file()

    def sample(self) -> CpuReading | None:
        try:
            busy, total = self._cpu_times()
            mem_total, mem_available = self._memory()
        except (OSError, ValueError):
            return self.latest
        utilization = 0.0
        if self._previous is not None:
            delta_total = total - self._previous[1]
            if delta_total > 0:
                utilization = min(1.0, max(0.0, (busy - self._previous[0]) / delta_total))
        self._previous = (busy, total)
        self.latest = CpuReading(utilization, mem_total, mem_total - mem_available)
        return self.latest

    def _cpu_times(self) -> tuple[int, int]:
        """(busy, total) jiffies of the aggregate `cpu` line: idle and iowait are idle; guest is in user."""
        with open(self._proc / "stat", "rb") as stat:
            fields = stat.readline().split()
        if not fields or fields[0] != b"cpu":
            raise ValueError("no aggregate cpu line in /proc/stat")
        jiffies = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        jiffies += [0] * (8 - len(jiffies))
        total = sum(jiffies)
        return total - jiffies[3] - jiffies[4], total

    def _memory(self) -> tuple[int, int]:
        """(MemTotal, MemAvailable) in bytes."""
        values: dict[bytes, int] = {}
        with open(self._proc / "meminfo", "rb") as meminfo:
            for line in meminfo:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    values[key] = int(rest.split()[0]) * 1024
        return values[b"MemTotal"], values.get(b"MemAvailable", 0)


def cpu_families(reading: CpuReading) -> list[Metric]:
    """Triton's CPU gauges for one reading."""
    families = []
    for name, documentation, value in (
        ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", reading.utilization),
        ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", reading.memory_total_bytes),
        ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", reading.memory_used_bytes),
    ):
        family = Metric(name, documentation, "gauge")
        family.add_sample(name, {}, value)
        families.append(family)
    return families


class CpuCollector:
    """The CPU gauges of the sampler's latest reading, as a collector (a registry of the machine's families)."""

    def __init__(self, sampler: CpuSampler) -> None:
        self._sampler = sampler

    def collect(self) -> list[Metric]:
        reading = self._sampler.latest
        return cpu_families(reading) if reading is not None else []
