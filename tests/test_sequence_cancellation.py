"""Cancellation in the sequence batcher, Triton's rule: a cancelled request of a sequence cancels the sequence's other
pending requests (answered CANCELLED, never run) and ends the sequence (its slot freed once nothing of it runs, its
state dropped, a START needed again); a request already running finishes, flagged cancelled for a model that polls.
Pure asyncio, with the sequence tests' recording accumulator; the protocols' side is in tests/test_cancellation.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from geserve.backends.base import Execution
from geserve.config import fill_defaults, parse_config_text
from geserve.errors import CancelledError, InvalidArgumentError
from geserve.scheduling.base import create_scheduler
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.sequence_batcher import SequenceBatcher
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest
from tests.test_sequence_batcher import Accumulator, config_text, make_request, run_batcher, value


class FlaggingAccumulator(Accumulator):
    """The sequence tests' accumulator, also recording each batch's cancellation flags once past its gate."""

    def __init__(self, name: str = "acc_0") -> None:
        super().__init__(name)
        self.flags: list[list[bool]] = []

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        execution = super().execute(requests)
        self.flags.append([r.cancelled for r in requests])
        return execution


def _corrids(fake: Accumulator) -> list[list[int]]:
    return [[row[0] for row in batch] for batch in fake.batches]


def test_a_cancelled_queued_request_of_a_sequence_cancels_the_rest_and_frees_the_slot() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        assert value(await batcher.enqueue(make_request(1, 5, start=True))) == 1
        fakes[0].gate.clear()
        running = asyncio.ensure_future(batcher.enqueue(make_request(2, 5)))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(batcher.enqueue(make_request(3, 5)))
        rest = asyncio.ensure_future(batcher.enqueue(make_request(4, 5, end=True)))
        other = asyncio.ensure_future(batcher.enqueue(make_request(100, 6, start=True)))  # backlog: one slot
        await asyncio.sleep(0.05)
        gone.cancel()
        with pytest.raises(CancelledError, match="sequence 5 was cancelled"):
            await rest
        fakes[0].gate.set()
        assert value(await running) == 3  # already running: unaffected
        assert value(await other) == 100  # the slot went to the backlog, with a fresh state
        with pytest.raises(InvalidArgumentError, match="sequence 5 to model 'acc' must specify the START flag"):
            await batcher.enqueue(make_request(1, 5))
        assert batcher.inflight_count == 0
        assert [[row[4] for row in batch] for batch in fakes[0].batches] == [[1], [2], [100]]  # 3 and 4 never ran

    run_batcher(body, config_text(max_batch_size=1))


def test_cancelling_a_sequence_without_its_end_queued_ends_it() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, 5, start=True))
        fakes[0].gate.clear()
        running = asyncio.ensure_future(batcher.enqueue(make_request(2, 5)))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(batcher.enqueue(make_request(3, 5)))
        await asyncio.sleep(0.05)
        gone.cancel()
        await asyncio.sleep(0.01)  # the cancellation reaches the batcher when the cancelled task runs
        with pytest.raises(InvalidArgumentError, match="must specify the START flag"):
            await batcher.enqueue(make_request(1, 5))  # ended at once: no new request joins it
        fakes[0].gate.set()
        assert value(await running) == 3
        assert value(await batcher.enqueue(make_request(7, 8, start=True))) == 7  # its slot is free again
        assert _corrids(fakes[0]) == [[5], [5], [8]]

    run_batcher(body, config_text(max_batch_size=1))


def test_cancelling_a_running_request_of_a_sequence_flags_it_and_cancels_the_rest() -> None:
    fake = FlaggingAccumulator()

    async def main() -> None:
        config = parse_config_text(config_text(max_batch_size=1), "test")
        fill_defaults(config, 0, "model.onnx")
        batcher = create_scheduler(config, InstancePool("acc", [fake], ModelStatistics()))
        await batcher.enqueue(make_request(1, 5, start=True))
        fake.gate.clear()
        running = asyncio.ensure_future(batcher.enqueue(make_request(2, 5)))
        await asyncio.sleep(0.05)
        rest = asyncio.ensure_future(batcher.enqueue(make_request(3, 5, end=True)))
        await asyncio.sleep(0.05)
        running.cancel()
        with pytest.raises(CancelledError):
            await rest
        fake.gate.set()
        assert value(await batcher.enqueue(make_request(9, 6, start=True))) == 9
        await batcher.stop()

    asyncio.run(main())
    assert _corrids(fake) == [[5], [5], [6]]
    assert fake.flags == [[False], [True], [False]]  # the instance's copy of the running request saw it


def test_cancelling_a_backlogged_request_cancels_its_whole_sequence() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, 1, start=True))  # holds the only slot
        second = [asyncio.ensure_future(batcher.enqueue(make_request(x, 2, start=x == 10, end=x == 30)))
                  for x in (10, 20, 30)]
        await asyncio.sleep(0.05)
        second[1].cancel()
        for task in (second[0], second[2]):
            with pytest.raises(CancelledError):
                await task
        assert batcher.inflight_count == 0
        with pytest.raises(InvalidArgumentError, match="sequence 2 to model 'acc' must specify the START flag"):
            await batcher.enqueue(make_request(1, 2))
        assert value(await batcher.enqueue(make_request(1, 1, end=True))) == 2  # sequence 1 goes on
        assert _corrids(fakes[0]) == [[1], [1]]

    run_batcher(body, config_text(max_batch_size=0))


def test_oldest_cancelling_an_issued_request_frees_its_slot() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, 1, start=True))
        fakes[0].gate.clear()
        running = asyncio.ensure_future(batcher.enqueue(make_request(2, 1)))
        await asyncio.sleep(0.05)
        issued = asyncio.ensure_future(batcher.enqueue(make_request(10, 2, start=True)))  # waits for a batch
        queued = asyncio.ensure_future(batcher.enqueue(make_request(20, 2)))  # waits in its slot
        await asyncio.sleep(0.05)
        issued.cancel()
        with pytest.raises(CancelledError):
            await queued
        fakes[0].gate.set()
        assert value(await running) == 3
        started = time.monotonic()
        assert value(await batcher.enqueue(make_request(5, 3, start=True))) == 5
        assert time.monotonic() - started < 2  # sequence 2's slot is free: no wait for an idle timeout (5 s)
        with pytest.raises(InvalidArgumentError, match="sequence 2 to model 'acc' must specify the START flag"):
            await batcher.enqueue(make_request(1, 2))
        assert all(2 not in ids for ids in _corrids(fakes[0]))

    run_batcher(body, config_text(strategy="oldest { max_candidate_sequences: 2 }", max_batch_size=2))
