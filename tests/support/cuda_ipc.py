"""Device memory a test shares with the server as Triton's clients do (cudaMalloc + cudaIpcGetMemHandle), through
cuda-python's runtime bindings directly: tritonclient 2.41's cudashm imports `cuda.cudart`, which cuda-python 13
no longer has."""

from __future__ import annotations

import base64

import numpy as np

from geserve.devices.cuda_runtime import _check, read_handle, runtime


class DeviceBuffer:
    def __init__(self, byte_size: int, device_id: int = 0) -> None:
        rt = runtime()
        self._rt = rt
        self.byte_size = byte_size
        self.device_id = device_id
        _check(rt.cudaSetDevice(device_id), "cudaSetDevice")
        self.pointer = int(_check(rt.cudaMalloc(byte_size), "cudaMalloc"))
        handle = _check(rt.cudaIpcGetMemHandle(self.pointer), "cudaIpcGetMemHandle")
        self.raw_handle: bytes = read_handle(handle)

    @property
    def raw_handle_b64(self) -> bytes:
        """What tritonclient's register_cuda_shared_memory takes (cudashm.get_raw_handle's form)."""
        return base64.b64encode(self.raw_handle)

    def write(self, array: np.ndarray, offset: int = 0) -> None:
        data = np.ascontiguousarray(array)
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        _check(self._rt.cudaMemcpy(self.pointer + offset, data.ctypes.data, data.nbytes, kind), "cudaMemcpy")

    def read(self, dtype: np.dtype, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
        host = np.empty(shape, dtype)
        kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check(self._rt.cudaMemcpy(host.ctypes.data, self.pointer + offset, host.nbytes, kind), "cudaMemcpy")
        return host

    def free(self) -> None:
        self._rt.cudaFree(self.pointer)
