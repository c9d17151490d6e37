"""A POSIX shared memory object for tests, created the way tritonclient.utils.shared_memory creates them."""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path


class Region:
    """`shm_open(key)` is `/dev/shm/<key>` on Linux; the test owns it and unlinks it on close."""

    def __init__(self, size: int, prefix: str = "geserve-test") -> None:
        self.key = f"/{prefix}-{uuid.uuid4().hex[:12]}"
        self.path = Path("/dev/shm") / self.key[1:]
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.memory.close()
        self.path.unlink(missing_ok=True)
