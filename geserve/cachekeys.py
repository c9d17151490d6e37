"""Where geserve keeps what it builds once and reuses (compiled packages, TensorRT engines, packed weights), and the
content hash that keys it. A leaf: the compiler and the devices both key their caches with it, and neither imports
the other for it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CACHE_ENV = "GESERVE_CACHE_DIR"


def cache_dir() -> Path:
    """$GESERVE_CACHE_DIR, else ~/.cache/geserve; read on every call so a test or a worker can point it elsewhere."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "geserve"


def file_hash(path: Path) -> str:
    """SHA-256 of the file's bytes, read in 1 MiB blocks (a model file can be larger than memory wants)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
