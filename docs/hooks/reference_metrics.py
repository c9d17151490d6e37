"""reference/metrics.md: every metric family of GET /metrics with its type, help and labels.

No server is started: the server's own registry (`geserve.metrics.collector.build_registry`) is built over a stand-in
model manager holding one loaded model version with real statistics, with a CPU reading and, for the GPU families,
NVML answered by a stand-in GPU; it is collected once per configuration, which also tells when each family appears.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prometheus_client.core import Metric
from reference_markdown import GENERATED_NOTE, anchor, code, table, text

from geserve.config import ModelConfig
from geserve.devices.nvml import GpuCollector
from geserve.metrics.collector import build_registry
from geserve.metrics.config import MetricsConfig
from geserve.metrics.latency import LatencyRecorder
from geserve.metrics.system import CpuReading, CpuSampler
from geserve.repository.budget import ON_DEMAND, BudgetSnapshot, LoadHistogram
from geserve.repository.model import LoadedModel, ModelState
from geserve.repository.versions import ModelRecord
from geserve.scheduling.admission import Admission, AdmissionSettings
from geserve.statistics import ModelStatistics

_INTRO = """\
# Metrics

{note}

Every metric family the Prometheus endpoint (`GET /metrics` on `--metrics-port`, default 8002) serves, generated from
the server's collectors when this site is built. Triton's families keep Triton's names (`nv_*`), help texts and labels;
geserve's own start with `ge_`. Counters carry no `_total` suffix unless the name has one. A family is served once it
has a series (those labelled `model` once a model version is loaded); the *appears* column says what else it needs
beyond `--allow-metrics` (default true). Python models may add families of their own (Triton's
`pb_utils.MetricFamily`); they are not listed here.
"""
_OFF = MetricsConfig(counter_latencies=False)


@dataclass(frozen=True)
class _Setup:
    """One configuration the registry is collected in: a metrics config and what the machine and model offer."""

    config: MetricsConfig = _OFF
    cached: bool = False
    overload: bool = False
    cpu: bool = False
    gpu: bool = False
    budget: bool = False


# In order: a family appears under the first condition whose collection holds it and the unconditional one does not.
_CONDITIONS = (
    ("`--metrics-config counter_latencies=true` (the default)", _Setup(config=MetricsConfig())),
    ("`--metrics-config summary_latencies=true`", _Setup(config=MetricsConfig(False, summary_latencies=True))),
    ("`--metrics-config histogram_latencies=true`", _Setup(config=MetricsConfig(False, histogram_latencies=True))),
    ("a model using the response cache (`--cache-config`), with `counter_latencies`",
     _Setup(config=MetricsConfig(), cached=True)),
    ("a model under admission control (`--overload-control on`, or its `overload_control` parameter)",
     _Setup(overload=True)),
    ("`--model-memory-budget` or `--load-on-demand` (`ge_memory_budget_bytes` with a budget)", _Setup(budget=True)),
    ("`--allow-cpu-metrics` (default true), where /proc exists", _Setup(cpu=True)),
    ("`--allow-gpu-metrics` (default true), with NVML (`geserve[cuda]` and a driver)", _Setup(gpu=True)),
)


class _Scheduler:
    inflight_count = 0


class _Loads:
    """The server's decider of loads (repository/budget.py) after one on-demand load that evicted a model."""

    def snapshot(self) -> BudgetSnapshot:
        loads = LoadHistogram()
        loads.observe(ON_DEMAND, 0.05)
        return BudgetSnapshot(1 << 30, {"model": {1: 1 << 20}}, {"other": 1}, {"model": 1}, loads)


class _Manager:
    """The calls the collector makes of a ModelManager, over one loaded model version."""

    def __init__(self, model: LoadedModel) -> None:
        self._model = model

    def models(self) -> list[LoadedModel]:
        return [self._model]

    def record(self, name: str) -> ModelRecord:
        return ModelRecord(name)

    def index(self) -> list[dict[str, str]]:
        return [{"name": self._model.name, "version": str(self._model.version), "state": ModelState.READY.value}]


class _Nvml:
    """One GPU answering every NVML query GpuCollector makes, so that each GPU family shows its labels."""

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=0, used=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return 0

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        return 0

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return 0


def collect(setup: _Setup) -> dict[str, Metric]:
    """The families one scrape returns in `setup`, by name."""
    paths = {"inline": 0, "queued": 0, "task": 0}  # InferenceService.paths, as a fresh server has them
    loads: Any = _Loads() if setup.budget else None
    registry = build_registry(_Manager(_model(setup)), setup.config, _cpu() if setup.cpu else None, paths=paths,
                              loads=loads)
    if setup.gpu:
        registry.register(GpuCollector(_Nvml()))
    return {family.name: family for family in registry.collect()}


def _model(setup: _Setup) -> LoadedModel:
    config = ModelConfig(name="model", max_batch_size=8)
    config.instance_group.add(count=1)
    statistics = ModelStatistics(LatencyRecorder(setup.config) if setup.config.observes_latencies else None)
    scheduler: Any = _Scheduler()
    admission = Admission("model", AdmissionSettings.from_config(config), statistics) if setup.overload else None
    return LoadedModel("model", 1, config, scheduler, statistics, {}, {}, response_cache=int(setup.cached),
                       admission=admission)


def _cpu() -> CpuSampler:
    sampler = CpuSampler()
    sampler.latest = CpuReading(0.0, 0, 0)
    return sampler


def families() -> Iterator[tuple[Metric, str]]:
    """Every family, each with the condition it appears under ("" for always), Triton's first."""
    seen = collect(_Setup())
    found = {name: (family, "") for name, family in seen.items()}
    for condition, setup in _CONDITIONS:
        for name, family in collect(setup).items():
            found.setdefault(name, (family, condition))
    yield from sorted(found.values(), key=lambda item: (not item[0].name.startswith("nv_"), item[0].name))


def labels(family: Metric) -> list[str]:
    """The label names of the family's samples, in the order they first appear."""
    names: dict[str, None] = {}
    for sample in family.samples:
        names.update(dict.fromkeys(sample.labels))
    return list(names)


def _appears(family: Metric, condition: str) -> str:
    if not family.samples:  # declared by a collector, but nothing in geserve records a value for it yet
        return "never yet: declared, but nothing in geserve records a value for it"
    return condition or "always"


def page() -> str:
    rows = [
        [f"{anchor(family.name)}{code(family.name)}", family.type, " ".join(code(n) for n in labels(family)),
         text(family.documentation), _appears(family, condition)]
        for family, condition in families()
    ]
    lines = [_INTRO.format(note=GENERATED_NOTE.format(source=Path(__file__).name)), ""]
    return "\n".join([*lines, *table(["family", "type", "labels", "help", "appears"], rows)]) + "\n"
