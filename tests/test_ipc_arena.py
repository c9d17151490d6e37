"""The shared-memory arena and codec (geserve/ipc/arena.py) on their own: large arrays cross as views of the segment,
small ones in the frame; a block is freed once the reader's views are gone and used again; a full segment falls back
to the frame; idle pages above the blocks in use go back to the kernel; errors keep their code and reason."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from geserve.errors import DeadlineExceededError, InvalidArgumentError
from geserve.ipc import arena
from geserve.ipc.arena import ArenaReader, ArenaWriter, Segment, SharedArrayCodec, create_segment


class Pair:
    """Both ends of one direction in this process: what one side writes, the other views (the same memfd)."""

    def __init__(self, capacity: int = 1 << 26) -> None:
        fd = create_segment(capacity)
        self.writer = ArenaWriter(Segment(fd))
        self.released: list[int] = []
        self.reader = ArenaReader(Segment(fd), self.released.append)
        os.close(fd)
        self.sending = SharedArrayCodec(self.writer, None)
        self.receiving = SharedArrayCodec(None, self.reader)

    def cross(self, message: tuple) -> tuple:
        return self.receiving.loads(self.sending.dumps(message))

    def free_released(self) -> None:
        gc.collect()
        self.writer.free(self.released)
        self.released.clear()


def test_a_large_array_crosses_as_a_read_only_view_of_the_segment() -> None:
    pair = Pair()
    data = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)
    frame = pair.sending.dumps(("call", data))
    assert len(frame) < 1024  # where it lies, not its bytes
    (_, got) = pair.receiving.loads(frame)
    np.testing.assert_array_equal(got, data)
    assert got.dtype == data.dtype and not got.flags.writeable
    assert pair.writer.used_bytes >= data.nbytes
    view = got[10:20]
    del got
    gc.collect()
    assert pair.released == []  # a view of it still holds the block
    del view
    pair.free_released()
    assert pair.writer.used_bytes == 0


def test_small_and_object_arrays_go_in_the_frame() -> None:
    pair = Pair()
    small = np.ones(arena.SHARED_FROM_BYTES // 8, np.float32)
    text = np.array([b"a" * 100_000], dtype=np.object_)
    _, got_small, got_text = pair.cross(("call", small, text))
    assert pair.writer.used_bytes == 0
    np.testing.assert_array_equal(got_small, small)
    assert got_text.tolist() == text.tolist()


def test_non_contiguous_and_bfloat16_arrays_keep_their_values_and_type() -> None:
    import ml_dtypes

    pair = Pair()
    strided = np.arange(200_000, dtype=np.int64)[::2]
    bf16 = np.linspace(0, 1, 100_000).astype(ml_dtypes.bfloat16)
    _, got_strided, got_bf16 = pair.cross(("call", strided, bf16))
    np.testing.assert_array_equal(got_strided, strided)
    assert got_bf16.dtype == bf16.dtype and np.array_equal(got_bf16.view(np.uint16), bf16.view(np.uint16))


def test_freed_blocks_coalesce_and_are_used_again() -> None:
    pair = Pair(capacity=1 << 22)  # 4 MiB: three 1 MiB arrays fit, a 4 MiB one only once they are gone
    blocks = [np.full(1 << 18, index, np.float32) for index in range(3)]
    views = [pair.cross(("call", block))[1] for block in blocks]
    assert pair.writer.used_bytes == 3 << 20
    del views
    pair.free_released()
    big = np.ones(1 << 20, np.float32)
    (_, got) = pair.cross(("call", big))
    assert pair.writer.used_bytes == 4 << 20  # one block over the whole segment: the three were joined again
    np.testing.assert_array_equal(got, big)


def test_an_array_the_segment_has_no_room_for_goes_in_the_frame() -> None:
    pair = Pair(capacity=1 << 20)
    data = np.ones(1 << 19, np.float32)  # 2 MiB
    frame = pair.sending.dumps(("call", data))
    assert len(frame) > data.nbytes and pair.writer.used_bytes == 0
    np.testing.assert_array_equal(pair.receiving.loads(frame)[1], data)


def test_idle_pages_above_the_blocks_in_use_go_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "KEEP_BYTES", 1 << 20)
    pair = Pair()
    discarded: list[tuple[int, int]] = []
    segment = pair.writer._segment
    original = segment.discard
    monkeypatch.setattr(segment, "discard", lambda start, end: (discarded.append((start, end)), original(start, end)))
    views = [pair.cross(("call", np.ones(1 << 20, np.float32)))[1] for _ in range(4)]  # 16 MiB written
    del views
    pair.free_released()
    assert discarded == [(1 << 20, 16 << 20)]  # all but KEEP_BYTES above the top (0: nothing in use)
    (_, again) = pair.cross(("call", np.full(1 << 20, 2.0, np.float32)))  # pages read as zeros, then written anew
    assert float(again.sum()) == 2.0 * (1 << 20)


def test_errors_cross_with_their_code_and_failure_reason() -> None:
    pair = Pair()
    _, deadline, invalid = pair.cross(("call", DeadlineExceededError(), InvalidArgumentError("bad", "REJECTED")))
    assert isinstance(deadline, DeadlineExceededError) and deadline.failure_reason == "DEADLINE_EXCEEDED"
    assert isinstance(invalid, InvalidArgumentError) and (invalid.message, invalid.failure_reason) == ("bad",
                                                                                                       "REJECTED")
