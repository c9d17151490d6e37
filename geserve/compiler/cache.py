"""Compile-on-first-load cache: `.gem` files keyed by source hash + options, safe against concurrent compiles."""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from geserve.cachekeys import cache_dir
from geserve.compiler.options import CompileOptions
from geserve.compiler.package import write_package
from geserve.compiler.pipeline import COMPILER_VERSION, compile_model, source_hash

logger = logging.getLogger(__name__)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Held by one process at a time across the machine (flock on `lock_path`): a cache entry is made once while
    the other processes that want it wait, then find it made."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def compile_cached(options: CompileOptions, directory: Path | None = None) -> tuple[Path, bool]:
    """(path of the compiled package, True when it came from the cache). One process compiles; others wait."""
    directory = directory or cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    key = options.fingerprint(source_hash(options), COMPILER_VERSION)[:40]
    path = directory / f"{key}.gem"
    if path.is_file():
        return path, True
    with exclusive(directory / f"{key}.lock"):
        if path.is_file():
            return path, True  # another process compiled it while this one waited
        manifest, onnx_bytes = compile_model(options)
        write_package(path, manifest, onnx_bytes)
    return path, False
