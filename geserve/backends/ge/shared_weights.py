"""One physical copy of a CPU model's prepacked weights for all its sessions: every instance, in every worker, maps
the same file instead of holding a private heap copy.

ONNX Runtime rearranges MatMul, Gemm and Conv weights into its kernels' layout ("prepacking") when a session starts,
on the heap: N workers with M instances each hold N x M copies, and a worker's batch finds its own copy cold in the
caches (bench/weights_cache_bench.py: 549 µs per b=8 MLP run with a copy per process, 416 with one shared copy).
Saved once with `session.save_external_prepacked_constant_initializers`, the optimized graph's external data holds
the prepacked weights, and a session made from that graph maps them from the page cache, read-only.

The packed graph is written to the compile cache (`$GESERVE_CACHE_DIR/weights/<key>/`), keyed by the model's bytes,
the ONNX Runtime version, this CPU (the optimized graph may use its instruction set) and the session options that
shape the graph. An encrypted model is never written there: its weights would lie on disk in the clear.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path

import onnxruntime as ort

from geserve.compiler.cache import cache_dir

logger = logging.getLogger(__name__)

PACKED_MODEL = "model.onnx"
PACKED_DATA = "model.data"
_MIN_EXTERNAL_BYTES = "1024"  # ONNX Runtime's own threshold in its docs; smaller initializers stay in the graph


def packed_graph(
    graph: Path | bytes, fingerprint: str, new_options: Callable[[], ort.SessionOptions], directory: Path | None = None
) -> Path | None:
    """The graph to load with its prepacked weights mapped, packing it the first time (one process packs, the others
    wait for it); None when ONNX Runtime cannot save it (the caller loads `graph` as it is)."""
    key = hashlib.sha256("\0".join((_graph_identity(graph), fingerprint, ort.__version__, _cpu_signature()))
                         .encode()).hexdigest()[:40]
    root = (directory or cache_dir()) / "weights"
    packed = root / key
    if (packed / PACKED_MODEL).is_file():
        return packed / PACKED_MODEL
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (packed / PACKED_MODEL).is_file():  # else another process packed it while this one waited
                _pack(graph, new_options, root, key)
    except (OSError, _PackingFailed) as exc:
        logger.warning("cannot save the prepacked weights of %s in %s (%s); each session keeps its own copy",
                       "a package" if isinstance(graph, bytes) else graph, root, exc)
        return None
    return packed / PACKED_MODEL


class _PackingFailed(Exception):
    """ONNX Runtime could not save the graph (one compiled for a device, say)."""


def _pack(graph: Path | bytes, new_options: Callable[[], ort.SessionOptions], root: Path, key: str) -> None:
    """Save the optimized graph with its prepacked weights into `root/key/`, whole or not at all."""
    for stale in root.glob(f"{key}.*.partial"):  # left by a process that died packing (this one holds the lock)
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f"{key}.{os.getpid()}.partial"
    partial.mkdir()
    options = new_options()
    options.optimized_model_filepath = str(partial / PACKED_MODEL)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", PACKED_DATA)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                     _MIN_EXTERNAL_BYTES)
    options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    try:
        ort.InferenceSession(graph if isinstance(graph, bytes) else str(graph), options,
                             providers=["CPUExecutionProvider"])
    except Exception as exc:  # the caller's own load reports a broken model; this only loses the sharing
        shutil.rmtree(partial, ignore_errors=True)
        raise _PackingFailed((str(exc).splitlines() or [type(exc).__name__])[0]) from None
    os.rename(partial, root / key)  # a reader never sees half a graph


def fingerprint(*parts: object) -> str:
    """The session options that shape the saved graph, as one string for `packed_graph`'s key."""
    return repr(parts)


def _graph_identity(graph: Path | bytes) -> str:
    """A package's bytes; a graph file's identity, and its folder's other files' (external data it names). Size,
    modification and change times: a file rewritten in place changes its change time, which no copy tool sets, and
    hashing a model of gigabytes on every load would cost seconds."""
    if isinstance(graph, bytes):
        return hashlib.sha256(graph).hexdigest()
    parts = [str(graph.resolve())]
    for item in sorted(graph.parent.iterdir()):
        if item.is_file():
            stat = item.stat()
            parts.append(f"{item.name}:{stat.st_dev}:{stat.st_ino}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}")
    return "\n".join(parts)


@cache
def _cpu_signature() -> str:
    """The CPU's model and instruction-set flags: an optimized graph saved on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [line for line in handle if line.startswith(("model name", "flags"))][:2]
    except OSError:
        import platform

        return platform.machine() + platform.processor()
    return "".join(lines)
