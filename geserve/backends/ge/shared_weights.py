"""One physical copy of a CPU model's prepacked weights for all its sessions: every instance, in every worker, maps
the same file instead of holding a private heap copy.

ONNX Runtime rearranges MatMul, Gemm and Conv weights into its kernels' layout ("prepacking") when a session starts,
on the heap: N workers with M instances each hold N x M copies, and a worker's batch finds its own copy cold in the
caches (bench/weights_cache_bench.py: 477 µs per b=8 MLP run with a copy per process, 372 with one mapped copy).
Saved once with `session.save_external_prepacked_constant_initializers`, the optimized graph's external data holds
the prepacked weights, and a session made from that graph maps them from the page cache, read-only.

The packed graph is written to the compile cache (`$GESERVE_CACHE_DIR/weights/<key>/`, mode 0700), keyed by the model
file's identity, the ONNX Runtime version, this CPU (the optimized graph may use its instruction set) and the session
options that shape the graph; entries whose model file is gone or changed are removed when another is packed. An
encrypted model is never written there: its weights would lie on disk in the clear.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path

import onnxruntime as ort

from geserve.cachekeys import cache_dir
from geserve.compiler.cache import exclusive

logger = logging.getLogger(__name__)

PACKED_MODEL = "model.onnx"
PACKED_DATA = "model.data"
ORIGIN = "origin.json"  # the model file an entry was packed from, and its identity then
_MIN_EXTERNAL_BYTES = "1024"  # ONNX Runtime's own threshold in its docs; smaller initializers stay in the graph


def packed_graph(
    source: Path,
    graph: Path | bytes,
    fingerprint: str,
    new_options: Callable[[], ort.SessionOptions],
    directory: Path | None = None,
) -> Path | None:
    """The graph to load with its prepacked weights mapped, packing `graph` (read from the model file `source`) the
    first time: one process packs, the others wait for it. None when it cannot be saved (the caller loads `graph`
    as it is)."""
    siblings = not isinstance(graph, bytes)  # a package holds all its weights; a plain graph may name other files
    identity = _source_identity(source, siblings)
    key = hashlib.sha256("\0".join((identity, fingerprint, ort.__version__, _cpu_signature())).encode()).hexdigest()
    key = key[:40]
    root = (directory or cache_dir()) / "weights"
    packed = root / key
    if (packed / PACKED_MODEL).is_file():
        return packed / PACKED_MODEL
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # a model's weights: its owner's alone
        with exclusive(root / f"{key}.lock"):
            if not (packed / PACKED_MODEL).is_file():  # else another process packed it while this one waited
                _prune(root)
                _pack(graph, new_options, root, key, {"source": str(source.resolve()), "siblings": siblings,
                                                                 "identity": identity})
    except (OSError, _PackingFailed) as exc:
        logger.warning("cannot save the prepacked weights of %s in %s (%s); each session keeps its own copy",
                       source, root, exc)
        return None
    return packed / PACKED_MODEL


class _PackingFailed(Exception):
    """ONNX Runtime could not save the graph (one compiled for a device, say)."""


def _pack(graph: Path | bytes, new_options: Callable[[], ort.SessionOptions], root: Path, key: str,
          origin: dict[str, object]) -> None:
    """Save the optimized graph with its prepacked weights into `root/key/`, whole or not at all, with the model
    file it came from (for `_prune`)."""
    for stale in root.glob(f"{key}.*.partial"):  # left by a process that died packing (this one holds the lock)
        shutil.rmtree(stale, ignore_errors=True)
    partial = root / f"{key}.{os.getpid()}.partial"
    partial.mkdir(mode=0o700)
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
    (partial / ORIGIN).write_text(json.dumps(origin))
    os.rename(partial, root / key)  # a reader never sees half a graph


def _prune(root: Path) -> None:
    """Remove the entries whose model file is gone or has changed since (a new version written in place, a load
    request's model files): no session will map them again, and each is about a model's size on disk. A session
    still mapping one keeps its pages until it closes."""
    for entry in root.iterdir():
        if not entry.is_dir() or entry.suffix == ".partial":
            continue
        try:
            origin = json.loads((entry / ORIGIN).read_text())
            stale = _source_identity(Path(origin["source"]), bool(origin["siblings"])) != origin["identity"]
        except (OSError, ValueError, LookupError, TypeError):  # the model file or its folder is gone, or no record
            stale = True
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            (root / f"{entry.name}.lock").unlink(missing_ok=True)


def fingerprint(*parts: object) -> str:
    """The session options that shape the saved graph, as one string for `packed_graph`'s key."""
    return repr(parts)


def file_identity(path: Path) -> str:
    """A file's identity for a key (a custom-op library's, say): path, size and times; only the path if it is
    missing."""
    return _source_identity(path, siblings=False)


def _source_identity(source: Path, siblings: bool) -> str:
    """The model file's identity, with `siblings` its folder's other files' too (the external data a graph names):
    path, size, modification and change times. A file rewritten in place changes its change time, which no copy tool
    sets, and hashing a model of gigabytes on every load would cost seconds."""
    parts = [str(source.resolve())]
    for item in sorted(source.parent.iterdir()) if siblings else [source]:
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
