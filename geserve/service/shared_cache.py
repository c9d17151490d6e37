"""The response cache of a server of several workers (`--workers N` with `--cache-config local,size=<bytes>`): one
cache for the whole server, as Triton's local cache is one for its one process. A response cached by any worker is
a hit on every worker, `size` bounds the server's entries together, and the least recently used entry of the
server goes first. A single process keeps the in-process cache (response_cache.py), whose hit path this does not
touch.

Design: a hash table and its entries in one shared memory segment that every worker maps, changed under `flock`.
The supervisor creates the segment (`memfd_create`: no name in /dev/shm, not bound by a container's small /dev/shm,
freed with the last process that holds it) and hands it to each worker it starts, as it hands the connections'
socket pair; a restarted worker maps the same segment and finds the server's entries. A worker looks up, stores and
evicts entries itself, in its event loop, holding the lock only while it walks the table and copies the entry's
bytes; hashing the request and decoding the answer happen outside it. A hit costs what one process's does plus two
system calls (the lock), one copy of the answer's bytes out of the segment and the arrays made over that copy: the
supervisor is never asked. Measured with two workers on a 2-vCPU machine (bench/shared_cache_bench.py), the server's
time per hit of a small answer went from 21-26 us with each worker's own cache to 32-45 us, that of a 602 KB answer
from 404-452 us to 432-533 us (the copy). Why not a cache in the supervisor, asked over the workers' control
socket: a hit would then cost a round trip through another process's event loop, the one that also hands out every
connection (even the floor of a hop to another process in Python is 28 + 30 us of CPU: docs/design.md), and each
answer would be pickled and copied twice on the way.

Segment. A header (sizes, the LRU list's ends, the server-wide counts, the free lists' heads), the buckets (entry
offsets, chained through the entries), and the arena: runs of 64-byte units, each a free run or one entry, with its
size at both ends (boundary tags) so that a freed entry merges with free neighbours at once. Free runs are kept in
lists by size class (powers of two of units); an entry takes the first run of its class that fits, else the head of
a larger class, and gives back what it does not use. An entry holds its key (the request's SHA-256), its links in
the LRU list and its bucket's chain, what it counts against `size`, and its answer: the response parameters and the
outputs' names, datatypes, shapes, dtypes and parameters pickled, then each output's bytes as they are (an array is
copied once into the segment and once out, never pickled; BYTES arrays, of Python objects, are pickled whole). A
hit's arrays are views of its own copy, read-only as the in-process cache's are. Pickle from the segment is as
trusted as the workers' control socket: only the server's own processes map it.

Size. An entry counts what it would count in one process (its outputs' bytes plus fixed overheads: `entry_size`),
or the units it takes in the arena if that is more (answers with large parameters); the arena has `size` bytes, so
whatever the counts allow always fits once enough entries have gone. An entry takes one contiguous run: when the
free space is split into runs each too small, less recently used entries go until one is large enough (entries of
one model are mostly the same size, so the run an evicted entry leaves usually fits the next).

Loads. The key covers the model's load, so that a model loaded again never answers from the one it replaced. A
load's own number (`LoadedModel.response_cache`) is one process's, so the shared key uses the server's instead: the
number the supervisor gives each control call, which every worker runs (and a restarted worker replays with the
same number), given to the loads that call made; the loads a worker made at its start get 0, as the repository was
at the server's start. The worker's link tells the cache when a control call starts and ends (workers/link.py). A
load the cache cannot place (none should exist) gets a key of this process's alone: correct, only not shared.

Counts. The per-model statistics (`cache_hit`, `cache_miss`) and the `nv_cache_*` metrics are counted by the worker
that answered the request, once, and the supervisor adds up the workers' (statistics.merge_statistics,
workers/metrics_merge.py), so each lookup is counted once for the server. The segment also keeps the server's own
hits, misses and evictions (`SharedTable.counts`).

Failures. A worker that dies while it holds the lock (the kernel releases the lock) leaves its mark in the header:
the next worker to take the lock finds it and empties the cache rather than trust a half-changed table.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import pickle
import struct
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from geserve.repository.model import LoadedModel
from geserve.service.response_cache import Execute, ResponseCache, entry_size, request_key_async
from geserve.types import InferenceRequest, InferenceResponse, OutputTensor

logger = logging.getLogger(__name__)

UNIT = 64  # bytes: the arena's unit, and the alignment of every run
_MAGIC = 0x3161_6863_6567  # "gecha1", little-endian: a segment of this layout
_HEADER = 4096
_BINS = 48  # free lists by size class: runs of 2**k .. 2**(k+1) - 1 units
_FIRST_FIT_STEPS = 16  # runs of an entry's own class tried before a larger class's first

# Header cells (8 bytes each).
_H_MAGIC, _H_CAPACITY, _H_USED, _H_ENTRIES, _H_HITS, _H_MISSES, _H_EVICTIONS = range(7)
_H_LRU_HEAD, _H_LRU_TAIL, _H_BUSY, _H_BUCKETS, _H_ARENA, _H_END, _H_RESETS = range(7, 14)
_H_BINS = 16

# A run: its size (bytes, a multiple of UNIT) with the low bit set while it holds an entry, in its first and last
# cells. A free run links its size class's list in its 2nd and 3rd cells; an entry's fields follow its first cell.
_USED = 1
_R_NEXT_FREE, _R_PREV_FREE = 1, 2
_E_KEY = 8  # byte offset of the 32-byte key
# An entry's cells after its key: its LRU neighbours (more and less recently used), the next entry of its bucket,
# what it counts against the cache's size, and its answer's length.
_E_MORE, _E_LESS, _E_CHAIN, _E_COUNT, _E_LENGTH = 5, 6, 7, 8, 9
_E_DATA = 80  # byte offset of the answer
_KEY_BYTES = 32

_BLOB_HEAD = struct.Struct("<Q")  # an answer's first part: the length of its pickle
_ALIGN = 16  # the buffers' alignment in an answer


def segment_bytes(capacity: int) -> int:
    """The segment a cache of `capacity` bytes takes: header, buckets and arena."""
    return _HEADER + _bucket_count(capacity) * 8 + _round_up(capacity, UNIT)


def create_segment(capacity: int) -> int:
    """A new, empty segment for a server whose cache holds `capacity` bytes: its file descriptor (close-on-exec;
    hand it to a worker with `pass_fds`). Its memory is taken as entries fill it."""
    fd = os.memfd_create("geserve-response-cache", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, segment_bytes(capacity))
        with mmap.mmap(fd, segment_bytes(capacity)) as memory:
            cells = memoryview(memory).cast("Q")
            try:
                _initialize(cells, capacity, zeroed=True)  # a new memfd reads as zeros
            finally:
                cells.release()
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bucket_count(capacity: int) -> int:
    """A power of two near one bucket per 2 KiB of cache (chains stay short for answers of a few hundred bytes)."""
    wanted = min(max(capacity // 2048, 1024), 1 << 24)
    return 1 << (wanted - 1).bit_length()


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _initialize(cells: memoryview, capacity: int, zeroed: bool = False) -> None:
    """An empty cache: no entries (empty buckets, unless `zeroed` says they are), the whole arena one free run."""
    buckets = _bucket_count(capacity)
    arena = _HEADER + buckets * 8
    end = arena + _round_up(capacity, UNIT)
    if not zeroed:
        zeros = memoryview(bytes(8 * 65536)).cast("Q")
        for cell in range(_HEADER // 8, arena // 8, len(zeros)):
            cells[cell: min(cell + len(zeros), arena // 8)] = zeros[: min(len(zeros), arena // 8 - cell)]
    for cell in range(_H_BINS + _BINS):
        cells[cell] = 0
    for cell, value in ((_H_CAPACITY, capacity), (_H_USED, 0), (_H_ENTRIES, 0), (_H_LRU_HEAD, 0), (_H_LRU_TAIL, 0),
                        (_H_BUCKETS, buckets), (_H_ARENA, arena), (_H_END, end)):
        cells[cell] = value
    _free_run(cells, arena, end - arena)
    cells[_H_MAGIC] = _MAGIC


def _free_run(cells: memoryview, offset: int, size: int) -> None:
    """Mark [offset, offset + size) a free run and put it at the head of its class's list."""
    cells[offset >> 3] = size
    cells[(offset + size - 8) >> 3] = size
    head = _H_BINS + _size_class(size)
    first = cells[head]
    cells[(offset >> 3) + _R_NEXT_FREE] = first
    cells[(offset >> 3) + _R_PREV_FREE] = 0
    if first:
        cells[(first >> 3) + _R_PREV_FREE] = offset
    cells[head] = offset


def _size_class(size: int) -> int:
    return min((size // UNIT).bit_length() - 1, _BINS - 1)


class SharedTable:
    """One worker's view of the server's cache segment (`fd`, from `create_segment`): key -> answer bytes, least
    recently used first out. Every method takes the lock; none may be called from two threads of one process."""

    def __init__(self, fd: int) -> None:
        # A description of our own (the inherited one is the supervisor's and every worker's): flock locks
        # descriptions, so each process must lock its own.
        self._fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            self._memory = mmap.mmap(self._fd, os.fstat(self._fd).st_size)
        except BaseException:
            os.close(self._fd)
            raise
        self._bytes = memoryview(self._memory)
        self._cells = self._bytes.cast("Q")
        if self._cells[_H_MAGIC] != _MAGIC:
            self.close()
            raise ValueError("not a response cache segment")
        self.capacity = self._cells[_H_CAPACITY]
        self._mask = self._cells[_H_BUCKETS] - 1
        self._pid = os.getpid()

    def close(self) -> None:
        self._cells.release()
        self._bytes.release()
        self._memory.close()
        os.close(self._fd)

    # ---- the server's figures --------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """The server's entries, bytes counted, hits, misses, evictions, and the times the cache was emptied after a
        worker died holding it."""
        with self._locked():
            cells = self._cells
            return {"entries": cells[_H_ENTRIES], "used": cells[_H_USED], "hits": cells[_H_HITS],
                    "misses": cells[_H_MISSES], "evictions": cells[_H_EVICTIONS], "resets": cells[_H_RESETS]}

    def __len__(self) -> int:
        return self.counts()["entries"]

    def __contains__(self, key: bytes) -> bool:
        with self._locked():
            return self._find(key) != 0

    # ---- lookup and store ------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> bytes | None:
        """A copy of the answer stored under `key` (now the server's most recently used), or None."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # `_locked`, written out: this is a hit's path
        try:
            self._enter()
            cells = self._cells
            entry = self._find(key)
            if not entry:
                cells[_H_MISSES] += 1
                cells[_H_BUSY] = 0
                return None
            cells[_H_HITS] += 1
            self._to_front(entry)
            start = entry + _E_DATA
            answer = self._bytes[start: start + cells[(entry >> 3) + _E_LENGTH]].tobytes()
            cells[_H_BUSY] = 0
            return answer
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def insert(self, key: bytes, parts: list[memoryview], count: int) -> bool:
        """Store the answer made of `parts` (each 16-byte aligned after the one before) under `key`, counting
        `count` bytes or its run's if more; evict the least recently used entries as needed. False when it is larger
        than the whole cache (then nothing changes)."""
        if len(key) != _KEY_BYTES:
            raise ValueError(f"a response cache key has {_KEY_BYTES} bytes, not {len(key)}")
        length = _parts_length(parts)
        run = _round_up(_E_DATA + length + 8, UNIT)
        count = max(count, run)
        if count > self.capacity:
            return False
        with self._locked():
            cells = self._cells
            old = self._find(key)
            if old:  # two identical requests that both missed: the later answer stays
                self._remove(old)
            while cells[_H_USED] + count > self.capacity:
                self._evict()
            entry = self._allocate(run)
            while not entry:  # enough bytes are free, but in no run large enough
                self._evict()
                entry = self._allocate(run)
            self._write(entry, key, parts, count, length)
            return True

    def clear(self) -> None:
        with self._locked():
            self._reset(failed=False)

    # ---- the lock ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The table, for this process alone. A process marks the header while it holds the lock and clears the mark
        when done: a mark found on taking the lock is a holder's that died (or failed) midway."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            self._enter()
            yield
            self._cells[_H_BUSY] = 0  # not on an error: the next holder empties the table
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _enter(self) -> None:
        """Holding the lock: mark the table as being changed, after emptying it if a holder left it so."""
        cells = self._cells
        if cells[_H_BUSY]:
            logger.warning("the response cache was left half-changed by process %d: emptied", cells[_H_BUSY])
            self._reset()
        cells[_H_BUSY] = self._pid

    def _reset(self, failed: bool = True) -> None:
        cells = self._cells
        counts = (cells[_H_HITS], cells[_H_MISSES], cells[_H_EVICTIONS], cells[_H_RESETS] + failed)
        _initialize(cells, self.capacity)
        cells[_H_HITS], cells[_H_MISSES], cells[_H_EVICTIONS], cells[_H_RESETS] = counts

    # ---- entries ----------------------------------------------------------------------------------------

    def _bucket(self, key: bytes) -> int:
        """The cell of `key`'s bucket."""
        return (_HEADER >> 3) + (int.from_bytes(key[:8], "little") & self._mask)

    def _find(self, key: bytes) -> int:
        cells, data = self._cells, self._bytes
        entry = cells[self._bucket(key)]
        while entry and data[entry + _E_KEY: entry + _E_KEY + _KEY_BYTES] != key:
            entry = cells[(entry >> 3) + _E_CHAIN]
        return entry

    def _write(self, entry: int, key: bytes, parts: list[memoryview], count: int, length: int) -> None:
        cells, data = self._cells, self._bytes
        base = entry >> 3
        data[entry + _E_KEY: entry + _E_KEY + _KEY_BYTES] = key
        position = entry + _E_DATA
        for part in parts:
            position = _round_up(position, _ALIGN)
            data[position: position + part.nbytes] = part
            position += part.nbytes
        cells[base + _E_COUNT], cells[base + _E_LENGTH] = count, length
        bucket = self._bucket(key)
        cells[base + _E_CHAIN] = cells[bucket]
        cells[bucket] = entry
        head = cells[_H_LRU_HEAD]
        cells[base + _E_MORE], cells[base + _E_LESS] = 0, head
        if head:
            cells[(head >> 3) + _E_MORE] = entry
        else:
            cells[_H_LRU_TAIL] = entry
        cells[_H_LRU_HEAD] = entry
        cells[_H_USED] += count
        cells[_H_ENTRIES] += 1

    def _to_front(self, entry: int) -> None:
        cells = self._cells
        if cells[_H_LRU_HEAD] == entry:
            return
        self._unlink_lru(entry)
        head = cells[_H_LRU_HEAD]
        cells[(entry >> 3) + _E_MORE], cells[(entry >> 3) + _E_LESS] = 0, head
        cells[(head >> 3) + _E_MORE] = entry  # not empty: `entry` was in it and was not its head
        cells[_H_LRU_HEAD] = entry

    def _unlink_lru(self, entry: int) -> None:
        cells = self._cells
        more, less = cells[(entry >> 3) + _E_MORE], cells[(entry >> 3) + _E_LESS]
        if more:
            cells[(more >> 3) + _E_LESS] = less
        else:
            cells[_H_LRU_HEAD] = less
        if less:
            cells[(less >> 3) + _E_MORE] = more
        else:
            cells[_H_LRU_TAIL] = more

    def _evict(self) -> None:
        """Remove the server's least recently used entry (there is one: the caller needs room the entries take)."""
        tail = self._cells[_H_LRU_TAIL]
        if not tail:
            raise RuntimeError("response cache: no entry left to evict")  # a broken table: the next holder empties it
        self._remove(tail)
        self._cells[_H_EVICTIONS] += 1

    def _remove(self, entry: int) -> None:
        cells = self._cells
        base = entry >> 3
        self._unlink_lru(entry)
        link = self._bucket(self._bytes[entry + _E_KEY: entry + _E_KEY + 8].tobytes())
        while cells[link] != entry:
            link = (cells[link] >> 3) + _E_CHAIN
        cells[link] = cells[base + _E_CHAIN]
        cells[_H_USED] -= cells[base + _E_COUNT]
        cells[_H_ENTRIES] -= 1
        self._release(entry, cells[base] & ~_USED)

    # ---- the arena --------------------------------------------------------------------------------------

    def _allocate(self, size: int) -> int:
        """A run of `size` bytes taken from the free runs (the rest of the run it came from stays free), or 0."""
        cells = self._cells
        size_class = _size_class(size)
        run, steps = cells[_H_BINS + size_class], 0
        while run and cells[run >> 3] < size and steps < _FIRST_FIT_STEPS:
            run, steps = cells[(run >> 3) + _R_NEXT_FREE], steps + 1
        if not run or cells[run >> 3] < size:
            run = next((cells[_H_BINS + c] for c in range(size_class + 1, _BINS) if cells[_H_BINS + c]), 0)
            if not run:
                return 0
        whole = cells[run >> 3]
        self._unlink_free(run, whole)
        if whole > size:
            _free_run(cells, run + size, whole - size)
        cells[run >> 3] = size | _USED
        cells[(run + size - 8) >> 3] = size | _USED
        return run

    def _release(self, run: int, size: int) -> None:
        """Free a run, merged with the free runs on either side."""
        cells = self._cells
        after = run + size
        if after < cells[_H_END] and not cells[after >> 3] & _USED:
            following = cells[after >> 3]
            self._unlink_free(after, following)
            size += following
        if run > cells[_H_ARENA] and not cells[(run - 8) >> 3] & _USED:
            preceding = cells[(run - 8) >> 3]
            self._unlink_free(run - preceding, preceding)
            run, size = run - preceding, size + preceding
        _free_run(cells, run, size)

    def _unlink_free(self, run: int, size: int) -> None:
        cells = self._cells
        following, preceding = cells[(run >> 3) + _R_NEXT_FREE], cells[(run >> 3) + _R_PREV_FREE]
        if preceding:
            cells[(preceding >> 3) + _R_NEXT_FREE] = following
        else:
            cells[_H_BINS + _size_class(size)] = following
        if following:
            cells[(following >> 3) + _R_PREV_FREE] = preceding


# ---- answers as bytes ----------------------------------------------------------------------------------------


def encode(outputs: Iterable[OutputTensor], parameters: dict[str, Any]) -> list[memoryview]:
    """An answer as parts for `SharedTable.insert`: the length of the pickle that follows, the pickle of everything
    but the arrays' bytes, then each array's bytes (BYTES arrays, of Python objects, are pickled whole instead)."""
    tensors: list[tuple[Any, ...]] = []
    raw: list[memoryview] = []
    for output in outputs:
        data = np.asarray(output.data)
        if data.dtype == object:
            tensors.append((output.name, output.datatype, tuple(output.shape), dict(output.parameters), None, data))
            continue
        code = data.dtype.str if np.dtype(data.dtype.str) == data.dtype else data.dtype  # bfloat16's str is '<V2'
        tensors.append((output.name, output.datatype, tuple(output.shape), dict(output.parameters), code, data.shape))
        raw.append(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    meta = pickle.dumps((tensors, dict(parameters)), protocol=pickle.HIGHEST_PROTOCOL)
    return [memoryview(_BLOB_HEAD.pack(len(meta))), memoryview(meta), *raw]


def decode(blob: bytes) -> tuple[list[OutputTensor], dict[str, Any]]:
    """The outputs and parameters of an answer `encode` made: read-only arrays, over `blob` itself but for BYTES."""
    (meta_length,) = _BLOB_HEAD.unpack_from(blob)
    position = _ALIGN  # the parts lie as `SharedTable.insert` wrote them, each aligned
    tensors, parameters = pickle.loads(blob[position: position + meta_length])
    position += meta_length
    outputs = []
    for name, datatype, shape, params, code, data in tensors:
        if code is None:  # BYTES: the array itself
            data.flags.writeable = False
        else:  # `data` is the array's shape; its bytes are next
            position = _round_up(position, _ALIGN)
            data = np.ndarray(data, _DTYPES.get(code) or _dtype(code), blob, position)
            position += data.nbytes
        outputs.append(OutputTensor(name, datatype, shape, data, params))
    return outputs, parameters


_DTYPES: dict[Any, np.dtype[Any]] = {}


def _dtype(code: Any) -> np.dtype[Any]:
    dtype = _DTYPES[code] = np.dtype(code)
    return dtype


def _parts_length(parts: list[memoryview]) -> int:
    length = 0
    for part in parts:
        length = _round_up(length, _ALIGN) + part.nbytes
    return length


# ---- the service's cache --------------------------------------------------------------------------------------


class SharedResponseCache(ResponseCache):
    """The service's response cache in a worker: the same `execute` as one process's, over the server's table.

    The in-process fields it inherits (`used`, `hits`, `misses`, `evictions`) stay 0: the server's figures are
    `table.counts()`, the per-model ones are in the statistics."""

    def __init__(self, table: SharedTable) -> None:
        super().__init__(table.capacity)
        self.table = table
        self._loads: dict[int, int] = {}  # a load's number in this process -> the server's number of its load
        self._control: int | None = None  # the server's number of the control call this worker is running
        self._alone = os.urandom(8).hex()  # keys of loads the cache cannot place: this process's alone

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, key: bytes) -> bool:
        return key in self.table

    # ---- loads ------------------------------------------------------------------------------------------

    def loaded_at_start(self, models: Iterable[LoadedModel]) -> None:
        """The models this worker loaded as it started, before it joined the server: load 0."""
        self._place(models, 0)

    def control_started(self, number: int) -> None:
        """The server's control call `number` runs here now: the loads it makes are its."""
        self._control = number

    def control_ended(self, models: Iterable[LoadedModel]) -> None:
        """The call ended: the models it loaded (those not placed yet) are its."""
        if self._control is not None:
            self._place(models, self._control)
        self._control = None

    def _place(self, models: Iterable[LoadedModel], number: int) -> None:
        for model in models:
            if model.response_cache and model.response_cache not in self._loads:
                self._loads[model.response_cache] = number

    def load_of(self, model: LoadedModel) -> object:
        """What the key says of `model`'s load: the server's number of it."""
        number = self._loads.get(model.response_cache)
        if number is not None:
            return number
        if self._control is not None:  # loaded by the call under way (earlier loads were placed when theirs ended)
            self._loads[model.response_cache] = self._control
            return self._control
        return (self._alone, model.response_cache)

    # ---- the infer path -----------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> tuple[tuple[OutputTensor, ...], dict[str, Any]] | None:
        blob = self.table.lookup(key)
        if blob is None:
            return None
        outputs, parameters = decode(blob)
        return tuple(outputs), parameters

    def insert(self, key: bytes, response: InferenceResponse) -> bool:
        return self.table.insert(key, encode(response.outputs, response.parameters), entry_size(response.outputs))

    async def execute(
        self, model: LoadedModel, request: InferenceRequest, started: int, execute: Execute
    ) -> InferenceResponse:
        lookup_started = time.monotonic_ns()
        key = await request_key_async(model, request, self.load_of(model))
        found = self._found(key)
        if found is not None:
            outputs, parameters = found
            done = time.monotonic_ns()
            model.statistics.record_cache_hit(done - started, done - lookup_started)
            return InferenceResponse(request.model_name, str(model.version), outputs, request.id, parameters)
        lookup_ns = time.monotonic_ns() - lookup_started
        response = await execute(model, request, started)  # a failure propagates: it is never stored
        inserting = time.monotonic_ns()
        self._store(model, key, response)
        model.statistics.record_cache_miss(lookup_ns, time.monotonic_ns() - inserting)
        return response

    def _found(self, key: bytes) -> tuple[list[OutputTensor], dict[str, Any]] | None:
        """The answer stored under `key`, or None; a table that fails (a bug: the next lookup empties it) is a miss,
        not a failed request."""
        try:
            blob = self.table.lookup(key)
            return None if blob is None else decode(blob)
        except Exception:
            logger.exception("response cache lookup failed: answered as a miss")
            return None

    def _store(self, model: LoadedModel, key: bytes, response: InferenceResponse) -> None:
        """Store `response`, if it fits; a store that fails loses the entry, not the response."""
        try:
            stored = self.table.insert(key, encode(response.outputs, response.parameters), entry_size(response.outputs))
        except Exception:
            logger.exception("response cache: storing a response of model '%s' failed", model.name)
            return
        if not stored:
            logger.debug("response of model '%s' (%d bytes) is larger than the response cache (%d bytes): not "
                         "cached", model.name, entry_size(response.outputs), self.capacity)
