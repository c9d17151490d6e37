"""The server: builds the layers from settings, loads the initial models, runs the frontends on one loop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from geserve import devices
from geserve.backends.registry import BackendRegistry
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.frontends.grpc.server import GrpcOptions, GrpcServer
from geserve.frontends.http.app import HttpFrontend
from geserve.frontends.http.server import create_http_server
from geserve.frontends.metrics import MetricsOptions, MetricsService
from geserve.metrics import CustomMetricStore, MetricsConfig
from geserve.metrics.collector import SERVER_FAMILY_NAMES
from geserve.metrics.latency import LatencyRecorder
from geserve.repository.lifecycle import LifecycleOptions, ModelManager
from geserve.repository.store import ModelStore
from geserve.service.dataplane import DataPlane
from geserve.service.runtime_settings import LogSettings, TraceSettings
from geserve.service.shared_memory import SharedMemoryRegistry
from geserve.settings import ServerSettings

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """The server cannot start as asked (bad repository, or a model failed with --exit-on-error)."""


class Server:
    def __init__(self, settings: ServerSettings) -> None:
        if settings.model_control_mode not in ("none", "explicit"):
            raise StartupError(
                f"unsupported --model-control-mode '{settings.model_control_mode}'; expected none or explicit"
            )
        if not settings.model_repositories:
            raise StartupError("at least one --model-repository is required")
        self.settings = settings
        self.store = ModelStore(settings.model_repositories)
        # Kept even with --allow-metrics=false, so models that update custom metrics run unchanged.
        self.custom_metrics = CustomMetricStore(reserved=SERVER_FAMILY_NAMES)
        registry = BackendRegistry(settings.backend_config, self.custom_metrics)
        metrics_config = _metrics_config(settings)
        self.manager = ModelManager(
            self.store,
            registry,
            LifecycleOptions(
                settings.auto_complete_config,
                devices.default_instance_kind(),
                settings.inline_execution_us,
                _latency_observer_factory(settings, metrics_config),
            ),
        )
        self.dataplane = DataPlane(
            self.manager,
            explicit_control=settings.model_control_mode == "explicit",
            strict_readiness=settings.strict_readiness,
        )
        registry.attach_host(self.dataplane)
        # One of each for both frontends: a region registered or a setting changed over one shows over the other.
        self.shared_memory = SharedMemoryRegistry(settings.allow_system_shared_memory)
        self.log_settings = LogSettings(settings.log_verbose)
        self.trace_settings = TraceSettings()
        self._http = None
        self._grpc: GrpcServer | None = None
        self.metrics = (
            _metrics_service(settings, metrics_config, self.manager, self.custom_metrics)
            if settings.allow_metrics else None
        )
        self._stopped = asyncio.Event()

    async def load_initial_models(self) -> None:
        try:
            available = self.store.scan()
        except InvalidArgumentError as exc:
            raise StartupError(exc.message) from None
        if self.settings.model_control_mode == "none" or "*" in self.settings.load_models:
            names = list(available)
        else:
            names = list(dict.fromkeys(self.settings.load_models))
            unknown = [n for n in names if n not in available]
            if unknown:
                raise StartupError(f"--load-model names models not in any repository: {', '.join(unknown)}")
        results = await asyncio.gather(*(self.manager.load(n) for n in names), return_exceptions=True)
        failures = [f"{n}: {r.message}" for n, r in zip(names, results, strict=True) if isinstance(r, GeserveError)]
        unexpected = [r for r in results if isinstance(r, BaseException) and not isinstance(r, GeserveError)]
        if unexpected:
            raise unexpected[0]
        if failures and self.settings.exit_on_error:
            raise StartupError("failed to load all models:\n  " + "\n  ".join(failures))

    async def start(self) -> None:
        self.dataplane.loop = asyncio.get_running_loop()
        try:
            await self.load_initial_models()
            if self.metrics is not None:  # up before HTTP, so /metrics answers once the server is live
                await self.metrics.start()
            await self._start_grpc()  # before HTTP (as Triton), so gRPC answers once HTTP says live
            await self._start_http()
        except BaseException:
            if self._grpc is not None:
                await self._grpc.stop(0)
            if self.metrics is not None:
                await self.metrics.stop()
            raise

    async def _start_grpc(self) -> None:
        if self.settings.allow_grpc:
            options = GrpcOptions(self.settings.grpc_address, self.settings.grpc_port,
                                  self.settings.grpc_infer_allocation_pool_size,
                                  log_settings=self.log_settings, trace_settings=self.trace_settings)
            self._grpc = GrpcServer(self.dataplane, self.shared_memory, options)
            await self._grpc.start()

    async def _start_http(self) -> None:
        if self.settings.allow_http:
            app = HttpFrontend(self.dataplane, self.settings.http_max_input_size, self.shared_memory,
                               self.log_settings, self.trace_settings)
            self._http = create_http_server(
                app,
                self.settings.http_address,
                self.settings.http_port,
                self.settings.log_verbose,
                self.settings.http_server,
                self.settings.http_max_input_size,
            )
            self._http_task = asyncio.create_task(self._http.serve())
            while not self._http.started:
                if self._http_task.done():
                    self._http_task.result()
                    raise StartupError(f"failed to start the HTTP service on port {self.settings.http_port}")
                await asyncio.sleep(0.01)
            logger.info("started HTTPService at %s:%d", self.settings.http_address, self.settings.http_port)

    async def stop(self) -> None:
        self.dataplane.accepting = False
        if self._http is not None:
            self._http.should_exit = True
            await self._http_task
        if self._grpc is not None:
            await self._grpc.stop()
        self.shared_memory.close()
        if self.metrics is not None:
            await self.metrics.stop()
        await self.manager.shutdown()
        self._stopped.set()

    async def run_until_signalled(self) -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop_requested.set)
        await self.start()
        await stop_requested.wait()
        logger.info("signal received, shutting down")
        await self.stop()


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
    settings: ServerSettings, config: MetricsConfig, manager: ModelManager, custom: CustomMetricStore
) -> MetricsService:
    address = settings.metrics_address or (settings.http_address if settings.allow_http else "0.0.0.0")
    options = MetricsOptions(address, settings.metrics_port, settings.metrics_interval_ms,
                             settings.allow_cpu_metrics, config)
    return MetricsService(manager, options, custom)
