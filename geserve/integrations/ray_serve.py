"""geserve as a Ray Serve deployment: every replica is the server core (repository, service) behind the HTTP ASGI
app as Ray's ingress and the gRPC servicer behind Ray's gRPC proxy; `run` deploys it for `geserve ray-serve`.

Per replica, as in a single geserve: the models (each replica loads the same repository), `/v2/models/stats`
(the answering replica's) and `/metrics`, served by each replica at --metrics-port + its rank (0, 1, ... across
the deployment) on its node (docs/guide/scaling-out.md shows the Prometheus aggregation). Ray's proxies only route:
nothing is shared between replicas.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import replace
from typing import Any

from ray import serve

from geserve import devices
from geserve.frontends.grpc.server import GrpcInferenceServicer
from geserve.frontends.http.app import HttpFrontend
from geserve.integrations.ray_grpc import SERVICER_FUNCTION, UNARY_RPCS, forwarder, stream_infer
from geserve.integrations.ray_options import RayServeOptions
from geserve.server import Server
from geserve.settings import ServerSettings

# Ray Serve writes the "ray.serve" logger to each replica's log file (logs/serve/replica_*.log).
logger = logging.getLogger("ray.serve")


class NotReady(RuntimeError):
    """check_health's answer while geserve's readiness is false: Ray restarts the replica after a few of them."""


class GeserveReplica:
    """One replica: a geserve Server whose own HTTP and gRPC listeners are off (Ray's proxies are the front),
    with the metrics endpoint at --metrics-port + its rank: the deployment's ranks are 0..n-1 and a replacement
    takes the rank it replaces, so no two replicas share a port, even as nodes on one host."""

    server: Server
    grpc_servicer: GrpcInferenceServicer

    async def __init__(self, settings: ServerSettings) -> None:  # type: ignore[misc]  # Ray awaits it
        rank = int(serve.get_replica_context().rank.rank)
        own = replace(settings, allow_http=False, allow_grpc=False, metrics_port=settings.metrics_port + rank)
        _keep_to_reserved_cpus()
        self.server = Server(own)
        await self.server.start()  # loads the repository's models; a failure fails the replica (Ray retries)
        self.grpc_servicer = GrpcInferenceServicer(self.server.service)
        self._app = HttpFrontend(self.server.service, own.http_max_input_size)
        logger.info("geserve replica ready (metrics on port %d)", own.metrics_port if own.allow_metrics else 0)

    def __serve_build_asgi_app__(self) -> HttpFrontend:
        return self._app

    async def check_health(self) -> None:
        """Ray's health check is geserve's readiness (`/v2/health/ready`): with --strict-readiness (the default),
        every model ready; a replica that stays unready is replaced."""
        if not self.server.service.ready():
            raise NotReady("geserve is not ready (a model is not ready, or the replica is stopping)")

    async def __del__(self) -> None:
        """Ray calls this after its graceful shutdown (no new requests routed here, those in flight waited for):
        geserve's own drain then stops the metrics endpoint and unloads the models."""
        server = getattr(self, "server", None)
        if server is not None:
            clean = await server.stop()
            logger.info("geserve replica stopped (%s)", "drained" if clean else "exit timeout: work abandoned")


def _keep_to_reserved_cpus() -> None:
    """ONNX Runtime sizes its thread pools from the cores this process may run on, which are the node's: a replica
    that reserved fewer CPUs (`num_cpus`) takes its share instead, as a worker of `--workers` does, so replicas
    sharing a node do not oversubscribe it. Fractional or no CPUs: one core's worth."""
    import ray

    reserved = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    devices.share_cores(max(1, devices.cpu_count() // max(1, int(reserved))))


for _rpc in UNARY_RPCS:
    setattr(GeserveReplica, _rpc, forwarder(_rpc))
GeserveReplica.ModelStreamInfer = stream_infer  # type: ignore[attr-defined]

GeserveDeployment = serve.deployment(name="geserve")(serve.ingress()(GeserveReplica))


def build_app(settings: ServerSettings, options: RayServeOptions) -> Any:
    """The bound application (`serve.run`'s argument), one deployment with `options.deployment`'s options.

    The graceful shutdown waits --exit-timeout-secs for requests in flight, as the single server does."""
    deployment_options = {"graceful_shutdown_timeout_s": settings.exit_timeout_secs, **options.deployment}
    return GeserveDeployment.options(**deployment_options).bind(settings)


def proxy_options(settings: ServerSettings) -> dict[str, Any]:
    """serve.start's http_options / grpc_options: Ray's proxies take geserve's HTTP and gRPC ports."""
    grpc = {"port": settings.grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]} if settings.allow_grpc else {}
    return {"http_options": {"host": settings.http_address, "port": settings.http_port}, "grpc_options": grpc}


def deploy(settings: ServerSettings, options: RayServeOptions, proxy_location: str = "EveryNode") -> None:
    """Join (or start) the Ray cluster, start Serve's proxies on geserve's ports and run the application."""
    import ray

    if not ray.is_initialized():
        ray.init(address=options.address or None, log_to_driver=False)
    serve.start(proxy_location=proxy_location, **proxy_options(settings))
    serve.run(build_app(settings, options), name=options.app_name, route_prefix="/", blocking=False)


def run(settings: ServerSettings, options: RayServeOptions, proxy_location: str = "EveryNode",
        detach: bool = False) -> int:
    """`geserve ray-serve`: deploy, then (unless detached) serve until SIGINT / SIGTERM and shut Serve down,
    which drains every replica."""
    deploy(settings, options, proxy_location)
    print(f"geserve on Ray Serve: {options.replicas_text()}; HTTP :{settings.http_port}"
          + (f", gRPC :{settings.grpc_port}" if settings.allow_grpc else ""), flush=True)
    if detach:
        return 0
    async def wait() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    asyncio.run(wait())
    serve.shutdown()
    return 0
