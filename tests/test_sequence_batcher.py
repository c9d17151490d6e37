"""The sequence batcher: slots, control inputs, implicit state, both strategies, the backlog, idle sequences and
Triton's errors, first in pure asyncio with a recording instance, then through tritonclient (HTTP, gRPC, gRPC
streaming) on a real server with a real ONNX accumulator and a Python sequence model."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from geserve.backends.base import Execution, ModelInstance, Results
from geserve.backends.python.messages import InferenceRequest as PbRequest
from geserve.config import fill_defaults, parse_config_text, validate
from geserve.config.sequence import SequenceSettings
from geserve.errors import GeserveError, InvalidArgumentError, UnavailableError
from geserve.scheduling.base import create_scheduler
from geserve.scheduling.pool import InstancePool
from geserve.scheduling.sequence_batcher import SequenceBatcher
from geserve.service.context import Transport
from geserve.service.parameters import apply_parameters
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, OutputTensor
from tests.support import models
from tests.support.server import RunningServer, geserve

# ---- unit tests: a recording accumulator in pure asyncio ----------------------------------------------------------

CONTROLS = """
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" } } ]
"""


class Accumulator(ModelInstance):
    """OUT = X + STATE_IN and STATE_OUT = OUT, row by row; records each batch's rows as
    (corrid, start, end, ready, x) and can be held on a gate or made to raise."""

    def __init__(self, name: str = "acc_0") -> None:
        self.name = name
        self.batches: list[list[tuple[int, int, float, bool, int]]] = []
        self.gate = threading.Event()
        self.gate.set()

    def execute(self, requests: list[InferenceRequest]) -> Execution:
        started = time.monotonic_ns()
        self.gate.wait(5)
        rows = []
        results: Results = []
        for request in requests:
            feed = {t.name: t.data for t in request.inputs}
            rows.append((int(feed["CORRID"].ravel()[0]), int(feed["START"].ravel()[0]), float(feed["END"].ravel()[0]),
                         bool(feed["READY"].ravel()[0]), int(feed["X"].ravel()[0])))
            total = feed["X"] + feed["STATE_IN"]
            wanted = None if request.outputs is None else {o.name for o in request.outputs}
            outputs = [OutputTensor(n, "INT32", total.shape, total) for n in ("OUT", "STATE_OUT")
                       if wanted is None or n in wanted]
            results.append(InferenceResponse(request.model_name, "1", outputs, request.id))
        self.batches.append(rows)
        return Execution.timed(results, started)


def config_text(strategy: str = "direct { }", max_batch_size: int = 4, idle_us: int = 5_000_000,
                controls: str = CONTROLS) -> str:
    return f"""
name: "acc"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  {controls}
}}
"""


def make_request(x: int, seq: int | str | None, start: bool = False, end: bool = False, rows: int = 1,
                 timeout_us: int = 0) -> InferenceRequest:
    data = np.full((rows, 1), x, dtype=np.int32)
    parameters: dict[str, Any] = {}
    if seq is not None:
        parameters = {"sequence_id": seq, "sequence_start": start, "sequence_end": end}
    request = InferenceRequest("acc", "", [InputTensor("X", "INT32", data.shape, data)], parameters=parameters,
                               timeout_us=timeout_us)
    request.batch_size = rows
    return request


def run_batcher(
    body: Callable[[SequenceBatcher, list[Accumulator], ModelStatistics], Awaitable[None]],
    text: str | None = None, instances: int = 1,
) -> None:
    async def main() -> None:
        config = parse_config_text(text or config_text(), "test")
        fill_defaults(config, 0, "model.onnx")
        validate(config, "acc")
        fakes = [Accumulator(f"acc_{i}") for i in range(instances)]
        statistics = ModelStatistics()
        scheduler = create_scheduler(config, InstancePool("acc", fakes, statistics))
        assert isinstance(scheduler, SequenceBatcher)
        try:
            await asyncio.wait_for(body(scheduler, fakes, statistics), 20)
        finally:
            for fake in fakes:
                fake.gate.set()
            await scheduler.stop()

    asyncio.run(main())


def value(response: InferenceResponse) -> int:
    (out,) = response.outputs  # the state output never reaches the client
    assert out.name == "OUT"
    return int(out.data.ravel()[0])


def test_interleaved_sequences_keep_their_own_state_and_slot() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        assert value(await batcher.enqueue(make_request(1, 100, start=True))) == 1
        assert value(await batcher.enqueue(make_request(10, 200, start=True))) == 10
        assert value(await batcher.enqueue(make_request(2, 100))) == 3
        assert value(await batcher.enqueue(make_request(20, 200))) == 30
        assert value(await batcher.enqueue(make_request(3, 100, end=True))) == 6
        assert value(await batcher.enqueue(make_request(30, 200, end=True))) == 60
        batches = fakes[0].batches
        # Sequence 100 holds slot 0 and 200 slot 1: a batch with a request of 200 only has a null row in slot 0.
        assert batches[0] == [(100, 1, 0.0, True, 1)]
        assert batches[1] == [(0, 0, 0.0, False, 0), (200, 1, 0.0, True, 10)]
        assert batches[2] == [(100, 0, 0.0, True, 2)]
        assert batches[3] == [(0, 0, 0.0, False, 0), (200, 0, 0.0, True, 20)]
        assert batches[4] == [(100, 0, 1.0, True, 3)]
        # Slot 0 is free now (100 ended) and nothing comes after slot 1: the null row stays.
        assert batches[5] == [(0, 0, 0.0, False, 0), (200, 0, 1.0, True, 30)]

    run_batcher(body)


def test_concurrent_requests_of_ready_slots_run_in_one_batch() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], stats: ModelStatistics) -> None:
        starts = [asyncio.ensure_future(batcher.enqueue(make_request(i, i, start=True))) for i in (1, 2, 3)]
        assert [value(r) for r in await asyncio.gather(*starts)] == [1, 2, 3]
        fakes[0].gate.clear()  # hold the instance while every sequence queues its next request
        blocker = asyncio.ensure_future(batcher.enqueue(make_request(100, 1)))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(batcher.enqueue(make_request(100, i, end=True))) for i in (2, 3)]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        assert value(await blocker) == 101
        assert [value(r) for r in await asyncio.gather(*rest)] == [102, 103]
        last = fakes[0].batches[-1]
        assert [row[0] for row in last] == [0, 2, 3] and [row[3] for row in last] == [False, True, True]
        # Triton's counts: the null row is in the batch's size, never an inference.
        report = stats.as_json("acc", "1")
        assert report["inference_count"] == 6
        assert {b["batch_size"] for b in report["batch_stats"]} >= {3}
        assert report["inference_stats"]["compute_infer"]["count"] == 6

    run_batcher(body)


def test_start_on_a_live_sequence_restarts_it_in_the_same_slot() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(5, 7, start=True))
        assert value(await batcher.enqueue(make_request(5, 7))) == 10
        assert value(await batcher.enqueue(make_request(1, 7, start=True))) == 1  # state back to its initial value
        assert value(await batcher.enqueue(make_request(1, 7, end=True))) == 2
        assert {len(b) for b in fakes[0].batches} == {1}  # always slot 0

    run_batcher(body)


def test_triton_errors_for_requests_outside_a_sequence() -> None:
    async def body(batcher: SequenceBatcher, _: list[Accumulator], __: ModelStatistics) -> None:
        with pytest.raises(InvalidArgumentError) as missing:
            await batcher.enqueue(make_request(1, None))
        assert missing.value.message == (
            "inference request to model 'acc' must specify a non-zero or non-empty correlation ID"
        )
        with pytest.raises(InvalidArgumentError) as zero:
            await batcher.enqueue(make_request(1, 0, start=True))
        assert "non-zero or non-empty correlation ID" in zero.value.message
        with pytest.raises(InvalidArgumentError) as no_start:
            await batcher.enqueue(make_request(1, 42))
        assert no_start.value.message == (
            "inference request for sequence 42 to model 'acc' must specify the START flag on the first request of "
            "the sequence"
        )
        with pytest.raises(InvalidArgumentError) as batched:
            await batcher.enqueue(make_request(1, 42, start=True, rows=2))
        assert batched.value.message == (
            "inference request to model 'acc' must specify batch-size 1 due to requirements of sequence batcher"
        )
        with pytest.raises(InvalidArgumentError) as typed:
            await batcher.enqueue(make_request(1, "text-id", start=True))
        assert typed.value.message == (
            "inference request for sequence text-id to model 'acc' must give an unsigned integer 'sequence_id': the "
            "model's CONTROL_SEQUENCE_CORRID input 'CORRID' is TYPE_UINT64"
        )
        # After END the id is no sequence: its next request needs a START again.
        await batcher.enqueue(make_request(1, 43, start=True, end=True))
        with pytest.raises(InvalidArgumentError, match=r"sequence 43 .* must specify the START flag"):
            await batcher.enqueue(make_request(1, 43))
        assert batcher.inflight_count == 0

    run_batcher(body)


def test_an_idle_sequence_loses_its_slot_to_the_backlog() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        assert value(await batcher.enqueue(make_request(1, 1, start=True))) == 1
        started = time.monotonic()
        waiting = asyncio.ensure_future(batcher.enqueue(make_request(7, 2, start=True)))
        await asyncio.sleep(0.05)
        assert not waiting.done() and batcher.inflight_count == 1  # backlogged behind sequence 1
        assert value(await waiting) == 7  # sequence 1 idled out: its slot went to sequence 2
        assert 0.15 < time.monotonic() - started < 2.0
        with pytest.raises(InvalidArgumentError, match="sequence 1 to model 'acc' must specify the START flag"):
            await batcher.enqueue(make_request(1, 1))
        assert value(await batcher.enqueue(make_request(1, 2, end=True))) == 8

    run_batcher(body, config_text(max_batch_size=1, idle_us=200_000))  # one slot: the second sequence waits


def test_a_backlogged_sequence_runs_whole_once_a_slot_frees() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, 1, start=True))
        second = [asyncio.ensure_future(batcher.enqueue(make_request(x, 2, start=x == 10, end=x == 30)))
                  for x in (10, 20, 30)]
        await asyncio.sleep(0.05)
        assert not any(f.done() for f in second)
        assert value(await batcher.enqueue(make_request(1, 1, end=True))) == 2
        assert [value(r) for r in await asyncio.gather(*second)] == [10, 30, 60]
        assert [b[0][0] for b in fakes[0].batches] == [1, 1, 2, 2, 2]

    run_batcher(body, config_text(max_batch_size=0))


def test_a_backlogged_request_past_its_timeout_fails_with_its_sequence() -> None:
    async def body(batcher: SequenceBatcher, _: list[Accumulator], __: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, 1, start=True))
        with pytest.raises(UnavailableError) as expired:
            await batcher.enqueue(make_request(1, 2, start=True, timeout_us=100_000))
        assert expired.value.message == "timeout of the corresponding sequence has been expired"
        assert batcher.inflight_count == 0

    run_batcher(body, config_text(max_batch_size=1))


def test_sequences_spread_over_instances_slot_by_slot() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        for seq in (1, 2, 3):
            await batcher.enqueue(make_request(seq, seq, start=True))
        # Slot 0 of each instance first (as Triton hands slots out), then slot 1 of the first.
        assert [row[0] for b in fakes[0].batches for row in b if row[3]] == [1, 3]
        assert [row[0] for b in fakes[1].batches for row in b if row[3]] == [2]
        assert value(await batcher.enqueue(make_request(1, 3))) == 4  # sequence 3 stays on instance 0, slot 1
        assert fakes[0].batches[-1][1][0] == 3

    run_batcher(body, config_text(max_batch_size=2), instances=2)


def test_direct_waits_for_slot_utilization_up_to_the_delay() -> None:
    strategy = "direct { max_queue_delay_microseconds: 300000 minimum_slot_utilization: 0.5 }"

    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        started = time.monotonic()
        assert value(await batcher.enqueue(make_request(1, 1, start=True))) == 1
        assert time.monotonic() - started > 0.25  # 1 of 4 slots ready: waited the whole delay
        both = [asyncio.ensure_future(batcher.enqueue(make_request(1, s, start=s == 2))) for s in (1, 2)]
        started = time.monotonic()
        assert [value(r) for r in await asyncio.gather(*both)] == [2, 1]
        assert time.monotonic() - started < 0.25  # 2 of 4 ready: at once
        assert len(fakes[0].batches) == 2

    run_batcher(body, config_text(strategy=strategy))


def test_oldest_batches_sequences_with_one_request_of_each_in_flight() -> None:
    strategy = "oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 100000 preferred_batch_size: [ 2 ] }"

    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], stats: ModelStatistics) -> None:
        requests = []
        for step in range(3):
            for seq in (1, 2):
                requests.append(batcher.enqueue(make_request(seq, seq, start=step == 0, end=step == 2)))
        results = await asyncio.gather(*requests)
        assert [value(r) for r in results] == [1, 2, 2, 4, 3, 6]
        for batch in fakes[0].batches:
            ids = [row[0] for row in batch]
            assert len(ids) == len(set(ids))  # never two requests of one sequence in a batch
            assert all(row[3] for row in batch)  # no null requests in the oldest strategy
        assert [len(b) for b in fakes[0].batches] == [2, 2, 2]
        assert {b["batch_size"] for b in stats.as_json("acc", "1")["batch_stats"]} == {2}

    run_batcher(body, config_text(strategy=strategy))


def test_new_sequences_are_refused_while_stopping_and_queued_ones_are_served() -> None:
    async def main() -> None:
        config = parse_config_text(config_text(), "test")
        fill_defaults(config, 0, "model.onnx")
        fake = Accumulator()
        batcher = create_scheduler(config, InstancePool("acc", [fake], ModelStatistics()))
        await batcher.enqueue(make_request(1, 1, start=True))
        fake.gate.clear()
        queued = asyncio.ensure_future(batcher.enqueue(make_request(2, 1, end=True)))
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.05)
        with pytest.raises(UnavailableError) as refused:
            await batcher.enqueue(make_request(1, 2, start=True))
        assert refused.value.message == (
            "Server is stopping, scheduler for model has stopped accepting new inference requests"
        )
        fake.gate.set()
        assert value(await queued) == 3
        await asyncio.wait_for(stopping, 5)

    asyncio.run(main())


def test_a_dead_batcher_task_fails_every_request_it_holds() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, 1, start=True))

        def broken(*args: Any, **kwargs: Any) -> InferenceRequest:
            raise RuntimeError("a bug")

        batcher.inputs.execution = broken  # type: ignore[method-assign]
        fakes[0].gate.clear()
        held = [asyncio.ensure_future(batcher.enqueue(make_request(1, s, start=s == 2))) for s in (1, 2)]
        await asyncio.sleep(0.05)
        fakes[0].gate.set()
        for future in held:
            with pytest.raises(UnavailableError, match="the sequence batcher of model 'acc' failed: a bug"):
                await future
        with pytest.raises(UnavailableError, match="failed: a bug"):
            await batcher.enqueue(make_request(1, 3, start=True))
        assert batcher.inflight_count == 0

    run_batcher(body)


def test_an_instance_failure_fails_its_requests_and_keeps_the_state() -> None:
    class Failing(Accumulator):
        fail = False

        def execute(self, requests: list[InferenceRequest]) -> Execution:
            if self.fail:
                self.fail = False
                raise RuntimeError("instance crashed")
            return super().execute(requests)

    async def main() -> None:
        config = parse_config_text(config_text(), "test")
        fill_defaults(config, 0, "model.onnx")
        fake = Failing()
        batcher = create_scheduler(config, InstancePool("acc", [fake], ModelStatistics()))
        try:
            await batcher.enqueue(make_request(4, 1, start=True))
            fake.fail = True
            with pytest.raises(GeserveError, match="instance crashed"):
                await batcher.enqueue(make_request(100, 1))
            assert value(await batcher.enqueue(make_request(1, 1, end=True))) == 5
        finally:
            await batcher.stop()

    asyncio.run(main())


def test_string_ids_and_models_without_controls() -> None:
    text = config_text(controls="")

    class Plain(ModelInstance):
        name = "plain_0"

        def execute(self, requests: list[InferenceRequest]) -> Execution:
            assert all([t.name for t in r.inputs] == ["X"] for r in requests)  # nothing added without controls
            results: Results = [InferenceResponse(r.model_name, "1", [r.inputs[0]], r.id) for r in requests]
            return Execution.timed(results, time.monotonic_ns())

    async def main() -> None:
        config = parse_config_text(text, "test")
        fill_defaults(config, 0, "model.onnx")
        batcher = create_scheduler(config, InstancePool("acc", [Plain()], ModelStatistics()))
        try:
            await batcher.enqueue(make_request(3, "alpha", start=True))
            response = await batcher.enqueue(make_request(4, "alpha", end=True))
            assert int(response.outputs[0].data.ravel()[0]) == 4
            with pytest.raises(InvalidArgumentError, match="non-zero or non-empty"):
                await batcher.enqueue(make_request(4, "", start=True))
        finally:
            await batcher.stop()

    asyncio.run(main())


def test_gRPC_int64_ids_are_read_as_their_uint64_bits() -> None:
    async def body(batcher: SequenceBatcher, fakes: list[Accumulator], _: ModelStatistics) -> None:
        await batcher.enqueue(make_request(1, -1, start=True))
        assert value(await batcher.enqueue(make_request(1, 2**64 - 1, end=True))) == 2  # one sequence
        assert fakes[0].batches[0][0][0] == 2**64 - 1

    run_batcher(body)


# ---- config checks (Triton's words) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]',
         "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for "
         "CONTROL_SEQUENCE_START for acc"),
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0 ] } ] } ]',
         "sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START for acc"),
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] '
         'fp32_false_true: [ 0, 1 ] } ] } ]',
         "sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
         "'bool_false_true' for CONTROL_SEQUENCE_START for acc"),
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
         '{ name: "S" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ]',
         "sequence batching control tensor 'S' is specified for multiple control kinds for acc"),
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
         '{ name: "T" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]',
         "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for acc"),
        ('control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',
         "unexpected data type for control CONTROL_SEQUENCE_CORRID for acc. Allowed data types are TYPE_UINT64, "
         "TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"),
        ('control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 '
         'int32_false_true: [ 0, 1 ] } ] } ]',
         "sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' for "
         "CONTROL_SEQUENCE_CORRID for acc"),
        ("oldest { preferred_batch_size: [ 8 ] }",
         "sequence batching preferred batch size must be <= max batch size for acc"),
        ("direct { minimum_slot_utilization: 1.5 }",
         "sequence batching minimum slot utilization must be in range (0.0, 1.0] for acc"),
        ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] initial_state '
         '{ data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "z" } } ]',
         "The data type used for 'initial_state' field of state 'I' does not match the state data type."),
        ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] initial_state '
         '{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } ]',
         "Field 'name' must be set when using initial_state for state input 'I'."),
        ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 2 ] initial_state '
         '{ data_type: TYPE_INT32 dims: [ 3 ] zero_data: true name: "z" } } ]',
         "'initial_state' dim for input name 'I' doesn't match 'state' dim description. 3 != 2"),
        ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ -1 ] initial_state '
         '{ data_type: TYPE_INT32 dims: [ -1 ] zero_data: true name: "z" } } ]',
         "'initial_state' field for state input name 'I' contains variable dimensions."),
        ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 1 ] initial_state '
         '{ data_type: TYPE_INT32 dims: [ 1 ] name: "z" } } ]',
         "initial_state setting expects state'I' to have state_data set"),
    ],
)
def test_triton_refuses_these_sequence_configs_in_its_words(section: str, message: str) -> None:
    config = parse_config_text(config_text(controls=section, strategy=""), "test")
    fill_defaults(config, 0, "model.onnx")
    with pytest.raises(InvalidArgumentError) as refused:
        validate(config, "acc")
    assert refused.value.message == message


def test_triton_defaults_fill_the_idle_time_and_the_oldest_preferred_size() -> None:
    config = parse_config_text(config_text(strategy="oldest { max_candidate_sequences: 2 }", idle_us=0), "t")
    fill_defaults(config, 0, "model.onnx")
    assert config.sequence_batching.max_sequence_idle_microseconds == 1_000_000
    assert list(config.sequence_batching.oldest.preferred_batch_size) == [4]


def test_an_initial_state_file_is_read_from_the_models_initial_state_folder(tmp_path: Path) -> None:
    state = ('state [ { input_name: "I" output_name: "O" data_type: TYPE_INT32 dims: [ 2 ] initial_state '
             '{ data_type: TYPE_INT32 dims: [ 2 ] data_file: "start.bin" name: "from a file" } } ]')
    config = parse_config_text(config_text(controls=state), "t")
    fill_defaults(config, 0, "model.onnx")
    validate(config, "acc")
    with pytest.raises(InvalidArgumentError, match=r"failed to read initial state file .*initial_state/start\.bin"):
        SequenceSettings.from_config(config, tmp_path)
    (tmp_path / "initial_state").mkdir()
    (tmp_path / "initial_state" / "start.bin").write_bytes(np.array([7], np.int32).tobytes())
    with pytest.raises(InvalidArgumentError) as short:
        SequenceSettings.from_config(config, tmp_path)
    assert short.value.message == (
        "initial_state setting expects 8 bytes, but the data provided from start.bin only has 4 bytes."
    )
    (tmp_path / "initial_state" / "start.bin").write_bytes(np.array([7, 8], np.int32).tobytes())
    (spec,) = SequenceSettings.from_config(config, tmp_path).states
    assert spec.initial is not None and spec.initial.tolist() == [7, 8]


# ---- the parameters and the Python model's view ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("transport", "parameters", "message"),
    [
        (Transport.HTTP, {"sequence_id": -1},
         "Unable to parse 'sequence_id': attempt to access JSON non-string as string"),
        (Transport.HTTP, {"sequence_id": 1.5}, "Unable to parse 'sequence_id'"),
        (Transport.HTTP, {"sequence_id": True}, "Unable to parse 'sequence_id'"),
        (Transport.HTTP, {"sequence_start": "yes"},
         "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean"),
        (Transport.HTTP, {"sequence_end": 1}, "Unable to parse 'sequence_end'"),
        (Transport.GRPC, {"sequence_id": 2.5},
         "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."),
        (Transport.GRPC, {"sequence_start": 1},
         "invalid value type for 'sequence_start' parameter, expected bool_param."),
    ],
)
def test_sequence_parameters_of_the_wrong_type_are_refused(
    transport: Transport, parameters: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        apply_parameters(make_request_with(parameters), transport)
    assert refused.value.message.startswith(message)


def make_request_with(parameters: dict[str, Any]) -> InferenceRequest:
    request = make_request(1, None)
    request.parameters = parameters
    return request


@pytest.mark.parametrize("transport", [Transport.HTTP, Transport.GRPC])
def test_sequence_parameters_pass_for_any_model(transport: Transport) -> None:
    for parameters in ({"sequence_id": 2**64 - 1, "sequence_start": True, "sequence_end": False},
                       {"sequence_id": "text", "sequence_start": False}):
        request = make_request_with(parameters)
        apply_parameters(request, transport)
        assert request.parameters == parameters


def test_python_models_read_the_correlation_id_and_flags_not_parameters() -> None:
    request = make_request_with({"sequence_id": -2, "sequence_start": True, "sequence_end": True, "other": 1})
    wrapped = PbRequest._incoming(request, ["OUT"], lambda: None)  # type: ignore[arg-type, return-value]
    assert wrapped.correlation_id() == 2**64 - 2
    assert wrapped.flags() == 3  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START | _END
    assert json.loads(wrapped.parameters()) == {"other": 1}
    plain = PbRequest._incoming(make_request_with({}), ["OUT"], lambda: None)  # type: ignore[arg-type, return-value]
    assert plain.correlation_id() == 0 and plain.flags() == 0
    bls = PbRequest("acc", [], correlation_id="s", flags=2)._to_core()
    assert bls.parameters == {"sequence_id": "s", "sequence_start": False, "sequence_end": True}


# ---- integration: tritonclient against a real server --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("sequence_repo")
    models.accumulator(repo)
    models.accumulator(repo, "accumulator_idle", idle_us=300_000)
    models.accumulator(repo, "accumulator_file", initial_value=100, max_batch_size=0)
    models.accumulator(
        repo, "accumulator_oldest",
        strategy="oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 20000 }",
    )
    models.python_accumulator(repo)
    models.accumulator(repo, "accumulator_state_output", state_output=True)
    with geserve([repo], tmp_path_factory.mktemp("sequence_logs") / "server.log") as running:
        yield running


def http_inputs(value: int, rows: int = 1) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("INPUT", [rows, 1], "INT32")
    tensor.set_data_from_numpy(np.full((rows, 1), value, dtype=np.int32))
    return [tensor]


def grpc_inputs(value: int, shape: tuple[int, ...] = (1, 1)) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("INPUT", list(shape), "INT32")
    tensor.set_data_from_numpy(np.full(shape, value, dtype=np.int32))
    return [tensor]


def outputs_of(result: Any) -> tuple[int, list[int], int]:
    return (int(result.as_numpy("OUTPUT").ravel()[0]), result.as_numpy("CONTROLS").ravel().tolist(),
            int(result.as_numpy("CORRID_OUT").ravel()[0]))


def test_http_interleaved_sequences_on_one_instance(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    steps = [(1001, 1, True, False), (1002, 10, True, False), (1001, 2, False, False), (1002, 20, False, False),
             (1001, 3, False, True), (1002, 30, False, True)]
    seen = [outputs_of(client.infer("accumulator", http_inputs(x), sequence_id=seq, sequence_start=start,
                                    sequence_end=end)) for seq, x, start, end in steps]
    assert seen == [
        (1, [1, 0, 1], 1001), (10, [1, 0, 1], 1002), (3, [0, 0, 1], 1001), (30, [0, 0, 1], 1002),
        (6, [0, 1, 1], 1001), (60, [0, 1, 1], 1002),
    ]


def test_grpc_sequences_with_large_and_restarted_ids(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    big = 2**62 + 7
    first = client.infer("accumulator", grpc_inputs(5), sequence_id=big, sequence_start=True)
    assert outputs_of(first) == (5, [1, 0, 1], big)
    assert outputs_of(client.infer("accumulator", grpc_inputs(5), sequence_id=big))[0] == 10
    # A second START on a live sequence restarts it (Triton warns and goes on in the same slot).
    assert outputs_of(client.infer("accumulator", grpc_inputs(1), sequence_id=big, sequence_start=True))[0] == 1
    last = client.infer("accumulator", grpc_inputs(1), sequence_id=big, sequence_end=True)
    assert outputs_of(last) == (2, [0, 1, 1], big)
    assert "has a conflict. The previous sequence did not end before this sequence start" in server.log()


def test_grpc_streaming_interleaved_sequences(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        expected = {}
        for step in range(4):
            for seq, scale in ((2001, 1), (2002, 100)):
                request_id = f"{seq}-{step}"
                client.async_stream_infer("accumulator", grpc_inputs(scale), request_id=request_id,
                                          sequence_id=seq, sequence_start=step == 0, sequence_end=step == 3)
                expected[request_id] = scale * (step + 1)
        got = {}
        for _ in expected:
            result, error = results.get(timeout=20)
            assert error is None, error
            got[result.get_response().id] = int(result.as_numpy("OUTPUT").ravel()[0])
        assert got == expected
    finally:
        client.stop_stream()


def test_an_initial_state_from_a_file_starts_each_sequence(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    tensor = httpclient.InferInput("INPUT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    for seq in (3001, 3002):
        started = client.infer("accumulator_file", [tensor], sequence_id=seq, sequence_start=True)
        assert int(started.as_numpy("OUTPUT")[0]) == 101
        ended = client.infer("accumulator_file", [tensor], sequence_id=seq, sequence_end=True)
        assert int(ended.as_numpy("OUTPUT")[0]) == 102


def test_an_idle_sequence_is_ended_and_its_next_request_refused(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    client.infer("accumulator_idle", http_inputs(1), sequence_id=4001, sequence_start=True)
    assert outputs_of(client.infer("accumulator_idle", http_inputs(1), sequence_id=4001))[0] == 2
    time.sleep(0.8)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("accumulator_idle", http_inputs(1), sequence_id=4001)
    assert refused.value.status() == "400"
    assert "inference request for sequence 4001 to model 'accumulator_idle' must specify the START flag" in str(
        refused.value)
    # The id starts afresh: its state is gone with the old sequence.
    restarted = client.infer("accumulator_idle", http_inputs(1), sequence_id=4001, sequence_start=True,
                             sequence_end=True)
    assert outputs_of(restarted)[0] == 1


def test_oldest_strategy_serves_concurrent_sequences(server: RunningServer) -> None:
    def run_sequence(seq: int, totals: dict[int, list[int]]) -> None:
        client = httpclient.InferenceServerClient(server.url)
        values = []
        for step in range(6):
            result = client.infer("accumulator_oldest", http_inputs(seq % 10), sequence_id=seq,
                                  sequence_start=step == 0, sequence_end=step == 5)
            values.append(int(result.as_numpy("OUTPUT").ravel()[0]))
        totals[seq] = values

    totals: dict[int, list[int]] = {}
    threads = [threading.Thread(target=run_sequence, args=(seq, totals)) for seq in (5001, 5002, 5003, 5004)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert totals == {seq: [(seq % 10) * (i + 1) for i in range(6)] for seq in (5001, 5002, 5003, 5004)}
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics("accumulator_oldest")
    model = stats["model_stats"][0]
    assert model["inference_stats"]["success"]["count"] == 24
    assert model["inference_count"] == 24
    assert sum(b["compute_infer"]["count"] * b["batch_size"] for b in model["batch_stats"]) == 24


def test_direct_statistics_count_inferences_and_batches_by_slots(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    before = client.get_inference_statistics("accumulator")["model_stats"][0]
    client.infer("accumulator", http_inputs(1), sequence_id=6001, sequence_start=True)
    client.infer("accumulator", http_inputs(1), sequence_id=6002, sequence_start=True)
    client.infer("accumulator", http_inputs(1), sequence_id=6002, sequence_end=True)  # slot 1, a null row in slot 0
    client.infer("accumulator", http_inputs(1), sequence_id=6001, sequence_end=True)
    after = client.get_inference_statistics("accumulator")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 4
    assert after["execution_count"] - before["execution_count"] == 4
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in after["batch_stats"]}
    assert sizes.get(2, 0) >= 2  # 6002's requests ran beside a null request for 6001's slot


def test_python_model_reads_flags_and_correlation_id(server: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def call(value: int, seq: int | str, start: bool = False, end: bool = False) -> tuple[int, int, str]:
        result = client.infer("py_accumulator", grpc_inputs(value), sequence_id=seq, sequence_start=start,
                              sequence_end=end)
        return (int(result.as_numpy("OUTPUT").ravel()[0]), int(result.as_numpy("FLAGS").ravel()[0]),
                result.as_numpy("CORRID").ravel()[0].decode())

    assert call(1, "alpha", start=True) == (1, 1, "alpha")
    assert call(5, 7001, start=True) == (5, 1, "7001")
    assert call(2, "alpha") == (3, 0, "alpha")
    assert call(5, 7001) == (10, 0, "7001")
    assert call(3, "alpha", end=True) == (6, 2, "alpha")
    assert call(4, 7002, start=True, end=True) == (4, 3, "7002")
    metadata = client.get_model_metadata("py_accumulator", as_json=True)
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]  # controls and states are the server's


def test_state_and_controls_are_invisible_to_clients(server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(server.url)
    metadata = client.get_model_metadata("accumulator")
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT", "CONTROLS", "CORRID_OUT"]
    result = client.infer("accumulator", http_inputs(1), sequence_id=8001, sequence_start=True, sequence_end=True)
    assert result.as_numpy("STATE_OUT") is None
    with pytest.raises(InferenceServerException, match="unexpected inference output 'STATE_OUT'"):
        client.infer("accumulator", http_inputs(1), outputs=[httpclient.InferRequestedOutput("STATE_OUT")],
                     sequence_id=8002, sequence_start=True, sequence_end=True)
    config = client.get_model_config("accumulator")
    assert config["sequence_batching"]["max_sequence_idle_microseconds"] == 5_000_000
    assert config["sequence_batching"]["state"][0]["input_name"] == "STATE_IN"


def test_a_state_declared_as_an_output_is_answered_and_still_carried(server: RunningServer) -> None:
    """Triton's ImplicitStateTest.test_request_output: STATE_OUT is both the state and a declared output."""
    client = httpclient.InferenceServerClient(server.url)
    name = "accumulator_state_output"
    assert [t["name"] for t in client.get_model_metadata(name)["outputs"]] == [
        "OUTPUT", "CONTROLS", "CORRID_OUT", "STATE_OUT"]

    def call(x: int, names: list[str] | None, **flags: Any) -> Any:
        outputs = None if names is None else [httpclient.InferRequestedOutput(n) for n in names]
        return client.infer(name, http_inputs(x), outputs=outputs, sequence_id=8101, **flags)

    first = call(1, ["STATE_OUT", "OUTPUT"], sequence_start=True)
    assert int(first.as_numpy("STATE_OUT").ravel()[0]) == 1 and int(first.as_numpy("OUTPUT").ravel()[0]) == 1
    second = call(2, ["OUTPUT"])  # not asked for: not answered, still carried
    assert second.as_numpy("STATE_OUT") is None and int(second.as_numpy("OUTPUT").ravel()[0]) == 3
    last = call(3, None, sequence_end=True)  # every output asked for: the state is one of them
    assert int(last.as_numpy("STATE_OUT").ravel()[0]) == 6 and int(last.as_numpy("OUTPUT").ravel()[0]) == 6


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_triton_errors_through_the_clients(server: RunningServer, protocol: str) -> None:
    if protocol == "http":
        client: Any = httpclient.InferenceServerClient(server.url)
        inputs, batched = http_inputs(1), http_inputs(1, rows=2)
        invalid = "400"
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        inputs, batched = grpc_inputs(1), grpc_inputs(1, (2, 1))
        invalid = "StatusCode.INVALID_ARGUMENT"
    cases = [
        ({}, inputs, "inference request to model 'accumulator' must specify a non-zero or non-empty correlation ID"),
        ({"sequence_id": 9001}, inputs,
         "inference request for sequence 9001 to model 'accumulator' must specify the START flag on the first "
         "request of the sequence"),
        ({"sequence_id": 9002, "sequence_start": True}, batched,
         "inference request to model 'accumulator' must specify batch-size 1 due to requirements of sequence "
         "batcher"),
        ({"sequence_id": "text", "sequence_start": True}, inputs,
         "inference request for sequence text to model 'accumulator' must give an unsigned integer 'sequence_id'"),
    ]
    for arguments, tensors, message in cases:
        with pytest.raises(InferenceServerException) as refused:
            client.infer("accumulator", tensors, **arguments)
        assert refused.value.status() == invalid
        assert message in refused.value.message()


def test_sequence_parameters_of_the_wrong_wire_type(server: RunningServer) -> None:
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [1]}],
            "parameters": {"sequence_id": 9101, "sequence_start": "yes"}}
    post = urllib.request.Request(server.base + "/v2/models/accumulator/infer", json.dumps(body).encode(),
                                  {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(post, timeout=10)
    assert refused.value.code == 400
    assert json.loads(refused.value.read())["error"] == (
        "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean"
    )
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="accumulator")
        tensor = request.inputs.add(name="INPUT", datatype="INT32", shape=[1, 1])
        tensor.contents.int_contents.append(1)
        request.parameters["sequence_id"].uint64_param = 9102
        with pytest.raises(grpc.RpcError) as wrong:
            stub.ModelInfer(request, timeout=10)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wrong.value.details() == (
            "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."
        )


# ---- a real stateful model: Silero VAD, streamed --------------------------------------------------------------


def _synthetic_speech(seed: int, chunks: int) -> np.ndarray:
    """16 kHz audio with speech-like bursts (a voiced harmonic series, amplitude-modulated) between quiet gaps."""
    rng = np.random.default_rng(seed)
    t = np.arange(chunks * 512) / 16000
    pitch = 110 + 30 * seed
    voiced = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 12))
    envelope = (np.sin(2 * np.pi * 1.5 * t + seed) > 0).astype(np.float64)
    audio = 0.3 * voiced * envelope * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)) + 0.003 * rng.standard_normal(t.size)
    return audio.astype(np.float32)


def _chunks(audio: np.ndarray) -> list[np.ndarray]:
    """Silero's own wrapper feeds each 512-sample chunk with the previous chunk's last 64 samples in front."""
    context = np.zeros(64, dtype=np.float32)
    out = []
    for start in range(0, audio.size, 512):
        chunk = audio[start:start + 512]
        out.append(np.concatenate([context, chunk])[np.newaxis, :])
        context = chunk[-64:]
    return out


def test_silero_vad_streamed_over_grpc_matches_a_direct_onnx_runtime_loop(tmp_path: Path) -> None:
    pytest.importorskip("silero_vad")
    import onnxruntime as ort

    repo = tmp_path / "repo"
    model_dir = models.silero_vad(repo)
    streams = {seed: _chunks(_synthetic_speech(seed, 40)) for seed in (1, 2, 3)}
    session = ort.InferenceSession(str(model_dir / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    expected: dict[int, list[float]] = {}
    for seed, chunks in streams.items():
        state = np.zeros((2, 1, 128), dtype=np.float32)
        expected[seed] = []
        for chunk in chunks:
            probability, state = session.run(None, {"input": chunk, "state": state, "sr": np.array(16000)})
            expected[seed].append(float(probability.ravel()[0]))
    assert max(max(p) for p in expected.values()) > 0.5  # the bursts read as speech: the state matters

    with geserve([repo], tmp_path / "server.log") as running:
        client = grpcclient.InferenceServerClient(running.grpc_url)
        results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            for index in range(40):  # the three streams interleaved on one stream, one instance
                for seed, chunks in streams.items():
                    audio = grpcclient.InferInput("input", list(chunks[index].shape), "FP32")
                    audio.set_data_from_numpy(chunks[index])
                    rate = grpcclient.InferInput("sr", [1], "INT64")
                    rate.set_data_from_numpy(np.array([16000], dtype=np.int64))
                    client.async_stream_infer("silero_vad", [audio, rate], request_id=f"{seed}:{index}",
                                              sequence_id=100 + seed, sequence_start=index == 0,
                                              sequence_end=index == 39)
            got: dict[int, dict[int, float]] = {seed: {} for seed in streams}
            for _ in range(40 * len(streams)):
                result, error = results.get(timeout=60)
                assert error is None, error
                seed, index = map(int, result.get_response().id.split(":"))
                got[seed][index] = float(result.as_numpy("output").ravel()[0])
        finally:
            client.stop_stream()
    for seed in streams:
        assert np.allclose([got[seed][i] for i in range(40)], expected[seed], atol=1e-5), seed
