"""`--metrics-config <key>=<value>` settings, with Triton's keys, defaults and value formats."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from geserve.settings import parse_bool

logger = logging.getLogger(__name__)

# Triton's defaults (prometheus-cpp summaries over a 60 s window in 5 age buckets).
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = (
    (0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001)
)
# Triton's default buckets for nv_inference_first_response_histogram_ms.
DEFAULT_FIRST_RESPONSE_BUCKETS_MS: tuple[float, ...] = (100.0, 500.0, 2000.0, 5000.0)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    counter_latencies: bool = True
    """The cumulative nv_inference_*_duration_us counters."""
    summary_latencies: bool = False
    """nv_inference_*_summary_us: quantiles over a sliding window."""
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    """(quantile, allowed error) pairs; `summary_quantiles=0.5:0.05,0.9:0.01`."""
    histogram_latencies: bool = False
    """nv_inference_first_response_histogram_ms (every geserve model answers with one response)."""

    @property
    def observes_latencies(self) -> bool:
        """Whether per-request observations are needed (counters alone are read from the statistics)."""
        return self.summary_latencies or self.histogram_latencies

    @classmethod
    def from_pairs(cls, pairs: Mapping[str, str]) -> MetricsConfig:
        """Parse `--metrics-config` pairs; a malformed value raises ValueError, an unknown key is ignored."""
        values: dict[str, Any] = {}  # keyword arguments of cls, of several types
        for key, raw in pairs.items():
            if key in ("counter_latencies", "summary_latencies", "histogram_latencies"):
                values[key] = _parse_bool(key, raw)
            elif key == "summary_quantiles":
                values[key] = parse_quantiles(raw)
            else:
                logger.warning("ignoring unknown --metrics-config setting '%s'", key)
        return cls(**values)


def _parse_bool(key: str, raw: str) -> bool:
    try:
        return parse_bool(raw)
    except ValueError:
        raise ValueError(f"--metrics-config {key} expects true or false, got '{raw}'") from None


def parse_quantiles(raw: str) -> tuple[tuple[float, float], ...]:
    """`<quantile>:<error>,...` as Triton takes it (spaces between pairs are accepted too)."""
    pairs = []
    for item in raw.replace(" ", ",").split(","):
        if not item:
            continue
        quantile, sep, error = item.partition(":")
        try:
            q, e = float(quantile), float(error)
        except ValueError:
            q = e = -1.0
        if not sep or not 0.0 <= q <= 1.0 or not 0.0 <= e <= 1.0:
            raise ValueError(f"--metrics-config summary_quantiles expects <quantile>:<error>,..., got '{raw}'")
        pairs.append((q, e))
    if not pairs:
        raise ValueError("--metrics-config summary_quantiles names no quantile")
    return tuple(pairs)
