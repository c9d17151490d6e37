"""`geserve serve | compile` command line: tritonserver's and atc's flag spellings, parsed into settings."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from geserve.settings import ServerSettings, parse_bool
from geserve.version import __version__


def _bool(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _backend_config(text: str) -> tuple[str, str, str]:
    """`<backend>,<key>=<value>` (or `<key>=<value>` for every backend), as tritonserver takes it."""
    backend, _, setting = text.rpartition(",")
    key, sep, value = setting.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--backend-config expects <backend>,<key>=<value>, got '{text}'")
    return backend or "ge", key, value


def _cache_config(text: str) -> tuple[str, str, str]:
    """`<cache>,<key>=<value>`, as tritonserver's --cache-config takes it (its messages)."""
    cache, comma, setting = text.partition(",")
    if not comma or not cache:
        raise argparse.ArgumentTypeError(
            f"No cache specified. --cache-config option format is <cache name>,<setting>=<value>. Got {text}"
        )
    key, sep, value = setting.partition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(
            f"--cache-config option format is '<cache name>,<setting>=<value>'. Got {text}"
        )
    return cache, key, value


def _metrics_config(text: str) -> tuple[str, str]:
    """`<key>=<value>`, as tritonserver's --metrics-config takes it."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--metrics-config expects <setting>=<value>, got '{text}'")
    return key, value


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model-repository", "--model-store", dest="model_repositories", action="append", type=Path,
        help="path to a Triton model repository (repeatable; or GESERVE_MODEL_REPOSITORIES)")
    add("--http-port", type=int)
    add("--http-address")
    add("--allow-http", type=_bool, nargs="?", const=True)
    add("--http-max-input-size", type=int,
        help="largest accepted request body in bytes")
    add("--http-server", choices=["native", "uvicorn"],
        help="the HTTP server under the ASGI app (geserve's own lean one, or uvicorn)")
    add("--inference-shortcuts", type=_bool, metavar="on|off",
        help="the request path's shortcuts (answer on the loop, queue with a callback, remembered headers, replayed "
             "HTTP heads); off: every inference in a task, the same answers, slower (for comparison)")
    add("--openai-api", type=_bool, metavar="on|off",
        help="OpenAI's embeddings API on the HTTP port (/v1/models, /v1/embeddings) for the models whose config has "
             "the `openai.embeddings` parameter; off: those routes answer 404")
    add("--overload-control", type=_bool, metavar="on|off",
        help="admission control for every model (its `overload_control` parameter overrides): refuse at arrival, with "
             "503 + Retry-After / UNAVAILABLE, what cannot be answered before its deadline or exceeds the adaptive "
             "concurrency limit, lowest priority first")
    add("--inline-execution-us", type=int,
        help="run executions typically taking less CPU time than this on the event loop (0: always on instance "
             "threads)")
    add("--compute-nice", type=int,
        help="run the threads that execute models this many nice levels below the event loop, which also takes the "
             "kernel's shortest time slice (Linux; 0: the same level and slice), so that arrivals and answers do not "
             "wait behind a running execution on a shared core")
    add("--loop-batching", type=_bool, metavar="on|off",
        help="while admission control refuses arrivals, batch-schedule the event loop (Linux SCHED_BATCH): arrivals "
             "wait for the scheduler's tick instead of each preempting a running execution; deadlines are kept that "
             "much earlier")
    add("--http-thread-count", type=int, help="accepted for compatibility; HTTP runs on the event loop")
    add("--http-header-timeout-secs", type=float,
        help="close a connection that has not sent a request's headers within this many seconds (408)")
    add("--http-idle-timeout-secs", type=float, help="close keep-alive connections idle this long")
    add("--http-body-timeout-secs", type=float,
        help="abandon a request body that makes no progress for this many seconds (408)")
    add("--http-max-header-size", type=int, help="largest request line + headers (431 above)")
    add("--http-max-header-count", type=int, help="most header fields per request (431 above)")
    add("--http-max-connections", type=int, help="most HTTP connections open at once")
    add("--http-use-ssl", type=_bool, nargs="?", const=True,
        help="HTTPS on the HTTP and metrics ports (needs --http-server-cert and --http-server-key)")
    add("--http-use-ssl-mutual", type=_bool, nargs="?", const=True,
        help="HTTPS requiring client certificates signed by --http-root-cert")
    add("--http-server-cert", metavar="PEM", help="the HTTPS certificate (chain); re-read on SIGHUP")
    add("--http-server-key", metavar="PEM", help="the HTTPS private key; re-read on SIGHUP")
    add("--http-root-cert", metavar="PEM",
        help="CA certificates that client certificates must be signed by (mutual TLS); re-read on SIGHUP")
    add("--grpc-port", type=int)
    add("--grpc-address")
    add("--allow-grpc", type=_bool, nargs="?", const=True)
    add("--grpc-infer-allocation-pool-size", type=int, help="accepted for tritonserver compatibility")
    add("--grpc-keepalive-time", dest="grpc_keepalive_time_ms", type=int,
        help="period of keepalive pings, ms (Triton's default)")
    add("--grpc-keepalive-timeout", dest="grpc_keepalive_timeout_ms", type=int,
        help="how long a keepalive ping waits for its acknowledgement, ms")
    add("--grpc-keepalive-permit-without-calls", type=_bool, nargs="?", const=True)
    add("--grpc-http2-max-pings-without-data", type=int)
    add("--grpc-http2-min-recv-ping-interval-without-data", type=int,
        dest="grpc_http2_min_recv_ping_interval_without_data_ms", help="ms")
    add("--grpc-http2-max-ping-strikes", type=int)
    add("--grpc-max-concurrent-streams", type=int, help="most concurrent calls per gRPC connection")
    add("--grpc-server", choices=["native", "grpcio"],
        help="the gRPC server: geserve's own on HTTP/2 (cleartext and TLS), or grpc.aio")
    add("--grpc-use-ssl", type=_bool, nargs="?", const=True,
        help="gRPC over TLS (needs --grpc-server-cert and --grpc-server-key)")
    add("--grpc-use-ssl-mutual", type=_bool, nargs="?", const=True,
        help="gRPC over TLS requiring client certificates signed by --grpc-root-cert (overrides --grpc-use-ssl)")
    add("--grpc-server-cert", metavar="PEM", help="the gRPC server certificate (chain); re-read on SIGHUP")
    add("--grpc-server-key", metavar="PEM", help="the gRPC server private key; re-read on SIGHUP")
    add("--grpc-root-cert", metavar="PEM",
        help="CA certificates that client certificates must be signed by (mutual TLS); re-read on SIGHUP")
    add("--allow-system-shared-memory", "--allow-client-shm", type=_bool, nargs="?", const=True,
        help="let clients register system shared memory regions for inputs and outputs (off by default; "
             "--allow-client-shm is Triton's name)")
    add("--metrics-port", type=int, help="port of the Prometheus endpoint (GET /metrics)")
    add("--metrics-address",
        help="address of the Prometheus endpoint (default: --http-address when HTTP is on, else 0.0.0.0)")
    add("--allow-metrics", type=_bool, nargs="?", const=True)
    add("--allow-cpu-metrics", type=_bool, nargs="?", const=True)
    add("--allow-gpu-metrics", type=_bool, nargs="?", const=True,
        help="accepted for compatibility; device metrics appear where the device reports them")
    add("--metrics-interval-ms", type=float, help="how often CPU metrics are sampled")
    add("--metrics-config", action="append", type=_metrics_config,
        help="<setting>=<value> (repeatable): counter_latencies, summary_latencies, summary_quantiles, "
             "histogram_latencies")
    add("--model-control-mode", choices=["none", "explicit", "poll"])
    add("--repository-poll-secs", type=float, help="poll mode: seconds between repository scans")
    add("--load-on-demand", type=_bool, nargs="?", const=True,
        help="explicit and poll modes: a request for a model in a repository that is not loaded loads it first")
    add("--model-memory-budget", metavar="SIZE",
        help="explicit and poll modes: most memory the loaded models may cost together (800MiB, 4GiB; all workers "
             "together); the least recently used idle models are unloaded to make room")
    add("--model-load-max-file-bytes", type=int,
        help="most bytes the model files of one load request may hold together, decoded")
    add("--workers", type=int,
        help="processes serving the ports together as one server (0, the default: one per core, at most 8; "
             "1: a single process)")
    add("--exit-timeout-secs", type=float,
        help="on SIGTERM, how long in-flight requests get to finish before the server exits")
    add("--id", dest="server_id", help="the server's name in its metadata")
    add("--load-model", dest="load_models", action="append",
        help="model to load at start in explicit mode (repeatable; '*' for all)")
    add("--strict-readiness", type=_bool, nargs="?", const=True)
    add("--exit-on-error", type=_bool, nargs="?", const=True)
    add("--disable-auto-complete-config", action="store_true")
    add("--strict-model-config", type=_bool, nargs="?", const=True,
        help="deprecated spelling: true disables auto-complete")
    add("--backend-config", action="append", type=_backend_config,
        help="<backend>,<key>=<value>, e.g. ge,execution_accelerators=cpu or ge,default-max-batch-size=8")
    add("--cache-config", action="append", type=_cache_config, metavar="<cache>,<setting>=<value>",
        help="the response cache, e.g. local,size=1048576 (bytes); models opt in with response_cache { enable: true }")
    add("--log-verbose", type=int, nargs="?", const=1)
    add("--trace-config", dest="trace_config", action="append", metavar="[<mode>,]<setting>=<value>",
        help="Triton's tracing: rate=N, level=TIMESTAMPS|TENSORS, count=N, mode=triton|opentelemetry, "
             "triton,file=PATH, triton,log-frequency=N, opentelemetry,url=URL (repeatable; see "
             "docs/guide/metrics-tracing.md)")
    # Security (docs/guide/security.md): Triton's restricted APIs, then geserve's own token auth and audit log.
    add("--http-restricted-api", action="append", metavar="<groups>:<header>=<value>",
        help="calls of these API groups (comma-separated: health, metadata, inference, shared-memory, model-config, "
             "model-repository, statistics, trace, logging) over HTTP need this header and value (repeatable)")
    add("--grpc-restricted-protocol", action="append", metavar="<groups>:<key>=<value>",
        help="calls of these API groups over gRPC need the metadata triton-grpc-protocol-<key> with this value "
             "(repeatable)")
    add("--auth-jwt-public-key", metavar="PEM",
        help="verify 'authorization: Bearer' tokens (JWT, RS256/ES256) with this public key or certificate")
    add("--auth-jwt-jwks", metavar="FILE", help="verify tokens with this JWK set (keys by 'kid')")
    add("--auth-jwt-audience", help="the 'aud' tokens must carry")
    add("--auth-jwt-issuer", help="the 'iss' tokens must carry")
    add("--auth-jwt-leeway-secs", type=float, help="clock skew allowed on exp / nbf / iat")
    add("--auth-protect-health", type=_bool, nargs="?", const=True,
        help="require a token (scope 'health') for liveness and readiness too (open by default, for probes)")
    add("--audit-log", metavar="PATH",
        help="append a JSON line per repository, shared-memory, logging and trace call and per refused call")
    add("--log-info", type=_bool, nargs="?", const=True)


def _add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", type=Path, required=True,
        help="model.onnx, a PyTorch .pt, a TensorFlow SavedModel folder, frozen .pb / .graphdef or Keras .keras file, "
             "or a .gem")
    add("--output", type=Path, help="the compiled model to write (.gem)")
    add("--info", action="store_true", help="print the manifest of the .gem given as --model (like atc --mode=6)")
    add("--framework", choices=["onnx", "pytorch", "tensorflow"], help="default: from the file name")
    add("--input-shape", help='"name:d0,d1,...;name2:..." with -1 for a dynamic dimension')
    add("--dynamic-batch-size", help="batch gears, e.g. 1,2,4,8 (the batcher pads batches up to one)")
    add("--out-nodes", help="comma-separated tensors (or node names) to cut the graph at")
    add("--signature", help="a TensorFlow SavedModel's signature to convert (default: serving_default)")
    add("--precision-mode", default="force_fp32",
        choices=["force_fp32", "must_keep_origin_dtype", "allow_fp32_to_fp16", "force_fp16", "allow_mix_precision"])
    add("--keep-io-types", default="true", help="keep FP32 inputs/outputs when converting to FP16 (default true)")
    add("--keep-fp32", metavar="NAMES|@FILE",
        help="node names or op types kept in FP32 through FP16 conversion and --quantize int8 (atc's --keep_dtype): "
             "comma-separated, or @FILE with one a line (# comments); names as --check --layers reports them")
    add("--quantize", choices=["none", "int8"], default="none")
    add("--calibration-data", type=Path,
        help="for --quantize int8: a folder of .npy/.npz batches, or a callable file.py:function / module:function")
    add("--insert-op-conf", type=Path, help="AIPP-style preprocessing JSON to fold into the graph")
    add("--custom-op-library", type=Path, action="append", metavar="PATH",
        help="a custom-op library (.so) the graph needs; repeatable. The package records it (a relative PATH as "
             "given, else its file name) and the served model loads it from its model folder, next to config.pbtxt")
    add("--target", choices=["cpu", "cuda", "npu"], default="cpu")
    add("--encrypt-key-file", type=Path, help="encrypt with AES-256-GCM using this 32-byte (or 64-hex) key")
    add("--no-optimize", action="store_true", help="skip ONNX Runtime's graph optimization")
    add("--quiet", action="store_true", help="no progress lines")
    add("--check", action="store_true",
        help="run the source and the compiled model on the same inputs and print how far apart they are")
    add("--check-data", type=Path, help="folder of .npy/.npz inputs for --check (default: random inputs)")
    _add_layer_arguments(parser)


def _add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    from geserve.compiler.compare import LAYERS_THRESHOLD

    add = parser.add_argument
    add("--layers", action="store_true",
        help="with --check: also compare every tensor both graphs compute, matched by name in the source's order, "
             "and mark the first layer whose max rel error is above --layers-threshold")
    add("--layers-threshold", type=float, default=LAYERS_THRESHOLD, metavar="T",
        help="max rel error (max |error| / max |source tensor|) above which a layer counts as where the error jumps "
             f"(default {LAYERS_THRESHOLD:g}; ResNet-50's first INT8 layers measure 0.02, FP16 layers below 0.001)")
    add("--layers-csv", type=Path, metavar="PATH", help="write the --layers table to PATH as CSV")
    add("--dump-dir", type=Path, metavar="DIR",
        help="with --layers: write every tensor of both graphs under DIR/golden and DIR/compiled, as dump folders "
             "that geserve compare reads")


def _defaults_from_settings(parser: argparse.ArgumentParser) -> None:
    """An option not given leaves its setting alone (its default, or a GESERVE_* variable): ServerSettings alone
    holds the defaults, and the help shows them from there."""
    defaults = ServerSettings()
    for action in parser._actions:
        if action.dest == "help":
            continue
        action.default = argparse.SUPPRESS
        value = getattr(defaults, action.dest, None)
        if value is None or value == "" or isinstance(value, list | dict) or action.nargs == 0:  # a flag, or none
            continue
        shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
        note = f"default: {shown}".replace("%", "%%")
        action.help = f"{action.help} ({note})" if action.help else note


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geserve", description="Triton-compatible inference server", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"geserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve Triton model repositories", allow_abbrev=False)
    _add_serve_arguments(serve)
    _defaults_from_settings(serve)
    ray_serve = commands.add_parser(
        "ray-serve", help="serve the repositories as a Ray Serve deployment (replicas across a Ray cluster)",
        allow_abbrev=False,
    )
    _add_serve_arguments(ray_serve)
    _defaults_from_settings(ray_serve)
    from geserve.integrations.ray_options import add_arguments as add_ray_arguments

    add_ray_arguments(ray_serve)
    _add_compile_arguments(
        commands.add_parser("compile", help="compile a model into a .gem package (atc)", allow_abbrev=False)
    )
    from geserve.compiler.compare import add_arguments as add_compare_arguments

    add_compare_arguments(commands.add_parser(
        "compare", help="compare an output array with a golden one, or two dump folders layer by layer (npu_compare)",
        allow_abbrev=False
    ))
    from geserve.tune.command import add_arguments as add_tune_arguments

    add_tune_arguments(commands.add_parser(
        "tune", help="sweep a model's serving configuration with perf_analyzer (Model Analyzer)", allow_abbrev=False
    ))
    return parser


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Defaults and GESERVE_* variables first; then only the options given on the command line."""
    settings = ServerSettings.from_env()
    given = vars(args)
    for name in {f.name for f in fields(ServerSettings)} & given.keys() - {"backend_config", "metrics_config",
                                                                           "cache_config"}:
        setattr(settings, name, given[name])
    for cache, key, value in given.get("cache_config", []):
        settings.cache_config.setdefault(cache, {})[key] = value
    for backend, key, value in given.get("backend_config", []):
        settings.backend_config.setdefault(backend, {})[key] = value
    if "metrics_config" in given:
        settings.metrics_config = dict(given["metrics_config"])
    if given.get("disable_auto_complete_config") or given.get("strict_model_config"):
        settings.auto_complete_config = False
    return settings


def _ray_serve(args: argparse.Namespace, settings: ServerSettings) -> int:
    """`geserve ray-serve`: the same settings, deployed as Ray Serve replicas (geserve/integrations)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname).1s %(name)s] %(message)s")
    try:
        from geserve.integrations.ray_options import RayOptionsError, options_from_args
        from geserve.integrations.ray_serve import run as run_ray_serve
    except ImportError as exc:
        print(f"error: geserve ray-serve needs Ray Serve (pip install 'geserve[ray]'): {exc}", file=sys.stderr)
        return 1
    try:
        options = options_from_args(args)
    except RayOptionsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not settings.model_repositories:
        print("error: at least one --model-repository is required", file=sys.stderr)
        return 1
    return run_ray_serve(settings, options, args.proxy_location, args.detach)


def _install_event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _compile(args: argparse.Namespace) -> int:
    from geserve.compiler.command import run

    return run(args)


def _compare(args: argparse.Namespace) -> int:
    from geserve.compiler.dumps import run_compare

    return run_compare(args)


def _tune(args: argparse.Namespace) -> int:
    from geserve.tune.command import run as run_tune

    return run_tune(args)


# The commands that start no server, so take no server settings; each imports its own modules only when run.
_OFFLINE_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "compile": _compile,
    "compare": _compare,
    "tune": _tune,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    offline = _OFFLINE_COMMANDS.get(args.command)
    if offline is not None:
        return offline(args)
    settings = settings_from_args(args)
    if args.command == "ray-serve":
        return _ray_serve(args, settings)
    return _serve(args, settings, argv)


def _serve(args: argparse.Namespace, settings: ServerSettings, argv: list[str] | None) -> int:
    """`geserve serve`: one server, or a supervisor of `--workers` of them; this process may be one such worker."""
    from geserve.workers.link import WorkerLink

    link = WorkerLink.from_environment()  # set when a supervisor started this process as one of its workers
    if link is not None:  # a terminal's hangup reaches the whole group: the supervisor decides what it means
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    quiet = not getattr(args, "log_info", True)
    logging.basicConfig(
        level=logging.DEBUG if settings.log_verbose else (logging.WARNING if quiet else logging.INFO),
        format=f"%(asctime)s %(levelname).1s {f'w{link.index} ' if link else ''}%(name)s] %(message)s",
    )
    from geserve.server import Server, StartupError
    from geserve.workers.supervisor import Supervisor, worker_count

    if settings.model_memory_budget and argv is None:  # measured loads want one malloc arena from the start
        from geserve.repository.memory import exec_with_one_heap

        exec_with_one_heap()

    _install_event_loop_policy()
    workers = 1 if link is not None else worker_count(settings.workers)

    async def serve() -> int:
        if workers > 1:
            given = sys.argv[1:] if argv is None else argv
            return await Supervisor(settings, given[given.index("serve") + 1:], workers).run()
        await Server(settings, link=link).run_until_signalled()
        return 0

    try:
        return asyncio.run(serve())
    except StartupError as exc:
        print(f"error: creating server: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
