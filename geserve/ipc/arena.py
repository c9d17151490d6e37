"""Arrays that cross between two processes through shared memory instead of the socket: a frame carries where an
array lies, the other side views it in place.

Each direction has its own segment (a memfd both processes map), written by one side only: the writer places an
array in a free block (first fit, so the low pages stay the warm ones), the reader views it with no copy, and when
the reader's last reference to that view is gone it tells the writer, which frees the block. Measured on this
2-core VM (bench/python_isolation_bench.py, one array to another process and a tiny answer back): in the frame 16 MiB
took ~22 ms (pickle's copy, the socket's, the receiver's buffer) and 1 MiB 1.5 ms, through the segment 1.9 ms and
0.16 ms (one copy in, none out); at 16-64 KiB both take ~100 µs, so smaller arrays go in the frame.

The segment is sparse: its capacity is address space, and only the pages arrays were written to cost memory; pages
above the highest block still in use are handed back to the kernel once more than `KEEP_BYTES` of them idle.
An array the segment has no room for goes in the frame, never fails.
"""

from __future__ import annotations

import bisect
import copyreg
import io
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

SHARED_FROM_BYTES = 16 * 1024  # smaller arrays travel in the frame (measured: no faster through the segment)
KEEP_BYTES = 64 * 1024 * 1024  # idle pages above the blocks in use kept mapped, so the next large array faults none
DEFAULT_CAPACITY = 1 << 32  # address space per direction; only written pages cost memory
_ALIGN = 64
_PAGE = mmap.PAGESIZE


def create_segment(capacity: int = DEFAULT_CAPACITY, name: str = "geserve-arena") -> int:
    """A new sparse memfd of `capacity` bytes, inheritable by a child (pass_fds): its file descriptor."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, capacity)
    return fd


def _align(size: int, to: int = _ALIGN) -> int:
    return (size + to - 1) // to * to


class Segment:
    """One memfd mapped into this process (the mapping keeps its own descriptor: `fd` may be closed after)."""

    def __init__(self, fd: int) -> None:
        status = os.fstat(fd)
        self.capacity, self.inode = status.st_size, status.st_ino
        self._map = mmap.mmap(fd, self.capacity)
        self.view = memoryview(self._map)

    def discard(self, start: int, end: int) -> None:
        """Hand the whole pages of [start, end) back to the kernel (they read as zeros after)."""
        start, end = _align(start, _PAGE), end // _PAGE * _PAGE
        if end > start:
            self._map.madvise(mmap.MADV_REMOVE, start, end - start)


class ArenaWriter:
    """Places arrays in a segment this side alone writes; `free` gives their blocks back (the reader is done)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.inode = segment.inode
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, segment.capacity)]  # (offset, size), by offset, coalesced
        self._used: dict[int, int] = {}  # offset -> size
        self._touched = 0  # end of the highest page written since it was last handed back

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def place(self, array: np.ndarray) -> int | None:
        """Copy `array` (C order) into a free block: its offset, or None when no block is large enough."""
        offset = self._allocate(_align(array.nbytes))
        if offset is None:
            return None
        target = np.frombuffer(self._segment.view[offset:offset + array.nbytes], dtype=array.dtype)
        np.copyto(target.reshape(array.shape), array, casting="no")
        return offset

    def _allocate(self, size: int) -> int | None:
        with self._lock:
            for index, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + size, free - size)
                    self._used[offset] = size
                    self._touched = max(self._touched, offset + size)
                    return offset
        return None

    def free(self, offsets: list[int]) -> None:
        with self._lock:
            for offset in offsets:
                size = self._used.pop(offset, None)
                if size is not None:
                    self._insert(offset, size)
            self._trim()

    def _insert(self, offset: int, size: int) -> None:
        index = bisect.bisect(self._free, (offset, size))
        if index < len(self._free) and offset + size == self._free[index][0]:  # joins the next free block
            size += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == offset:  # and the previous one
            offset, previous = self._free[index - 1]
            self._free[index - 1] = (offset, previous + size)
        else:
            self._free.insert(index, (offset, size))

    def _trim(self) -> None:
        """Pages more than KEEP_BYTES above the highest block in use go back to the kernel."""
        top = max((offset + size for offset, size in self._used.items()), default=0)
        if self._touched - top > KEEP_BYTES:
            self._segment.discard(top + KEEP_BYTES, self._touched)
            self._touched = top + KEEP_BYTES


class ArenaReader:
    """Views the arrays the other side placed; `released` hears each block once nothing here references it."""

    def __init__(self, segment: Segment, released: Callable[[int], None]) -> None:
        self._segment = segment
        self.inode = segment.inode
        self._released = released

    def view(self, offset: int, nbytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        root = np.frombuffer(self._segment.view[offset:offset + nbytes], dtype=dtype)
        root.flags.writeable = False  # as an input viewed out of a request body: the block is the writer's
        weakref.finalize(root, self._released, offset)  # views of it (reshape, slices) keep it alive
        return root.reshape(shape)


# The readers of this process, by their segment's inode (the same in both processes): an array placed in a segment
# is rebuilt, by plain unpickling, as a view through the reader of that segment.
_READERS: weakref.WeakValueDictionary[int, ArenaReader] = weakref.WeakValueDictionary()


def _placed(inode: int, offset: int, nbytes: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
    reader = _READERS.get(inode)
    if reader is None:
        raise pickle.UnpicklingError("an array lies in a shared memory segment this process does not read")
    return reader.view(offset, nbytes, dtype, shape)


class SharedArrayCodec:
    """A Peer codec (ipc/peer.py) that sends large arrays through `writer`'s segment and views the other side's
    through `reader`. Either may be None (that direction then uses the frame alone). Only arrays reach Python code
    while pickling (a dispatch table entry): every other object pickles at C speed, errors as themselves."""

    def __init__(self, writer: ArenaWriter | None, reader: ArenaReader | None) -> None:
        self.writer = writer
        self.reader = reader  # the registry below holds it weakly
        if reader is not None:
            _READERS[reader.inode] = reader
        self._table = {**copyreg.dispatch_table, np.ndarray: self._reduce_array}

    def _reduce_array(self, array: np.ndarray) -> Any:
        writer = self.writer
        if writer is not None and array.nbytes >= SHARED_FROM_BYTES and not array.dtype.hasobject:
            offset = writer.place(array)
            if offset is not None:
                return _placed, (writer.inode, offset, array.nbytes, array.dtype, array.shape)
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    def dumps(self, message: tuple[Any, ...]) -> bytes:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = self._table
        pickler.dump(message)
        return buffer.getvalue()

    def loads(self, data: bytes) -> tuple[Any, ...]:
        result: tuple[Any, ...] = pickle.loads(data)
        return result
