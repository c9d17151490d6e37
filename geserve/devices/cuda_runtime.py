"""The CUDA runtime through cuda-python (import-guarded): device count, and device memory a client shares by a CUDA
IPC handle (Triton's CUDA shared memory), opened, read, written and closed.

cuda-python 12.6+ names the runtime `cuda.bindings.runtime`; older releases (which tritonclient 2.41's cudashm
imports) `cuda.cudart`. Either is used. Without the package or a driver, nothing here raises at import.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from types import ModuleType
from typing import Any

import numpy as np

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class CudaUnavailableError(Exception):
    """The CUDA runtime cannot be used here; the message says what is missing."""


@functools.cache
def _runtime() -> ModuleType | str:
    """The runtime module, or why there is none."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart

        return cudart
    except ImportError:
        return "the cuda-python package is not installed (pip install 'geserve[cuda]')"


def runtime() -> ModuleType:
    found = _runtime()
    if isinstance(found, str):
        raise CudaUnavailableError(found)
    return found


def _check(result: Any, what: str) -> Any:
    """cuda-python returns (error, *values); raise on an error, else the value(s)."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        name = getattr(error, "name", str(error))
        raise CudaUnavailableError(f"{what} failed: {name}")
    return values[0] if len(values) == 1 else tuple(values)


def device_count() -> int | None:
    """How many CUDA devices this process sees; None without cuda-python or a working driver."""
    try:
        return int(_check(runtime().cudaGetDeviceCount(), "cudaGetDeviceCount"))
    except (CudaUnavailableError, RuntimeError, OSError):
        return None


def cuda_usable() -> str | None:
    """None when CUDA memory can be used here, else why not."""
    try:
        count = int(_check(runtime().cudaGetDeviceCount(), "cudaGetDeviceCount"))
    except (CudaUnavailableError, RuntimeError, OSError) as exc:
        return str(exc)
    return None if count > 0 else "no CUDA device is visible"


def write_handle(handle: Any, raw: bytes) -> None:
    """Fill a cudaIpcMemHandle_t: cuda-python 12 exposes its `reserved` bytes, 13 only the struct's address."""
    if hasattr(handle, "reserved"):
        handle.reserved = raw
    else:
        ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)


def read_handle(handle: Any) -> bytes:
    """The 64 bytes of a cudaIpcMemHandle_t (what tritonclient's cudashm.get_raw_handle base64-encodes)."""
    if hasattr(handle, "reserved"):
        return bytes(handle.reserved)
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


class CudaIpcRegion:
    """Device memory another process exported with cudaIpcGetMemHandle, opened in this one.

    Reads and writes copy between host and device (cudaMemcpy on the region's device); one lock keeps a copy and
    the close apart."""

    def __init__(self, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        rt = runtime()
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise CudaUnavailableError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(raw_handle)}")
        self.device_id = device_id
        self.byte_size = byte_size
        self._rt = rt
        self._lock = threading.Lock()
        _check(rt.cudaSetDevice(device_id), "cudaSetDevice")
        handle = rt.cudaIpcMemHandle_t()
        write_handle(handle, raw_handle)
        self._pointer: int | None = int(
            _check(rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle")
        )

    def read(self, offset: int, byte_size: int) -> memoryview:
        """A host copy of `byte_size` bytes at `offset`."""
        host = np.empty(byte_size, np.uint8)
        self._copy(host.ctypes.data, offset, byte_size, to_device=False)
        return host.data

    def write(self, offset: int, data: bytes | memoryview) -> None:
        source = np.frombuffer(data, np.uint8)
        self._copy(source.ctypes.data, offset, source.nbytes, to_device=True)

    def close(self) -> None:
        with self._lock:
            if self._pointer is not None:
                self._rt.cudaIpcCloseMemHandle(self._pointer)
                self._pointer = None

    def _copy(self, host: int, offset: int, size: int, *, to_device: bool) -> None:
        rt = self._rt
        with self._lock:
            if self._pointer is None:
                raise CudaUnavailableError("the CUDA shared memory region was unregistered")
            _check(rt.cudaSetDevice(self.device_id), "cudaSetDevice")
            device = self._pointer + offset
            if to_device:
                _check(rt.cudaMemcpy(device, host, size, rt.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy")
            else:
                _check(rt.cudaMemcpy(host, device, size, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost), "cudaMemcpy")
