"""Shared memory regions clients register: system ones by key (`/dev/shm/<key>`), CUDA ones by an IPC handle of
device memory; inputs are read from them, outputs written to them.

Protocol-neutral: both frontends resolve a tensor's `shared_memory_region` / `_offset` / `_byte_size` here, with
Triton's messages for each fault; a name is unique across both kinds, as in Triton. Off unless the server runs with
`--allow-system-shared-memory`, because a registered key lets a client make the server map (and write) any shared
memory object the server can open. A CUDA region is read and written by copies between host and device
(geserve.devices.cuda_runtime); on a machine without CUDA registering one gets Triton's answer there.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from geserve.devices.cuda_runtime import CudaIpcRegion, CudaUnavailableError, cuda_usable
from geserve.errors import (
    AlreadyExistsError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnsupportedError,
)

T = TypeVar("T")
SHM_ROOT = Path("/dev/shm")
DISABLED = (
    "system shared memory is disabled on this server; start geserve with --allow-system-shared-memory to use it"
)


# Triton's answer to a CUDA registration where no CUDA device can open the handle.
CUDA_REFUSED = "failed to register shared memory region: invalid args"


class OutputPlacementError(InternalError):
    """An output does not fit the shared memory the request gave it (Triton: found after inference, 500)."""


@dataclass(frozen=True, slots=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class CudaRegionStatus:
    name: str
    device_id: int
    byte_size: int


@dataclass(slots=True)
class _CudaRegion:
    status: CudaRegionStatus
    memory: CudaIpcRegion


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
        self._cuda: dict[str, _CudaRegion] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not self.enabled:
            raise UnsupportedError(DISABLED)
        with self._lock:
            self._check_free(name)
        memory = self._map(key, offset, byte_size)
        region = _Region(RegionStatus(name, key, offset, byte_size), memory, memoryview(memory)[offset:])
        with self._lock:
            if name in self._regions or name in self._cuda:
                _close(region)
            self._check_free(name)
            self._regions[name] = region

    def _map(self, key: str, offset: int, byte_size: int) -> mmap.mmap:
        """The object `key` names under the root, mapped up to the registered window's end."""
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
            return mmap.mmap(fd, offset + byte_size)
        except OSError:
            raise InternalError(f"Invalid shared memory region: '{key}'") from None
        finally:
            os.close(fd)

    def _check_free(self, name: str) -> None:
        if name in self._regions or name in self._cuda:
            raise AlreadyExistsError(f"shared memory region '{name}' already in manager")

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open device memory a client exported (cudaIpcGetMemHandle) on `device_id`."""
        if cuda_usable() is not None:
            raise InvalidArgumentError(CUDA_REFUSED)
        if not self.enabled:
            raise UnsupportedError(DISABLED.replace("system shared memory", "CUDA shared memory"))
        with self._lock:
            self._check_free(name)
        try:
            memory = CudaIpcRegion(raw_handle, device_id, byte_size)
        except CudaUnavailableError as exc:
            raise InvalidArgumentError(f"failed to register CUDA shared memory region '{name}': {exc}") from None
        with self._lock:
            if name in self._regions or name in self._cuda:
                memory.close()
            self._check_free(name)
            self._cuda[name] = _CudaRegion(CudaRegionStatus(name, device_id, byte_size), memory)

    def cuda_status(self, name: str = "") -> list[CudaRegionStatus]:
        with self._lock:
            if not name:
                return [r.status for r in self._cuda.values()]
            region = self._cuda.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find cuda shared memory region: '{name}'")
        return [region.status]

    def unregister_cuda(self, name: str = "") -> None:
        """Unregister one CUDA region, or all of them; an unknown name is no error (Triton)."""
        with self._lock:
            names = [name] if name else list(self._cuda)
            regions = [self._cuda.pop(n) for n in names if n in self._cuda]
        for region in regions:
            region.memory.close()

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
        """A zero-copy view of `byte_size` bytes at `offset` into the registered region `name` (a host copy for a
        CUDA region)."""
        cuda = self._cuda.get(name) if name not in self._regions else None
        if cuda is not None:
            _check_window(name, offset, byte_size, cuda.status.byte_size)
            return _device_call(lambda: cuda.memory.read(offset, byte_size))
        return self._window(name, offset, byte_size)

    def write(self, name: str, offset: int, byte_size: int, output_name: str, data: bytes | memoryview) -> None:
        """Write an output's bytes at `offset`; the client's `byte_size` must hold them (Triton's checks)."""
        cuda = self._cuda.get(name) if name not in self._regions else None
        if cuda is not None:
            _check_window(name, offset, byte_size, cuda.status.byte_size)
        else:
            window = self._window(name, offset, byte_size)
        size = len(data) if isinstance(data, bytes) else data.nbytes
        if size > byte_size:
            raise InternalError(
                f"shared memory size specified with the request for output '{output_name}' ({byte_size} bytes) "
                f"should be at least {size} bytes to hold the results"
            )
        if cuda is not None:
            _device_call(lambda: cuda.memory.write(offset, data))
        else:
            window[:size] = data

    def close(self) -> None:
        self.unregister()
        self.unregister_cuda()

    def _window(self, name: str, offset: int, byte_size: int) -> memoryview:
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        _check_window(name, offset, byte_size, region.status.byte_size)
        return region.view[offset : offset + byte_size]


def _check_window(name: str, offset: int, byte_size: int, size: int) -> None:
    end = offset + byte_size  # an empty window at 0 is refused too: Triton's unsigned `offset + size - 1` wraps
    if offset < 0 or byte_size < 0 or end > size or end == 0:
        raise InvalidArgumentError(f"Invalid offset + byte size for shared memory region: '{name}'")


def _device_call(call: Callable[[], T]) -> T:
    try:
        return call()
    except CudaUnavailableError as exc:
        raise InternalError(str(exc)) from None


def _close(region: _Region) -> None:
    # A request in flight may still hold a view: then the mapping goes when the last view does.
    with contextlib.suppress(BufferError):
        region.view.release()
        region.memory.close()
