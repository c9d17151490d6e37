"""CUDA shared-memory regions in the registry both frontends use: registration, one name space with system regions,
windows, reads and writes, status and unregistration. No CUDA device exists here, so the device memory is a stand-in
(a bytearray behind CudaIpcRegion's interface); on a GPU, tests/test_devices_gpu.py does the same through real IPC
handles and both protocols. The refusal on a machine without CUDA is Triton's (tests/test_http_shared_memory.py and
tests/test_grpc_client.py check it on real servers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from geserve.errors import AlreadyExistsError, InternalError, InvalidArgumentError, NotFoundError, UnsupportedError
from geserve.service import shared_memory
from geserve.service.shared_memory import CUDA_REFUSED, CudaRegionStatus, SharedMemoryRegistry


class _DeviceMemory:
    opened: list[_DeviceMemory] = []

    def __init__(self, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.data = bytearray(byte_size)
        self.closed = False
        _DeviceMemory.opened.append(self)

    def read(self, offset: int, byte_size: int) -> memoryview:
        return memoryview(bytes(self.data[offset : offset + byte_size]))

    def write(self, offset: int, data: bytes | memoryview) -> None:
        raw = bytes(data)
        self.data[offset : offset + len(raw)] = raw

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SharedMemoryRegistry:
    monkeypatch.setattr(shared_memory, "cuda_usable", lambda: None)
    monkeypatch.setattr(shared_memory, "CudaIpcRegion", _DeviceMemory)
    _DeviceMemory.opened.clear()
    return SharedMemoryRegistry(True, root=tmp_path)


def test_register_read_write_status_unregister(registry: SharedMemoryRegistry) -> None:
    registry.register_cuda("gpu", bytes(64), 0, 64)
    assert registry.cuda_status() == [CudaRegionStatus("gpu", 0, 64)]
    assert registry.status() == []  # system regions are listed apart
    values = np.arange(4, dtype=np.float32)
    registry.write("gpu", 16, 16, "out", values.tobytes())
    np.testing.assert_array_equal(np.frombuffer(registry.read("gpu", 16, 16), np.float32), values)
    with pytest.raises(InternalError, match="should be at least 16 bytes"):
        registry.write("gpu", 0, 8, "out", values.tobytes())
    with pytest.raises(InvalidArgumentError, match=r"Invalid offset \+ byte size"):
        registry.read("gpu", 60, 8)
    registry.unregister_cuda("gpu")
    assert registry.cuda_status() == [] and _DeviceMemory.opened[0].closed
    with pytest.raises(NotFoundError, match="Unable to find cuda shared memory region: 'gpu'"):
        registry.cuda_status("gpu")
    registry.unregister_cuda("never-registered")  # no error, as in Triton


def test_names_are_unique_across_system_and_cuda_regions(registry: SharedMemoryRegistry, tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(bytes(32))
    registry.register("both", "/key", 0, 32)
    with pytest.raises(AlreadyExistsError, match="shared memory region 'both' already in manager"):
        registry.register_cuda("both", bytes(64), 0, 32)
    registry.register_cuda("gpu", bytes(64), 0, 32)
    with pytest.raises(AlreadyExistsError, match="'gpu' already in manager"):
        registry.register("gpu", "/key", 0, 32)
    registry.close()
    assert registry.status() == [] and registry.cuda_status() == []


def test_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shared_memory, "CudaIpcRegion", _DeviceMemory)
    monkeypatch.setattr(shared_memory, "cuda_usable", lambda: "no CUDA device is visible")
    with pytest.raises(InvalidArgumentError, match=CUDA_REFUSED):
        SharedMemoryRegistry(True, root=tmp_path).register_cuda("gpu", bytes(64), 0, 8)
    monkeypatch.setattr(shared_memory, "cuda_usable", lambda: None)
    with pytest.raises(UnsupportedError, match=r"CUDA shared memory is disabled.*--allow-system-shared-memory"):
        SharedMemoryRegistry(False, root=tmp_path).register_cuda("gpu", bytes(64), 0, 8)
