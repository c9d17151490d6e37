"""Prometheus text format 0.0.4 written as Triton writes it: family names as given, integers without `.0`."""

from __future__ import annotations

import math

from prometheus_client.registry import CollectorRegistry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# prometheus_client's own writer renames counter families to `<name>_total`, which Triton's nv_* counters are
# not called; this writer keeps every name as the collector gives it.


def format_value(value: float) -> str:
    """A double as prometheus-cpp (Triton's writer) prints it: `%.16g` (`1`, `0.1`, `1e+20`), `Nan`, `+Inf`."""
    if math.isnan(value):
        return "Nan"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.16g}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(registry: CollectorRegistry) -> bytes:
    """Every family with at least one sample, HELP (unless it has no description, as Triton) and TYPE first."""
    lines: list[str] = []
    for family in registry.collect():
        if not family.samples:
            continue
        kind = "untyped" if family.type == "unknown" else family.type
        if family.documentation:
            lines.append(f"# HELP {family.name} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {family.name} {kind}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in sample.labels.items())
            name = f"{sample.name}{{{labels}}}" if labels else sample.name
            lines.append(f"{name} {format_value(sample.value)}")
    lines.append("")
    return "\n".join(lines).encode()
