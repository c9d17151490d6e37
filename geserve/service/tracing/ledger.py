"""What the worker processes of one server (--workers) share for tracing, so that they trace as one server: the trace
ids, the `<file>.<index>` numbers, whether the trace file was started, and the traces left to take (`trace_count`).

A few int64 cells. In one process they are plain integers; a worker maps them from a file in the supervisor's private
folder (fresh each server run, so a restarted worker finds the server's values) and takes `flock` for each
read-modify-write. A worker pays that lock (two system calls, ~4 µs measured) for a traced request's id and, under
a `trace_count`, its count, never for a request that is not traced: the traces left are read from the map unlocked.

Counts are cells numbered in the order the settings create them: every worker applies the same trace setting
changes in the same order (the supervisor runs them on all and replays them to a worker that joins), so the n-th
count of each worker is the same cell. A cell is set when it is first created and kept when a restarted worker
creates it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_CELL = struct.Struct("=q")
_SIZE = 64 * 1024  # 8192 cells
_LAST_ID, _LAST_INDEX, _STARTED, _FIRST_COUNT = 0, 1, 2, 3
_UNSET = 0  # a count cell holds its value + 2 (values are >= -1), so 0 is a cell no worker has set


class _LocalCells:
    """One process's cells."""

    def __init__(self) -> None:
        self._cells: dict[int, int] = {}
        self.capacity = 1 << 62

    def get(self, cell: int) -> int:
        return self._cells.get(cell, 0)

    def set(self, cell: int, value: int) -> None:
        self._cells[cell] = value

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _SharedCells:
    """Cells in a file every worker maps (`path`, created by the first)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        with self.locked():
            if os.fstat(self._fd).st_size < _SIZE:
                os.ftruncate(self._fd, _SIZE)  # zeros: every cell unset
        self._map = mmap.mmap(self._fd, _SIZE)
        self.capacity = _SIZE // _CELL.size

    def get(self, cell: int) -> int:
        return int(_CELL.unpack_from(self._map, cell * _CELL.size)[0])

    def set(self, cell: int, value: int) -> None:
        _CELL.pack_into(self._map, cell * _CELL.size, value)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


class Remaining:
    """Traces left to take (-1: no end), in a cell of the ledger. A model without a `trace_count` of its own shares
    the global one, as in Triton: its traces count down the server's."""

    __slots__ = ("_cell", "_cells")

    def __init__(self, cells: _LocalCells | _SharedCells, cell: int) -> None:
        self._cells, self._cell = cells, cell

    @property
    def left(self) -> int:
        return self._cells.get(self._cell) - 2

    def take(self) -> bool:
        """One trace taken: False when none was left."""
        cells = self._cells
        if cells.get(self._cell) == 1:  # -1: no end, nothing to count
            return True
        with cells.locked():
            stored = cells.get(self._cell)
            if stored == 2:
                return False
            if stored > 2:
                cells.set(self._cell, stored - 1)
        return True


class Ledger:
    """The cells of one server's tracing: in this process (`path` None) or shared by its workers."""

    def __init__(self, path: str | None = None) -> None:
        self._cells: _LocalCells | _SharedCells = _LocalCells() if path is None else _SharedCells(path)
        self._next_count = _FIRST_COUNT
        self._started = False

    def next_id(self) -> int:
        """A new trace's id: the server's traces are numbered from 1, as Triton numbers them."""
        return self._next(_LAST_ID)

    def next_index(self) -> int:
        """The next `<file>.<index>` (from 0)."""
        return self._next(_LAST_INDEX) - 1

    def start_file(self) -> bool:
        """True the first time any worker of this server writes the trace file (it then truncates what an earlier
        run left there)."""
        if self._started:
            return False
        cells = self._cells
        with cells.locked():
            first = cells.get(_STARTED) == 0
            cells.set(_STARTED, 1)
        self._started = True
        return first

    def remaining(self, count: int) -> Remaining:
        """The count cell of the next setting that sets `trace_count`: `count` unless a worker set it before."""
        cell = self._next_count
        self._next_count += 1
        cells = self._cells
        if cell >= cells.capacity:  # thousands of count changes: this worker counts alone from here
            logger.warning("trace counts beyond %d changes are counted per worker", cells.capacity - _FIRST_COUNT)
            cells, cell = _LocalCells(), 0
        with cells.locked():
            if cells.get(cell) == _UNSET:
                cells.set(cell, count + 2)
        return Remaining(cells, cell)

    def _next(self, cell: int) -> int:
        cells = self._cells
        with cells.locked():
            value = cells.get(cell) + 1
            cells.set(cell, value)
        return value
