"""System shared memory regions clients register by key (`/dev/shm/<key>`): inputs read from, outputs written to them.

Protocol-neutral: both frontends resolve a tensor's `shared_memory_region` / `_offset` / `_byte_size` here, with
Triton's messages for each fault. Off unless the server runs with `--allow-system-shared-memory`, because a
registered key lets a client make the server map (and write) any shared memory object the server can open.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from geserve.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)

SHM_ROOT = Path("/dev/shm")
DISABLED = (
    "system shared memory is disabled on this server; start geserve with --allow-system-shared-memory to use it"
)


class OutputPlacementError(InternalError):
    """An output does not fit the shared memory the request gave it (Triton: found after inference, 500)."""


@dataclass(frozen=True, slots=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class _Region:
    status: RegionStatus
    memory: mmap.mmap
    view: memoryview  # the registered window: [offset, offset + byte_size) of the object


class SharedMemoryRegistry:
    """Registered regions by name; `enabled` False refuses registration (status and unregister still answer)."""

    def __init__(self, enabled: bool, root: Path = SHM_ROOT) -> None:
        self.enabled = enabled
        self._root = root
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not self.enabled:
            raise UnsupportedError(DISABLED)
        with self._lock:
            if name in self._regions:
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
        path = self._root / key.lstrip("/")
        if not key.strip("/") or "/" in key.strip("/") or "\0" in key:  # a NUL would fail os.open with ValueError
            raise InternalError(f"Unable to open shared memory region: '{key}'")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            raise InternalError(f"Unable to open shared memory region: '{key}'") from None
        try:
            size = os.fstat(fd).st_size
            if byte_size <= 0 or offset < 0 or offset + byte_size > size:  # mapping past the end would SIGBUS
                raise InternalError(f"Invalid shared memory region: '{key}'")
            memory = mmap.mmap(fd, offset + byte_size)
        except OSError:
            raise InternalError(f"Invalid shared memory region: '{key}'") from None
        finally:
            os.close(fd)
        region = _Region(RegionStatus(name, key, offset, byte_size), memory, memoryview(memory)[offset:])
        with self._lock:
            if name in self._regions:
                _close(region)
                raise AlreadyExistsError(f"shared memory region '{name}' already in manager")
            self._regions[name] = region

    def unregister(self, name: str = "") -> None:
        """Unregister one region, or every region when `name` is empty; an unknown name is no error (Triton)."""
        with self._lock:
            names = [name] if name else list(self._regions)
            regions = [self._regions.pop(n) for n in names if n in self._regions]
        for region in regions:
            _close(region)

    def status(self, name: str = "") -> list[RegionStatus]:
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find system shared memory region: '{name}'")
        return [region.status]

    def read(self, name: str, offset: int, byte_size: int) -> memoryview:
        """A zero-copy view of `byte_size` bytes at `offset` into the registered region `name`."""
        return self._window(name, offset, byte_size)

    def write(self, name: str, offset: int, byte_size: int, output_name: str, data: bytes | memoryview) -> None:
        """Write an output's bytes at `offset`; the client's `byte_size` must hold them (Triton's checks)."""
        window = self._window(name, offset, byte_size)
        size = len(data) if isinstance(data, bytes) else data.nbytes
        if size > byte_size:
            raise InternalError(
                f"shared memory size specified with the request for output '{output_name}' ({byte_size} bytes) "
                f"should be at least {size} bytes to hold the results"
            )
        window[:size] = data

    def close(self) -> None:
        self.unregister()

    def _window(self, name: str, offset: int, byte_size: int) -> memoryview:
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        end = offset + byte_size  # an empty window at 0 is refused too: Triton's unsigned `offset + size - 1` wraps
        if offset < 0 or byte_size < 0 or end > region.status.byte_size or end == 0:
            raise InvalidArgumentError(f"Invalid offset + byte size for shared memory region: '{name}'")
        return region.view[offset : offset + byte_size]


def _close(region: _Region) -> None:
    # A request in flight may still hold a view: then the mapping goes when the last view does.
    with contextlib.suppress(BufferError):
        region.view.release()
        region.memory.close()
