"""The Prometheus text of several workers as the metrics of one server: counters, histograms and most gauges add
up; host- and device-wide gauges are the same in every worker and are taken once; quantiles take the largest.

Our own reader of the text geserve itself writes (metrics/exposition.py): prometheus_client's parser renames
counters to `<name>_total`, which Triton's nv_* counters are not called."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from geserve.metrics.exposition import format_value

# Gauges that describe the machine or a model's state rather than one worker's share: every worker reports the
# same reading, so the first one's stands.
_SAME_IN_EVERY_WORKER = ("nv_cpu_", "nv_gpu_", "nv_energy_", "ge_model_state")
_LARGEST = ("nv_model_load_duration_secs",)


@dataclass(slots=True)
class _Family:
    comments: list[str]
    rule: str = "sum"
    samples: dict[str, float] = field(default_factory=dict)  # `name{labels}` -> value

    def add(self, key: str, value: float) -> None:
        """Another worker's sample: summed, the largest kept (quantiles, max gauges), or the first's kept."""
        samples = self.samples
        if key not in samples:
            samples[key] = value
        elif 'quantile="' in key or self.rule == "max":
            samples[key] = max(samples[key], value)
        elif self.rule == "sum":
            samples[key] += value


def _rule(name: str, kind: str) -> str:
    if kind == "gauge":
        if name.startswith(_SAME_IN_EVERY_WORKER):
            return "first"
        if name in _LARGEST:
            return "max"
    return "sum"


def merge_expositions(texts: Sequence[str]) -> bytes:
    """One exposition with every family of `texts`, one line per sample name and labels."""
    families: dict[str, _Family] = {}
    for text in texts:
        _merge_text(families, text)
    lines: list[str] = []
    for family in families.values():
        if family.samples:
            lines += family.comments
            lines += [f"{key} {format_value(value)}" for key, value in family.samples.items()]
    lines.append("")
    return "\n".join(lines).encode()


def _merge_text(families: dict[str, _Family], text: str) -> None:
    """One worker's exposition into `families`: a sample belongs to the family of the comments before it."""
    current: _Family | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            described = _comment(families, line)
            if described is not None:
                current = described
        elif line:
            key, _, raw = line.rpartition(" ")
            if current is None:  # a sample before any TYPE line: its own untyped family
                current = families.setdefault(key.split("{", 1)[0], _Family([]))
            current.add(key, float(raw))


def _comment(families: dict[str, _Family], line: str) -> _Family | None:
    """The family a comment names (`# HELP <name> ...`, `# TYPE <name> <kind>`: its rule from TYPE, its first two
    comments kept); None for a comment too short to name one."""
    parts = line.split(" ", 3)
    if len(parts) < 3:
        return None
    name = parts[2]
    known = families.get(name)
    if known is None:
        known = families[name] = _Family([])
    if parts[1] == "TYPE" and len(parts) == 4:
        known.rule = _rule(name, parts[3])
    if len(known.comments) < 2 and line not in known.comments:
        known.comments.append(line)
    return known
