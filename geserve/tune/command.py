"""`geserve tune`: its arguments, and the run that ties the pieces together (server, sweep, report, plot)."""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from google.protobuf import text_format

from geserve.config import ModelConfig, read_model_config
from geserve.errors import GeserveError
from geserve.tune import perf_analyzer
from geserve.tune.progress import Progress
from geserve.tune.report import markdown, winner
from geserve.tune.server import TuneServer, TuneServerError, copy_model
from geserve.tune.space import Space, apply, candidates, is_ge_model
from geserve.tune.sweep import Point, Sweep, SweepOptions

EXIT_OK, EXIT_NO_WINNER, EXIT_ERROR = 0, 1, 2
REPORT, CONFIG, PLOT, SERVER_LOG = "report.md", "config.pbtxt", "tune.png", "server.log"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got '{text}'")
    return values


def _positive_list(text: str) -> tuple[int, ...]:
    values = _int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got '{text}'")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model-repository", type=Path, required=True, help="the Triton model repository holding the model")
    add("--model", required=True, help="the model to tune (its folder in the repository)")
    add("--latency-budget-ms", type=float, default=20.0, help="the latency (at --percentile) the winner must keep")
    add("--concurrency", type=_positive_list, default=(1, 4, 16), help="client concurrency levels (default 1,4,16)")
    add("--output-dir", type=Path, help="where config.pbtxt, report.md, tune.png go (default ./tune-<model>)")
    add("--instances", type=_positive_list, default=(1, 2), help="instance counts to try (default 1,2)")
    add("--max-batch-sizes", type=_positive_list, default=(1, 8, 32),
        help="max_batch_size values to try, capped at the model's own (default 1,8,32)")
    add("--queue-delays-us", type=_int_list, default=(0, 500),
        help="dynamic batcher max_queue_delay_microseconds to try with batching (default 0,500)")
    add("--compiler-variants", action="store_true",
        help="GE models: also try batch gears and the --precisions the compiler makes (compiled on first load)")
    add("--precisions", default="allow_fp32_to_fp16",
        help="compiler precision modes tried with --compiler-variants (comma-separated; the model as it is too)")
    add("--protocol", choices=["http", "grpc"], default="http", help="what perf_analyzer speaks")
    add("--percentile", type=int, choices=[50, 90, 95, 99], default=99, help="the latency that counts (default 99)")
    add("--measurement-interval-ms", type=int, default=1000, help="perf_analyzer's window (default 1000)")
    add("--stability-percentage", type=int, default=50, help="perf_analyzer's stability threshold (default 50)")
    add("--max-trials", type=int, default=5, help="perf_analyzer's windows before it gives up settling (default 5)")
    add("--busy-limit", type=float, default=0.15,
        help="measure a point again when other processes used more than this share of the CPUs (default 0.15)")
    add("--max-repeats", type=int, default=2, help="most repeats of a point on a busy machine (default 2)")
    add("--quiet-wait-s", type=float, default=60.0,
        help="the sweep's total time for waiting on other processes to leave the CPUs (default 60)")
    add("--perf-analyzer-args", default="", help="more perf_analyzer arguments, e.g. '--shape input:1,256'")
    add("--server-arg", action="append", default=[], metavar="ARG",
        help="an argument for the geserve serve being measured (repeatable), e.g. --server-arg=--log-verbose=1")
    add("--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (GeserveError, TuneServerError, OSError) as exc:
        print(f"error: geserve tune: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    model_dir = args.model_repository / args.model
    base = _base_config(args, model_dir)
    precisions = tuple(p.strip() for p in args.precisions.split(",") if p.strip()) if args.compiler_variants else ()
    space = Space(args.instances, args.max_batch_sizes, args.queue_delays_us, precisions, args.compiler_variants)
    tried = candidates(base, space)
    options = _sweep_options(args)
    output = args.output_dir or Path(f"tune-{args.model}")
    output.mkdir(parents=True, exist_ok=True)
    if args.compiler_variants and not is_ge_model(base):
        print(f"tune: {args.model} is not a GE model; --compiler-variants has nothing to try", file=sys.stderr)
    progress = Progress(len(tried) * len(set(options.concurrencies)), enabled=not args.quiet)
    progress.note(f"{len(tried)} configurations x {len(set(options.concurrencies))} concurrency levels; "
                  f"budget p{options.percentile} <= {options.budget_ms:g} ms")
    with tempfile.TemporaryDirectory(prefix="geserve-tune-") as tmp:
        copy_model(model_dir, Path(tmp))
        (output / SERVER_LOG).unlink(missing_ok=True)
        with TuneServer(Path(tmp), output / SERVER_LOG, args.server_arg) as server:
            points = Sweep(server, base, options, progress).run(tried)

    best = winner(points)
    config_text = _write_config(base, best, output)
    plot_name = _write_plot(points, options, output)
    command = shlex.join(["geserve", "tune", *sys.argv[2:]]) if sys.argv[1:2] == ["tune"] else "geserve tune"
    (output / REPORT).write_text(markdown(points, options, command=command, config_text=config_text,
                                          plot_name=plot_name, elapsed_s=time.monotonic() - started))
    return _print_result(best, options, output, plot_name)


def _base_config(args: argparse.Namespace, model_dir: Path) -> ModelConfig:
    """The model's own config, once the folder and perf_analyzer are known to be there."""
    if not model_dir.is_dir():
        raise TuneServerError(f"no model folder {model_dir}")
    reason = perf_analyzer.unavailable_reason()
    if reason:
        raise TuneServerError(reason)
    base = read_model_config(model_dir, allow_missing=False)
    base.name = args.model
    return base


def _sweep_options(args: argparse.Namespace) -> SweepOptions:
    return SweepOptions(
        model=args.model, concurrencies=args.concurrency, budget_ms=args.latency_budget_ms, protocol=args.protocol,
        percentile=args.percentile, window_ms=args.measurement_interval_ms, stability=args.stability_percentage,
        max_trials=args.max_trials, busy_limit=args.busy_limit, max_repeats=args.max_repeats,
        quiet_wait_s=args.quiet_wait_s, perf_analyzer_args=tuple(shlex.split(args.perf_analyzer_args)),
    )  # fmt: skip


def _write_config(base: ModelConfig, best: Point | None, output: Path) -> str | None:
    """The winner's config.pbtxt text, written to `output`; None without a winner."""
    if best is None:
        return None
    config_text = text_format.MessageToString(apply(base, best.candidate))
    (output / CONFIG).write_text(config_text)
    return config_text


def _write_plot(points: list[Point], options: SweepOptions, output: Path) -> str | None:
    """The plot's file name, or None where matplotlib is missing."""
    try:
        from geserve.tune.plot import write_plot

        write_plot(points, options, output / PLOT)
    except ImportError:
        print("tune: no plot: matplotlib is missing (pip install 'geserve[tune]')", file=sys.stderr)
        return None
    return PLOT


def _print_result(best: Point | None, options: SweepOptions, output: Path, plot_name: str | None) -> int:
    if best is None or best.measurement is None:
        print(f"no configuration kept p{options.percentile} within {options.budget_ms:g} ms; see {output / REPORT}")
        return EXIT_NO_WINNER
    print(f"best: {best.candidate.label} at concurrency {best.concurrency}: {best.throughput:.0f} infer/s, "
          f"p{options.percentile} {best.latency_ms:.2f} ms")
    print(f"wrote {output / CONFIG}, {output / REPORT}" + (f", {output / PLOT}" if plot_name else ""))
    return EXIT_OK
