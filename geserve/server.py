"""The server: builds the layers from settings, loads the initial models, runs the frontends on one loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Sequence
from functools import partial

from geserve import devices
from geserve.arrivals import ARRIVALS
from geserve.backends.registry import BackendRegistry
from geserve.devices import compute_priority
from geserve.devices.loop_batching import LOOP_BATCHING
from geserve.devices.nvml import GPU_FAMILY_NAMES, GpuCollector, load_nvml
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.frontends.base import Frontend
from geserve.frontends.grpc.h2_server import NativeGrpcServer
from geserve.frontends.grpc.server import GrpcOptions, GrpcServer
from geserve.frontends.http.app import HttpFrontend
from geserve.frontends.http.native_server import HttpLimits
from geserve.frontends.http.server import HttpService
from geserve.frontends.metrics import MetricsOptions, MetricsService, registry_exposition
from geserve.frontends.tls import ReloadsTls, TlsError, TlsFiles, tls_files
from geserve.metrics import CustomMetricStore, MetricsConfig, render
from geserve.metrics.collector import SERVER_FAMILY_NAMES, build_registry
from geserve.metrics.latency import LatencyRecorder
from geserve.metrics.system import CpuSampler
from geserve.repository import memory
from geserve.repository.budget import BudgetedFollower, ModelLoads, parse_size, start_models
from geserve.repository.holder import LocalHolder
from geserve.repository.lifecycle import LifecycleOptions, ModelManager
from geserve.repository.poller import RepositoryPoller
from geserve.repository.store import ModelStore
from geserve.service.context import CallPolicy
from geserve.service.response_cache import CacheConfigError, ResponseCache, build_response_cache
from geserve.service.runtime_settings import LogSettings
from geserve.service.security import Security, SecurityConfigError, build_security
from geserve.service.service import InferenceService
from geserve.service.shared_memory import SharedMemoryRegistry
from geserve.service.tracing.config import TraceConfigError, parse_trace_config
from geserve.service.tracing.otel import OtelUnavailable
from geserve.service.tracing.tracer import Tracing
from geserve.settings import ServerSettings
from geserve.workers.dispatch import GRPC, HTTP, Adopter, handed_kinds
from geserve.workers.link import WorkerLink

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """The server cannot start as asked (bad repository, or a model failed with --exit-on-error)."""


class Server:
    """Builds the layers from settings; `start` loads the initial models and starts the frontends in order.

    With `link`, this process is one worker of a server of several (geserve/workers): its ports are shared with
    the others, its control calls reach them all, and the supervisor serves the metrics of all."""

    def __init__(
        self, settings: ServerSettings, policies: Sequence[CallPolicy] = (), link: WorkerLink | None = None
    ) -> None:
        _check_control(settings)
        budget = _memory_budget(settings)
        self.settings = settings
        self.link = link
        compute_priority.configure(settings.compute_nice)
        # The loop's short slice is how it preempts the lowered compute threads at once on kernels since 6.6.
        LOOP_BATCHING.configure(settings.loop_batching, short_slice=settings.compute_nice > 0)
        if link is not None:  # the workers share the cores: each instance's intra-op threads count this one's share
            devices.share_cores(link.count)
        self.store = ModelStore(settings.model_repositories)
        # Kept even with --allow-metrics=false, so models that update custom metrics run unchanged.
        self.custom_metrics = CustomMetricStore(reserved=SERVER_FAMILY_NAMES | GPU_FAMILY_NAMES)
        registry = BackendRegistry(settings.backend_config, self.custom_metrics)
        metrics_config = _metrics_config(settings)
        self.response_cache = _response_cache(settings)
        self.manager = ModelManager(
            self.store,
            registry,
            LifecycleOptions(
                settings.auto_complete_config,
                devices.default_instance_kind(),
                settings.inline_execution_us,
                _latency_observer_factory(settings, metrics_config),
                response_cache=self.response_cache is not None,
                overload_control=settings.overload_control,
                measure_memory=budget is not None,
            ),
        )
        # The decider of loads and unloads with a memory budget or load on demand (repository/budget.py): this
        # process's own; with workers the supervisor decides for all of them.
        self.loads = _model_loads(settings, budget, self.manager) if link is None else None
        self.poller = _poller(settings, self.store, self.manager, link, self.loads)
        security = _security(settings)
        tracing = _tracing(settings, link)
        # One shared memory registry and one set of log / trace settings behind every protocol.
        self.service = InferenceService(
            self.manager,
            explicit_control=settings.model_control_mode == "explicit",
            strict_readiness=settings.strict_readiness,
            shared_memory=SharedMemoryRegistry(settings.allow_system_shared_memory),
            log_settings=LogSettings(settings.log_verbose),
            policies=[*security.policies, *policies],  # the settings' first: they set the caller's identity
            server_name=settings.server_id,
            audit=security.audit,
            model_load_max_file_bytes=settings.model_load_max_file_bytes,
            response_cache=self.response_cache,
            cluster=link,
            tracing=tracing,
            shortcuts=settings.inference_shortcuts,
            openai_api=settings.openai_api,
            load_on_demand=settings.load_on_demand,
            loads=self.loads,
        )
        registry.attach_host(self.service.host)
        http_tls, grpc_tls = _tls(settings)
        # In start order: metrics first (so /metrics answers once the server is live), then gRPC (as Triton,
        # so gRPC answers once HTTP says live), then HTTP.
        self.frontends: list[Frontend] = []
        if settings.allow_metrics and link is None:
            self.frontends.append(
                _metrics_service(settings, metrics_config, self.manager, self.custom_metrics, http_tls,
                                 self.service.paths, self.loads)
            )
        # A worker's metrics, without the CPU's (the supervisor samples those once for the server).
        self._worker_registry = (
            build_registry(self.manager, metrics_config, None, self.custom_metrics, self.service.paths)
            if link is not None else None
        )
        # With --workers, the supervisor accepts the native servers' connections and hands them over
        # (workers/dispatch.py): their worker frontends bind nothing.
        handed = handed_kinds(settings) if link is not None and link.handoff is not None else frozenset()
        self._adopters: dict[bytes, Adopter] = {}
        if settings.allow_grpc:
            self._add_grpc(grpc_tls, GRPC in handed)
        if settings.allow_http:
            self._add_http(http_tls, HTTP in handed)
        self._started: list[Frontend] = []

    def _add_grpc(self, tls: TlsFiles | None, adopting: bool) -> None:
        """The gRPC frontend; `adopting`: it serves the connections the supervisor hands over, binding nothing."""
        settings = self.settings
        # One gRPC server for cleartext and TLS: the native HTTP/2 one; grpc.aio only when --grpc-server grpcio asks.
        options = GrpcOptions(
            settings.grpc_address, settings.grpc_port, settings.grpc_infer_allocation_pool_size,
            keepalive_time_ms=settings.grpc_keepalive_time_ms,
            keepalive_timeout_ms=settings.grpc_keepalive_timeout_ms,
            keepalive_permit_without_calls=settings.grpc_keepalive_permit_without_calls,
            http2_max_pings_without_data=settings.grpc_http2_max_pings_without_data,
            http2_min_recv_ping_interval_without_data_ms=settings.grpc_http2_min_recv_ping_interval_without_data_ms,
            http2_max_ping_strikes=settings.grpc_http2_max_ping_strikes,
            max_concurrent_streams=settings.grpc_max_concurrent_streams,
            tls=tls,
            reuse_port=self.link is not None,
        )
        if settings.grpc_server == "native":
            native = NativeGrpcServer(self.service, options, adopting=adopting)
            self.frontends.append(native)
            if adopting:
                self._adopters[GRPC] = native.adopt
        else:
            self.frontends.append(GrpcServer(self.service, options))

    def _add_http(self, tls: TlsFiles | None, adopting: bool) -> None:
        """The HTTP frontend; `adopting`: it serves the connections the supervisor hands over, binding nothing."""
        settings = self.settings
        app = HttpFrontend(self.service, settings.http_max_input_size)
        http = HttpService(
            app, settings.http_address, settings.http_port, log_verbose=settings.log_verbose,
            kind=settings.http_server, max_body_size=settings.http_max_input_size,
            limits=HttpLimits(
                header_timeout=settings.http_header_timeout_secs,
                idle_timeout=settings.http_idle_timeout_secs,
                body_timeout=settings.http_body_timeout_secs,
                max_header_size=settings.http_max_header_size,
                max_header_count=settings.http_max_header_count,
                max_connections=settings.http_max_connections,
            ),
            tls=tls,
            reuse_port=self.link is not None,
            adopting=adopting,
        )
        self.frontends.append(http)
        if adopting:
            self._adopters[HTTP] = http.adopt

    async def load_initial_models(self) -> None:
        if self.poller is not None:
            await self.poller.snapshot()  # before any config is read: a change made while the models load is seen
        try:
            available = self.store.scan()
        except InvalidArgumentError as exc:
            raise StartupError(exc.message) from None
        names = self._start_names(available)
        results = await asyncio.gather(*(self._load(n) for n in names), return_exceptions=True)
        failures = [f"{n}: {r.message}" for n, r in zip(names, results, strict=True) if isinstance(r, GeserveError)]
        unexpected = [r for r in results if isinstance(r, BaseException) and not isinstance(r, GeserveError)]
        if unexpected:
            raise unexpected[0]
        if failures and self.settings.exit_on_error:
            raise StartupError("failed to load all models:\n  " + "\n  ".join(failures))

    def _start_names(self, available: Collection[str]) -> list[str]:
        """The models this process loads at start; none in a worker under a memory budget: the supervisor loads them
        once every worker has joined, measured and within the budget."""
        try:
            names = start_models(self.settings, available)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        return [] if self.link is not None and self.settings.model_memory_budget else names

    async def _load(self, name: str) -> None:
        """A model the server loads at start: within the budget (one at a time) when there is one."""
        if self.loads is None:
            await self.manager.load(name)
        else:
            await self.loads.load(name, partial(self.manager.load, name))

    async def start(self) -> None:
        self.service.loop = asyncio.get_running_loop()
        LOOP_BATCHING.claim()
        try:
            await self.load_initial_models()
            if self.link is not None:  # the server's control state (loads, unloads, regions) before serving
                registry = self._worker_registry
                await self.link.join(self.service, lambda: render(registry) if registry is not None else b"",
                                     self.manager.models, LocalHolder(self.manager))
            for frontend in self.frontends:
                await frontend.start()
                self._started.append(frontend)
            self._start_polling()
            # Every request source is counted: batches may go early (geserve/arrivals.py). A server without
            # frontends is served by in-process callers, who report nothing: it stays open-ended.
            if self.frontends and all(frontend.reports_arrivals for frontend in self.frontends):
                ARRIVALS.bounded()
            if self.link is not None:
                self.link.receive_connections(self._adopters)
                self.link.serving()
        except BaseException:
            await self._stop_frontends(time.monotonic() + self.settings.exit_timeout_secs)
            raise

    async def _stop_frontends(self, deadline: float) -> None:
        while self._started:
            frontend = self._started.pop()
            try:
                await asyncio.wait_for(frontend.stop(), _left(deadline, minimum=1.0))
            except asyncio.TimeoutError:  # not the builtin before 3.11
                logger.warning("the %s frontend did not stop within the exit timeout", frontend.name)

    async def stop(self) -> bool:
        """Triton's exit: readiness turns false and new requests are refused at once; the requests and streams in
        flight get --exit-timeout-secs to finish; then the frontends close and the models unload. False when the
        timeout abandoned work still in flight (a model still executing is left to the process's exit)."""
        self.service.stop_accepting()
        await self._stop_polling()
        deadline = time.monotonic() + self.settings.exit_timeout_secs
        if self.service.inflight:
            logger.info("waiting up to %.0f s for %d in-flight requests", _left(deadline), self.service.inflight)
        clean = await self.service.wait_idle(_left(deadline))
        if not clean:
            logger.warning("exit timeout: %d requests still in flight are abandoned", self.service.inflight)
        await self._stop_frontends(deadline)
        self.service.shared_memory.close()
        self.service.close_tracing()
        if self.link is not None:
            await self.link.close()
        try:
            await asyncio.wait_for(self.manager.shutdown(), _left(deadline, minimum=1.0))
        except asyncio.TimeoutError:  # not the builtin before 3.11
            logger.warning("exit timeout: models still executing are abandoned")
            clean = False
        return clean

    def _start_polling(self) -> None:
        """Poll mode: the repositories are scanned from here on (the initial models are up)."""
        if self.poller is not None:
            self.poller.start()

    async def _stop_polling(self) -> None:
        """No reload starts once stopping began; a scan under way is abandoned."""
        if self.poller is not None:
            await self.poller.stop()

    def reload_tls(self) -> None:
        """SIGHUP: the frontends serving TLS re-read their certificate, key and root files; new connections get
        them, open ones keep theirs. A file that cannot be used leaves that frontend's certificate as it was."""
        logger.info("SIGHUP: reloading TLS certificates")
        for frontend in self.frontends:
            if isinstance(frontend, ReloadsTls):
                frontend.reload_tls()

    async def run_until_signalled(self) -> None:
        """Serve until SIGINT or SIGTERM, then stop cleanly; a second signal while stopping exits at once."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()

        def first_signal() -> None:
            logger.info("signal received, shutting down (a second signal exits at once)")
            stop_requested.set()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, _exit_at_once)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, first_signal)
        if self.link is not None:
            self.link.on_stop = stop_requested.set
        if any(isinstance(frontend, ReloadsTls) and frontend.serves_tls for frontend in self.frontends):
            loop.add_signal_handler(signal.SIGHUP, self.reload_tls)  # certificate rotation; else SIGHUP is as before
        await self.start()
        _settle_heap()
        await stop_requested.wait()
        if not await self.stop():
            _exit_now()  # threads still running abandoned work would hold the interpreter's exit


def _settle_heap() -> None:
    """Take what starting made (models, sessions, configs, modules) out of the cyclic collector's sight: a full
    collection of a loaded server's heap took 37-44 ms, a stall of the event loop every request waiting then pays
    (bench/overload_bench.py saw answers late by it). Objects still live are kept (`gc.freeze`); garbage goes first.
    For the serving process only: an in-process server (tests, Ray) leaves its host's collector alone."""
    gc.collect()
    gc.freeze()


def _exit_at_once() -> None:
    logger.warning("second signal received: exiting without waiting for requests in flight")
    _exit_now()


def _exit_now() -> None:
    """Exit 1 without joining threads (a model may still be executing): work in flight was abandoned."""
    logging.shutdown()
    os._exit(1)


def _left(deadline: float, minimum: float = 0.0) -> float:
    """Seconds until `deadline` (on time.monotonic's clock), at least `minimum`."""
    return max(deadline - time.monotonic(), minimum)


def _poller(
    settings: ServerSettings, store: ModelStore, manager: ModelManager, link: WorkerLink | None,
    loads: ModelLoads | None,
) -> RepositoryPoller | None:
    """Poll mode's scans, in one process; with workers the supervisor scans and tells every worker what changed
    (workers/supervisor.py). What changed loads through the budget when there is one."""
    if settings.model_control_mode != "poll" or link is not None:
        return None
    follower = manager if loads is None else BudgetedFollower(loads, manager, settings.load_on_demand)
    return RepositoryPoller(store, follower, settings.repository_poll_secs)


def _memory_budget(settings: ServerSettings) -> int | None:
    """--model-memory-budget in bytes, None without one. With one, malloc keeps one arena from now on (as early as a
    server can), so that what a load adds is measured as it is (repository/memory.py)."""
    if not settings.model_memory_budget:
        return None
    try:
        budget = parse_size(settings.model_memory_budget)
    except ValueError as exc:
        raise StartupError(f"--model-memory-budget: {exc}") from None
    memory.one_heap()
    return budget


def _model_loads(settings: ServerSettings, budget: int | None, manager: ModelManager) -> ModelLoads | None:
    """One process's decider of loads, with a memory budget or load on demand; None with neither."""
    if budget is None and not settings.load_on_demand:
        return None
    return ModelLoads(LocalHolder(manager), budget)


def _check_control(settings: ServerSettings) -> None:
    """What the server cannot start without: a known model control mode and a repository."""
    if settings.model_control_mode not in ("none", "explicit", "poll"):
        raise StartupError(
            f"unsupported --model-control-mode '{settings.model_control_mode}'; expected none, explicit or poll"
        )
    if not settings.model_repositories:
        raise StartupError("at least one --model-repository is required")
    if settings.model_control_mode == "none" and (settings.load_on_demand or settings.model_memory_budget):
        raise StartupError("--load-on-demand and --model-memory-budget need --model-control-mode explicit or poll "
                           "(models load and unload while the server runs)")


# Each part the settings configure, built now so a bad setting stops the start with its own message.


def _response_cache(settings: ServerSettings) -> ResponseCache | None:
    """Triton's response cache (--cache-config), one for the whole server: None when not configured."""
    try:
        return build_response_cache(settings.cache_config)
    except CacheConfigError as exc:
        raise StartupError(str(exc)) from None


def _security(settings: ServerSettings) -> Security:
    """Restricted APIs, bearer tokens, the audit log (service/security.py)."""
    try:
        return build_security(settings)
    except SecurityConfigError as exc:
        raise StartupError(str(exc)) from None


def _tracing(settings: ServerSettings, link: WorkerLink | None) -> Tracing:
    """Triton's --trace-config (service/tracing/)."""
    try:
        shared = link.shared_file("trace.ledger") if link is not None else None  # the workers trace as one server
        return Tracing(parse_trace_config(settings.trace_config), shared)
    except (TraceConfigError, OtelUnavailable) as exc:
        raise StartupError(str(exc)) from None


def _tls(settings: ServerSettings) -> tuple[TlsFiles | None, TlsFiles | None]:
    """HTTP's and gRPC's TLS files, read and checked now: one missing or unusable stops the start (frontends/tls.py)."""
    try:
        http_tls = tls_files("--http", settings.http_use_ssl, settings.http_use_ssl_mutual,
                             settings.http_server_cert, settings.http_server_key, settings.http_root_cert)
        grpc_tls = tls_files("--grpc", settings.grpc_use_ssl, settings.grpc_use_ssl_mutual,
                             settings.grpc_server_cert, settings.grpc_server_key, settings.grpc_root_cert)
    except TlsError as exc:
        raise StartupError(str(exc)) from None
    return http_tls, grpc_tls


def _metrics_config(settings: ServerSettings) -> MetricsConfig:
    try:
        return MetricsConfig.from_pairs(settings.metrics_config)
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def _latency_observer_factory(settings: ServerSettings, config: MetricsConfig) -> Callable[[], LatencyRecorder] | None:
    """Summaries and histograms need every request's latency; without them the statistics skip the observer."""
    if not settings.allow_metrics or not config.observes_latencies:
        return None
    return lambda: LatencyRecorder(config)


def _metrics_service(
    settings: ServerSettings, config: MetricsConfig, manager: ModelManager, custom: CustomMetricStore,
    tls: TlsFiles | None = None, paths: dict[str, int] | None = None, loads: ModelLoads | None = None,
) -> MetricsService:
    cpu = CpuSampler() if settings.allow_cpu_metrics else None
    if cpu is not None and not cpu.available:
        logger.warning("CPU metrics are unavailable on this platform (no /proc)")
        cpu = None
    address = settings.metrics_address or (settings.http_address if settings.allow_http else "0.0.0.0")
    options = MetricsOptions(address, settings.metrics_port, settings.metrics_interval_ms, tls)  # HTTP's TLS
    registry = build_registry(manager, config, cpu, custom, paths, loads)
    if settings.allow_gpu_metrics:
        nvml = load_nvml()  # None without nvidia-ml-py or a driver: then there are no GPU families, as in Triton
        if nvml is not None:
            registry.register(GpuCollector(nvml))
    return MetricsService(registry_exposition(registry), options, cpu)
