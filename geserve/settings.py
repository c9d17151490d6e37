"""One settings tree for the server: command line > environment (GESERVE_*) > defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

_ENV_PREFIX = "GESERVE_"


@dataclass(slots=True)
class ServerSettings:
    model_repositories: list[Path] = field(default_factory=list)
    """Triton model repositories to serve (repeatable --model-repository)."""
    http_address: str = "0.0.0.0"
    http_port: int = 8000
    allow_http: bool = True
    grpc_address: str = "0.0.0.0"
    grpc_port: int = 8001
    """Port of the gRPC frontend (inference.GRPCInferenceService and grpc.health.v1.Health)."""
    allow_grpc: bool = True
    grpc_infer_allocation_pool_size: int = 8
    """Accepted for tritonserver compatibility; the gRPC frontend allocates per call."""
    allow_system_shared_memory: bool = False
    """Let clients register system shared memory regions (/dev/shm keys) for inputs and outputs. Off by default:
    a registered key makes the server map, and write into, any shared memory object it can open."""
    metrics_port: int = 8002
    """Port of the Prometheus endpoint (`GET /metrics`)."""
    metrics_address: str = ""
    """Address of the Prometheus endpoint; empty: --http-address when HTTP is on, else 0.0.0.0 (as Triton)."""
    allow_metrics: bool = True
    allow_cpu_metrics: bool = True
    """nv_cpu_utilization and nv_cpu_memory_*_bytes (read from /proc)."""
    allow_gpu_metrics: bool = True
    """Accepted for tritonserver compatibility; device families appear where a device can report them."""
    metrics_interval_ms: float = 2000.0
    """How often the per-interval metrics (CPU utilization and memory) are sampled."""
    metrics_config: dict[str, str] = field(default_factory=dict)
    """--metrics-config <key>=<value>: counter_latencies, summary_latencies, summary_quantiles,
    histogram_latencies (Triton's keys)."""
    model_control_mode: str = "none"
    """none: load every model at start, refuse load/unload; explicit: load only --load-model, allow both."""
    load_models: list[str] = field(default_factory=list)
    strict_readiness: bool = True
    """As Triton: /v2/health/ready is true only while every model is ready."""
    exit_on_error: bool = False
    """Exit at start if any model fails to load (Triton defaults to true; geserve keeps serving the rest)."""
    auto_complete_config: bool = True
    backend_config: dict[str, dict[str, str]] = field(default_factory=dict)
    """--backend-config=<backend>,<key>=<value>, by backend."""
    log_verbose: int = 0
    http_max_input_size: int = 64 * 1024 * 1024
    """Largest request body accepted, in bytes (Triton's default: 64 MiB)."""
    http_server: str = "native"
    """native: geserve's lean HTTP/1.1 server (default); uvicorn: the same ASGI app on uvicorn."""
    inline_execution_us: int = 250
    """Executions typically shorter than this run on the event loop instead of an instance thread (0: never)."""
    http_thread_count: int = 0
    """Accepted for tritonserver compatibility; the HTTP frontend runs on the event loop."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Defaults overridden by GESERVE_<FIELD> variables (scalar fields; lists are comma separated)."""
        variables = os.environ if environ is None else environ
        settings = cls()
        for item in fields(cls):
            raw = variables.get(_ENV_PREFIX + item.name.upper())
            if raw is None or item.name in ("backend_config", "metrics_config"):
                continue
            current = getattr(settings, item.name)
            if isinstance(current, bool):
                value: object = parse_bool(raw)
            elif isinstance(current, int):
                value = int(raw)
            elif isinstance(current, float):
                value = float(raw)
            elif item.name == "model_repositories":
                value = [Path(p) for p in raw.split(",") if p]
            elif isinstance(current, list):
                value = [p for p in raw.split(",") if p]
            else:
                value = raw
            setattr(settings, item.name, value)
        return settings


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got '{text}'")
