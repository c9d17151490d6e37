"""Triton's `--trace-config`: `<setting>=<value>` for the global settings, `<mode>,<setting>=<value>` for a mode's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MODES = ("triton", "opentelemetry")
LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
DEFAULT_OTLP_URL = "http://localhost:4318/v1/traces"
_GLOBAL_KEYS = ("rate", "level", "count", "mode")
_MODE_KEYS = {
    "triton": ("file", "log-frequency"),
    "opentelemetry": ("url", "resource", "bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size"),
}
_INTEGERS = ("rate", "count", "log-frequency", "bsp_max_queue_size", "bsp_schedule_delay", "bsp_max_export_batch_size")


class TraceConfigError(ValueError):
    """A --trace-config entry the server cannot start with."""


@dataclass(slots=True)
class TraceConfig:
    """Every --trace-config setting, with Triton's defaults; the batch span processor keys are None unless given
    (the OpenTelemetry SDK then reads OTEL_BSP_* or its own defaults, 2048 / 5000 ms / 512, as Triton's)."""

    mode: str = "triton"
    rate: int = 1000
    level: tuple[str, ...] = ("OFF",)
    count: int = -1
    file: str = ""
    log_frequency: int = 0
    url: str = DEFAULT_OTLP_URL
    resource: dict[str, str] = field(default_factory=dict)
    bsp_max_queue_size: int | None = None
    bsp_schedule_delay: int | None = None
    bsp_max_export_batch_size: int | None = None


def parse_trace_config(entries: Sequence[str]) -> TraceConfig:
    """The settings of the --trace-config entries, in order (a later entry wins; `level` accumulates, OFF resets)."""
    config = TraceConfig()
    levels: list[str] = []
    for entry in entries:
        key, value = _setting(entry)
        if key == "level":
            if value not in LEVELS:
                raise TraceConfigError(f"--trace-config {entry}: level must be OFF, TIMESTAMPS or TENSORS")
            levels = [] if value == "OFF" else [*levels, value]
        else:
            _apply(config, entry, key, value)
    config.level = tuple(dict.fromkeys(levels)) or ("OFF",)
    return config


def _setting(entry: str) -> tuple[str, str]:
    """An entry's key (one its mode, or the global settings, has) and value."""
    mode, comma, setting = entry.partition(",")
    if not comma:
        mode, setting = "", entry
    key, equals, value = setting.partition("=")
    if not equals or not key:
        raise TraceConfigError(
            f"--trace-config option format is '<trace mode>,<setting>=<value>' or '<setting>=<value>'. Got {entry}"
        )
    if mode and mode not in MODES:
        raise TraceConfigError(f"Unknown trace mode '{mode}' in --trace-config {entry}: expected triton or "
                               "opentelemetry")
    allowed = _MODE_KEYS[mode] if mode else _GLOBAL_KEYS
    if key not in allowed:
        where = f"trace mode '{mode}'" if mode else "the global trace settings (rate, level, count, mode)"
        raise TraceConfigError(f"Unknown setting '{key}' for {where} in --trace-config {entry}")
    return key, value


def _apply(config: TraceConfig, entry: str, key: str, value: str) -> None:
    """Set `key` (any but `level`) to `value` in `config`."""
    if key in _INTEGERS:
        setattr(config, key.replace("-", "_"), _integer(entry, key, value))
    elif key == "mode":
        if value not in MODES:
            raise TraceConfigError(f"--trace-config {entry}: mode must be triton or opentelemetry")
        config.mode = value
    elif key == "resource":
        name, equals, attribute = value.partition("=")
        if not equals or not name:
            raise TraceConfigError(f"--trace-config {entry}: resource takes <key>=<value>")
        config.resource[name] = attribute
    else:  # file, url
        setattr(config, key, value)


def _integer(entry: str, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise TraceConfigError(f"Unable to parse '{key}' in --trace-config {entry}: not an integer") from None
    if number < (-1 if key == "count" else 0):
        raise TraceConfigError(f"--trace-config {entry}: '{key}' must be >= {-1 if key == 'count' else 0}")
    return number
