"""The Ray Serve deployment's options (replicas, autoscaling, actor resources, proxy ports) from flags or YAML.

Plain data: read and checked here without importing Ray, so a bad file or flag fails before a cluster is touched.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Keys a YAML file may hold (Ray Serve's own deployment option names, so a Ray user reads it as a deployment).
DEPLOYMENT_KEYS = frozenset({
    "num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests", "max_queued_requests",
    "health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s",
    "graceful_shutdown_wait_loop_s",
})
AUTOSCALING_KEYS = frozenset({"min_replicas", "max_replicas", "target_ongoing_requests", "initial_replicas",
                              "upscale_delay_s", "downscale_delay_s", "metrics_interval_s", "look_back_period_s"})
ACTOR_KEYS = frozenset({"num_cpus", "num_gpus", "memory", "resources", "runtime_env", "accelerator_type"})


class RayOptionsError(ValueError):
    """A flag or the YAML file asks for something the deployment cannot be."""


@dataclass
class RayServeOptions:
    """What `geserve ray-serve` passes to Ray; the server's own settings travel separately (ServerSettings)."""

    address: str = ""
    """Ray cluster to join ('auto', 'ray://...', host:port); empty: a running local one, else a new one."""
    app_name: str = "geserve"
    deployment: dict[str, Any] = field(default_factory=lambda: {
        "num_replicas": 1,
        # A replica batches: many requests in flight on one replica are how the dynamic batcher fills batches
        # (Ray's default, 5, would cap every batch at 5 requests).
        "max_ongoing_requests": 256,
        "ray_actor_options": {"num_cpus": 1},
    })
    """Ray Serve deployment options (serve.deployment's keyword arguments)."""

    def replicas_text(self) -> str:
        auto = self.deployment.get("autoscaling_config")
        if auto:
            return f"{auto.get('min_replicas', 1)}..{auto.get('max_replicas', 1)} replicas (autoscaling)"
        return f"{self.deployment.get('num_replicas', 1)} replicas"


def load_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping of deployment options (DEPLOYMENT_KEYS), checked key by key."""
    import yaml  # comes with ray[serve]

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RayOptionsError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise RayOptionsError(f"{path}: expected a mapping of deployment options")
    return data


def build_options(
    config: dict[str, Any] | None = None, *, address: str = "", app_name: str = "geserve",
    num_replicas: int | None = None, min_replicas: int | None = None, max_replicas: int | None = None,
    target_ongoing_requests: float | None = None, num_cpus: float | None = None, num_gpus: float | None = None,
    max_ongoing_requests: int | None = None,
) -> RayServeOptions:
    """Defaults, then the YAML file's mapping (`config`), then the flags given (not None): the later wins."""
    options = RayServeOptions(address=address, app_name=app_name)
    deployment = options.deployment
    _apply_file(deployment, config or {})
    scaling = {"min_replicas": min_replicas, "max_replicas": max_replicas,
               "target_ongoing_requests": target_ongoing_requests}
    _apply_replicas(deployment, num_replicas, {k: v for k, v in scaling.items() if v is not None})
    actor = deployment.setdefault("ray_actor_options", {})
    _set_given(actor, {"num_cpus": num_cpus, "num_gpus": num_gpus})
    _set_given(deployment, {"max_ongoing_requests": max_ongoing_requests})
    count = deployment.get("num_replicas", 1)
    if not isinstance(count, int) or count < 1:
        raise RayOptionsError(f"num_replicas must be a positive integer, got {count!r}")
    return options


def _apply_file(deployment: dict[str, Any], config: dict[str, Any]) -> None:
    """The YAML file's options over the defaults, each key checked (nested mappings copied: the file's stay as read)."""
    for key, value in config.items():
        if key not in DEPLOYMENT_KEYS:
            raise RayOptionsError(f"unknown deployment option '{key}' (expected one of {sorted(DEPLOYMENT_KEYS)})")
        deployment[key] = dict(value) if isinstance(value, dict) else value
    _check_keys(deployment.get("autoscaling_config") or {}, AUTOSCALING_KEYS, "autoscaling_config")
    _check_keys(deployment.get("ray_actor_options") or {}, ACTOR_KEYS, "ray_actor_options")


def _apply_replicas(deployment: dict[str, Any], num_replicas: int | None, scaling: dict[str, Any]) -> None:
    """A fixed count (`num_replicas`) or autoscaling (`scaling`, the autoscaling flags given), never both."""
    if num_replicas is not None and scaling:
        raise RayOptionsError("--num-replicas and --min/max-replicas / --target-ongoing-requests exclude each other")
    if scaling:
        deployment["autoscaling_config"] = {**(deployment.get("autoscaling_config") or {}), **scaling}
    if num_replicas is not None:
        deployment["num_replicas"] = num_replicas
        deployment.pop("autoscaling_config", None)  # a count on the command line wins over the file's autoscaling
    elif deployment.get("autoscaling_config"):
        deployment.pop("num_replicas", None)  # Ray refuses both: autoscaling decides the count


def _set_given(target: dict[str, Any], flags: dict[str, Any]) -> None:
    """The flags given (not None) into `target`, in order."""
    for key, value in flags.items():
        if value is not None:
            target[key] = value


def _check_keys(mapping: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    if not isinstance(mapping, dict):
        raise RayOptionsError(f"{where} must be a mapping")
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise RayOptionsError(f"unknown {where} key(s) {unknown} (expected some of {sorted(allowed)})")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`geserve ray-serve`'s own flags (the server's flags are `geserve serve`'s); each overrides --ray-config."""
    add = parser.add_argument
    add("--ray-config", type=Path, metavar="YAML",
        help="deployment options as Ray Serve names them: num_replicas or autoscaling_config {min_replicas, "
             "max_replicas, target_ongoing_requests}, ray_actor_options {num_cpus, num_gpus}, max_ongoing_requests")
    add("--ray-address", default="", help="Ray cluster to join ('auto', host:port, ray://...); default: a local one")
    add("--app-name", default="geserve", help="the Ray Serve application's name")
    add("--num-replicas", type=int, help="a fixed number of replicas (default 1)")
    add("--min-replicas", type=int, help="autoscaling: fewest replicas")
    add("--max-replicas", type=int, help="autoscaling: most replicas")
    add("--target-ongoing-requests", type=float, help="autoscaling: requests in flight per replica to aim for")
    add("--num-cpus", type=float, help="CPUs each replica reserves (default 1)")
    add("--num-gpus", type=float, help="GPUs each replica reserves (default 0)")
    add("--max-ongoing-requests", type=int,
        help="requests Ray lets one replica have in flight (default 256: room for the dynamic batcher)")
    add("--proxy-location", choices=["EveryNode", "HeadOnly", "Disabled"], default="EveryNode",
        help="where Ray runs its HTTP / gRPC proxies (on --http-port / --grpc-port)")
    add("--detach", action="store_true", help="deploy and return; the application runs on until `serve shutdown`")


def options_from_args(args: argparse.Namespace) -> RayServeOptions:
    return build_options(
        load_yaml(args.ray_config) if args.ray_config else None,
        address=args.ray_address, app_name=args.app_name, num_replicas=args.num_replicas,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
        max_ongoing_requests=args.max_ongoing_requests,
    )
