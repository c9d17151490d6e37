"""One settings tree for the server: command line > environment (GESERVE_*) > defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

_ENV_PREFIX = "GESERVE_"
_SEMICOLON_LISTS = ("http_restricted_api", "grpc_restricted_protocol", "trace_config")
# Settings only the command line sets (repeatable <key>=<value> flags): no GESERVE_* variable is read for them.
NOT_FROM_ENVIRONMENT = frozenset({"backend_config", "metrics_config", "cache_config"})


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
    """none: load every model at start, refuse load/unload; explicit: load only --load-model, allow both;
    poll: load every model at start and follow the repositories every --repository-poll-secs, refuse both."""
    repository_poll_secs: float = 15.0
    """poll mode: seconds between two scans of the repositories (Triton's default 15)."""
    load_on_demand: bool = False
    """explicit and poll modes: a request for a model that is in a repository but not loaded loads it, then is served
    (it waits for the load, within its deadline; the wait is its queue time). In poll mode no model loads at start."""
    model_memory_budget: str = ""
    """explicit and poll modes: the most memory the loaded models may cost together (800MiB, 4GiB), all workers
    together. Each version is charged what its load added to the processes' PSS; the least recently used models with
    no request under way are unloaded to make room (docs/guide/memory-budget.md). Empty: no budget."""
    load_models: list[str] = field(default_factory=list)
    strict_readiness: bool = True
    """As Triton: /v2/health/ready is true only while every model is ready."""
    exit_on_error: bool = False
    """Exit at start if any model fails to load (Triton defaults to true; geserve keeps serving the rest)."""
    auto_complete_config: bool = True
    backend_config: dict[str, dict[str, str]] = field(default_factory=dict)
    """--backend-config=<backend>,<key>=<value>, by backend."""
    cache_config: dict[str, dict[str, str]] = field(default_factory=dict)
    """Triton's --cache-config=<cache>,<key>=<value> (repeatable), by cache: `local,size=<bytes>` turns the response
    cache on for the models whose config enables `response_cache` (service/response_cache.py)."""
    log_verbose: int = 0
    trace_config: list[str] = field(default_factory=list)
    """Triton's --trace-config=[<mode>,]<setting>=<value> (repeatable): rate, level, count, mode; triton,file /
    triton,log-frequency; opentelemetry,url / resource / bsp_* (docs/guide/metrics-tracing.md). ';' separates in the
    env."""
    http_max_input_size: int = 64 * 1024 * 1024
    """Largest request body accepted, in bytes (Triton's default: 64 MiB)."""
    http_server: str = "native"
    """native: geserve's lean HTTP/1.1 server (default); uvicorn: the same ASGI app on uvicorn."""
    inference_shortcuts: bool = True
    """The request path's shortcuts (InferenceService.submit): a request run at once on the loop or queued with a
    callback instead of in a task, a remembered header's prepare step, HTTP's replayed request heads. Off: every
    inference takes every step, in a task; the answers are the same (tests compare them), only slower."""
    openai_api: bool = True
    """OpenAI's embeddings API on the HTTP port (`GET /v1/models`, `POST /v1/embeddings`), for the models whose
    config has the `openai.embeddings` parameter; off: those routes answer 404."""
    overload_control: bool = False
    """Admission control for every model (a model's `overload_control` parameter overrides it): an adaptive
    concurrency limit, priorities shed lowest first, and requests that cannot be answered before their deadline
    refused at arrival (HTTP 503 + Retry-After, gRPC UNAVAILABLE) instead of queued (scheduling/admission.py)."""
    inline_execution_us: int = 250
    """Executions typically taking less CPU time than this run on the event loop instead of an instance thread (0:
    never)."""
    compute_nice: int = 5
    """How many nice levels below the event loop the threads that execute models run (Linux; 0: the same level), the
    loop taking the kernel's shortest time slice besides (0: its default): the loop then preempts them at once on a
    shared core, so arrivals, refusals, answers and health probes do not wait for a compute thread's time slice
    (devices/compute_priority.py, devices/thread_scheduling.py)."""
    loop_batching: bool = True
    """While admission control refuses arrivals, the event loop runs as SCHED_BATCH (Linux): an arrival waits for the
    scheduler's tick instead of preempting a running execution, and deadlines are kept that wait earlier
    (devices/loop_batching.py)."""
    http_thread_count: int = 0
    """Accepted for tritonserver compatibility; the HTTP frontend runs on the event loop."""
    http_header_timeout_secs: float = 15.0
    """A connection must deliver a request's line and headers within this many seconds of its first byte (or,
    on a new connection, of connecting), else it is closed (408)."""
    http_idle_timeout_secs: float = 60.0
    """A keep-alive connection with no request under way is closed after this many idle seconds."""
    http_body_timeout_secs: float = 30.0
    """A request body that makes no progress for this many seconds is abandoned (408) and its connection closed."""
    http_max_header_size: int = 64 * 1024
    """Largest request line plus headers, in bytes; larger is answered 431 and the connection closed."""
    http_max_header_count: int = 100
    """Most header fields in one request; more is answered 431 and the connection closed."""
    http_max_connections: int = 1024
    """Most HTTP connections open at once; further ones wait in the listen backlog until one closes."""
    http_use_ssl: bool = False
    """Serve HTTPS on --http-port (and on the metrics port) with --http-server-cert and --http-server-key."""
    http_use_ssl_mutual: bool = False
    """HTTPS with client certificates required, signed by --http-root-cert (implies --http-use-ssl)."""
    http_server_cert: str = ""
    """PEM file: the HTTPS server's certificate (chain); re-read on SIGHUP."""
    http_server_key: str = ""
    """PEM file: the HTTPS server's private key (unencrypted); re-read on SIGHUP."""
    http_root_cert: str = ""
    """PEM file: the CA certificates client certificates must be signed by (mutual TLS); re-read on SIGHUP."""
    grpc_keepalive_time_ms: int = 7_200_000
    """Triton's --grpc-keepalive-time: period of the server's keepalive pings (ms)."""
    grpc_keepalive_timeout_ms: int = 20_000
    """Triton's --grpc-keepalive-timeout: how long to wait for a ping's acknowledgement (ms)."""
    grpc_keepalive_permit_without_calls: bool = False
    """Triton's --grpc-keepalive-permit-without-calls: allow keepalive pings on a connection with no call."""
    grpc_http2_max_pings_without_data: int = 2
    """Triton's --grpc-http2-max-pings-without-data (0: no limit)."""
    grpc_http2_min_recv_ping_interval_without_data_ms: int = 300_000
    """Triton's --grpc-http2-min-recv-ping-interval-without-data: a client pinging more often gets a strike (ms)."""
    grpc_http2_max_ping_strikes: int = 2
    """Triton's --grpc-http2-max-ping-strikes: strikes before the connection is closed (0: no limit)."""
    grpc_max_concurrent_streams: int = 1024
    """Most concurrent calls (HTTP/2 streams) one gRPC connection may open."""
    grpc_server: str = "native"
    """native: geserve's gRPC server on HTTP/2 (h2; default, cleartext and TLS); grpcio: grpc.aio."""
    grpc_use_ssl: bool = False
    """Triton's --grpc-use-ssl: serve gRPC over TLS with --grpc-server-cert and --grpc-server-key."""
    grpc_use_ssl_mutual: bool = False
    """Triton's --grpc-use-ssl-mutual: TLS with client certificates required, signed by --grpc-root-cert
    (overrides --grpc-use-ssl)."""
    grpc_server_cert: str = ""
    """Triton's --grpc-server-cert: PEM file of the server's certificate (chain); re-read on SIGHUP."""
    grpc_server_key: str = ""
    """Triton's --grpc-server-key: PEM file of the server's private key (unencrypted); re-read on SIGHUP."""
    grpc_root_cert: str = ""
    """Triton's --grpc-root-cert: PEM file of the CA certificates client certificates must be signed by."""
    workers: int = 0
    """Processes serving the HTTP and gRPC ports together as one server (geserve/workers); 0: one per core the
    process may run on, at most MAX_AUTO_WORKERS; 1: a single process, no supervisor."""
    exit_timeout_secs: float = 30.0
    """Triton's --exit-timeout-secs: on SIGTERM, how long in-flight requests and streams get to finish."""
    server_id: str = "geserve"
    """Triton's --id: the name the server metadata reports."""
    # ---- security (docs/guide/security.md); every one off by default ----
    http_restricted_api: list[str] = field(default_factory=list)
    """Triton's --http-restricted-api=<groups>:<header>=<value> (repeatable): calls of those API groups over HTTP
    need the header with that value, else 403. In GESERVE_HTTP_RESTRICTED_API, ';' separates several."""
    grpc_restricted_protocol: list[str] = field(default_factory=list)
    """Triton's --grpc-restricted-protocol=<groups>:<key>=<value> (repeatable): calls of those API groups over gRPC
    need the metadata `triton-grpc-protocol-<key>` with that value, else UNAVAILABLE. ';' separates in the env."""
    auth_jwt_public_key: str = ""
    """PEM public key (or certificate) that bearer tokens are verified with (RS*/ES*); turns token auth on."""
    auth_jwt_jwks: str = ""
    """A JWK set file of public keys chosen by the token's `kid` (instead of --auth-jwt-public-key)."""
    auth_jwt_audience: str = ""
    """The `aud` a token must carry (checked when given; a token with an `aud` claim needs it)."""
    auth_jwt_issuer: str = ""
    """The `iss` a token must carry (checked when given)."""
    auth_jwt_leeway_secs: float = 30.0
    """Clock skew allowed on `exp`, `nbf` and `iat`, in seconds."""
    auth_protect_health: bool = False
    """With token auth on, require a token with the `health` scope for liveness and readiness too (open by default,
    for probes)."""
    model_load_max_file_bytes: int = 1 << 30
    """Most bytes the model files of one load request (`file:` parameters, decoded) may hold together; more is
    refused (400 / INVALID_ARGUMENT). The request holds them in memory while the model loads."""
    audit_log: str = ""
    """Append one JSON line per model-repository, shared-memory, logging and trace call, and per refused call, to
    this file (reopened after rotation)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Defaults overridden by GESERVE_<FIELD> variables (scalar fields; lists are comma separated)."""
        variables = os.environ if environ is None else environ
        settings = cls()
        for item in fields(cls):
            raw = variables.get(_ENV_PREFIX + item.name.upper())
            if raw is None or item.name in NOT_FROM_ENVIRONMENT:
                continue
            setattr(settings, item.name, _env_value(item.name, getattr(settings, item.name), raw))
        return settings


def _env_value(name: str, current: object, raw: str) -> object:
    """A GESERVE_* variable's text as the type of the setting's default, `current`."""
    if isinstance(current, bool):  # before int: a bool is an int
        return parse_bool(raw)
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    if name == "model_repositories":
        return [Path(p) for p in _items(raw, ",")]
    if name in _SEMICOLON_LISTS:  # each item holds commas (`health,metadata:key=value`)
        return _items(raw, ";")
    if isinstance(current, list):
        return _items(raw, ",")
    return raw


def _items(raw: str, separator: str) -> list[str]:
    return [p for p in raw.split(separator) if p]


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got '{text}'")
