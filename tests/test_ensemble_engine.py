"""The ensemble engine in pure asyncio: step models are Python functions behind a fake host (no server, no ONNX)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from geserve.config import ModelConfig, fill_defaults, parse_config_text
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.scheduling.ensemble import EnsembleScheduler
from geserve.scheduling.ensemble_plan import EnsemblePlan
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, OutputTensor
from geserve.types.streams import ResponseStream, StreamResponse
from tests.support.ensembles import Ensemble, Step

Arrays = dict[str, np.ndarray]
Plain = Callable[[Arrays], Awaitable[Arrays]]
Streaming = Callable[[Arrays], AsyncIterator[Arrays]]
I32 = "TYPE_INT32"


class FakeHost:
    """Runs each step model as a function: plain ones as coroutines, decoupled ones as async generators of outputs.

    Records the task each plain call ran in (by name: a task held would hold its result) and each decoupled step's
    stream as it closes."""

    loop: asyncio.AbstractEventLoop | None = None

    def __init__(self, plain: dict[str, Plain], streaming: dict[str, Streaming] | None = None,
                 final_alone: bool = True) -> None:
        self.plain = plain
        self.streaming = streaming or {}
        self.final_alone = final_alone  # else the final flag rides on the last response
        self.tasks: list[str] = []
        self.closed: list[str] = []

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        self.tasks.append(_task_name())
        return _response(request, await self.plain[request.model_name](_arrays(request)))

    async def infer_stream(self, request: InferenceRequest) -> AsyncIterator[StreamResponse]:
        held: Arrays | None = None  # to send with the final flag
        try:
            async for outputs in self.streaming[request.model_name](_arrays(request)):
                if self.final_alone:
                    yield StreamResponse(_response(request, outputs))
                    continue
                if held is not None:
                    yield StreamResponse(_response(request, held))
                held = outputs
            if held is not None:
                yield StreamResponse(_response(request, held), final=True)
            else:
                await asyncio.sleep(0.05)  # after the steps that follow have run
                yield StreamResponse(None, final=True)
        finally:
            self.closed.append(request.model_name)


def _task_name() -> str:
    task = asyncio.current_task()
    assert task is not None
    return task.get_name()


def _arrays(request: InferenceRequest) -> Arrays:
    return {t.name: t.data for t in request.inputs}


def _response(request: InferenceRequest, outputs: Arrays) -> InferenceResponse:
    wanted = {o.name for o in request.outputs or ()}
    tensors = [OutputTensor(n, "INT32", a.shape, a) for n, a in outputs.items() if not wanted or n in wanted]
    return InferenceResponse(request.model_name, "1", tensors, id=request.id)


def _model(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], decoupled: bool = False) -> ModelConfig:
    def io(names: tuple[str, ...]) -> str:
        return ", ".join(f'{{ name: "{n}" data_type: {I32} dims: [ -1 ] }}' for n in names)

    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    text = f'name: "{name}" backend: "python" max_batch_size: 0 input [ {io(inputs)} ] output [ {io(outputs)} ]'
    return parse_config_text(f"{text} {policy}", "step")


def _scheduler(ensemble: Ensemble, models: list[ModelConfig], host: FakeHost) -> EnsembleScheduler:
    config = parse_config_text(ensemble.config(), "test")
    fill_defaults(config, 0, "")
    plan = EnsemblePlan.build(config, {m.name: m for m in models})
    return EnsembleScheduler(plan, host, ModelStatistics())


def _request(name: str, values: list[int], stream: bool = False) -> InferenceRequest:
    data = np.array(values, np.int32)
    request = InferenceRequest(name, "1", [InputTensor("IN", "INT32", data.shape, data)], id="r1")
    if stream:
        request.stream = ResponseStream(asyncio.get_running_loop())
    return request


async def _streamed(request: InferenceRequest) -> list[tuple[dict[str, list[int]] | None, bool]]:
    """What `request` streamed, in order: (outputs, final) each; None for a final flag sent alone."""
    assert request.stream is not None
    read = []
    async for item in request.stream:
        outputs = None if item.response is None else {o.name: o.data.tolist() for o in item.response.outputs}
        read.append((outputs, item.final))
    return read


def _run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def _inc(arrays: Arrays) -> Arrays:
    await asyncio.sleep(0)
    return {"Y": arrays["X"] + 1}


async def _split(arrays: Arrays) -> AsyncIterator[Arrays]:
    for value in arrays["IN"].tolist():
        await asyncio.sleep(0)
        yield {"OUT": np.array([value], np.int32)}


INC = _model("inc", ("X",), ("Y",))
SPLIT = _model("split", ("IN",), ("OUT",), decoupled=True)
ONE = (-1,)


def test_a_chain_runs_every_step_in_the_requests_own_task() -> None:
    """The plain hot path: steps that run one after the other are awaited inline, with no task of their own."""
    ensemble = Ensemble("chain3", [("IN", I32, ONE)], [("Y", I32, ONE)], [
        Step("inc", {"X": "IN"}, {"Y": "a"}), Step("inc", {"X": "a"}, {"Y": "b"}), Step("inc", {"X": "b"}, {"Y": "Y"}),
    ], max_batch_size=0)

    async def test() -> None:
        host = FakeHost({"inc": _inc})
        response = await _scheduler(ensemble, [INC], host).enqueue(_request("chain3", [1, 2]))
        assert [o.data.tolist() for o in response.outputs] == [[4, 5]]
        assert host.tasks == [_task_name()] * 3

    _run(test)


def test_each_run_drops_its_intermediates_and_keeps_what_later_runs_read() -> None:
    """IN -> split (decoupled) -> OUT; per response: OUT -> big -> BIG -> total -> T; plus(T, N) -> S, where
    N = count(IN) is made once, in the request's run, after split's responses: every run waits for it, reads it,
    and by then has let go of its own BIG."""
    refs: dict[int, weakref.ref[np.ndarray]] = {}  # by the value split sent
    freed: list[bool] = []

    async def big(arrays: Arrays) -> Arrays:
        y = np.full(1000, arrays["X"][0], np.int32)
        refs[int(arrays["X"][0])] = weakref.ref(y)
        return {"Y": y}

    async def total(arrays: Arrays) -> Arrays:
        return {"Y": np.array([arrays["X"].sum()], np.int32)}

    async def count(arrays: Arrays) -> Arrays:
        await asyncio.sleep(0.05)
        return {"Y": np.array([arrays["X"].size], np.int32)}

    async def plus(arrays: Arrays) -> Arrays:
        gc.collect()
        freed.append(refs[int(arrays["A"][0]) // 1000]() is None)
        return {"S": arrays["A"] + arrays["B"]}

    ensemble = Ensemble("runs", [("IN", I32, ONE)], [("S", I32, ONE)], [
        Step("split", {"IN": "IN"}, {"OUT": "o"}),
        Step("big", {"X": "o"}, {"Y": "BIG"}),
        Step("total", {"X": "BIG"}, {"Y": "t"}),
        Step("count", {"X": "IN"}, {"Y": "n"}),
        Step("plus", {"A": "t", "B": "n"}, {"S": "S"}),
    ], max_batch_size=0)
    steps = [_model(m, ("X",), ("Y",)) for m in ("big", "total", "count")]
    models = [SPLIT, _model("plus", ("A", "B"), ("S",)), *steps]

    async def test() -> None:
        host = FakeHost({"big": big, "total": total, "count": count, "plus": plus}, {"split": _split})
        request = _request("runs", [1, 2, 3], stream=True)
        assert (await _scheduler(ensemble, models, host).enqueue(request)).outputs == []
        streamed = await _streamed(request)
        assert sorted(outputs["S"] for outputs, _ in streamed if outputs) == [[1003], [2003], [3003]]
        assert freed == [True] * 3 and sorted(refs) == [1, 2, 3]
        assert host.closed == ["split"]

    _run(test)


@pytest.mark.parametrize("final_alone", [False, True])
def test_the_final_flag_rides_on_the_last_response_unless_the_decoupled_step_sends_it_alone(final_alone: bool) -> None:
    ensemble = Ensemble("split_inc", [("IN", I32, ONE)], [("Y", I32, ONE)], [
        Step("split", {"IN": "IN"}, {"OUT": "o"}), Step("inc", {"X": "o"}, {"Y": "Y"}),
    ], max_batch_size=0)

    async def test() -> None:
        host = FakeHost({"inc": _inc}, {"split": _split}, final_alone=final_alone)
        request = _request("split_inc", [1, 2], stream=True)
        await _scheduler(ensemble, [SPLIT, INC], host).enqueue(request)
        streamed = await _streamed(request)
        assert sorted(outputs["Y"] for outputs, _ in streamed if outputs) == [[2], [3]]
        if final_alone:  # the decoupled step was still open when the last run answered
            assert [final for _, final in streamed] == [False, False, True] and streamed[2][0] is None
        else:
            assert [final for _, final in streamed] == [False, True]
        assert host.closed == ["split"]

    _run(test)


def test_a_failing_step_lets_running_steps_finish_and_stops_reading_the_decoupled_one() -> None:
    """split sends 5 (a slow inc) and 99 (refused at once), then would stream on: the error waits for inc(5), whose
    run no longer answers, and split's stream is cancelled."""
    finished: list[int] = []

    async def inc(arrays: Arrays) -> Arrays:
        value = int(arrays["X"][0])
        if value == 99:
            raise InvalidArgumentError("inc refuses 99")
        await asyncio.sleep(0.05)
        finished.append(value)
        return {"Y": arrays["X"] + 1}

    async def split(arrays: Arrays) -> AsyncIterator[Arrays]:
        async for outputs in _split(arrays):
            yield outputs
        await asyncio.sleep(3600)

    ensemble = Ensemble("failing", [("IN", I32, ONE)], [("Y", I32, ONE)], [
        Step("split", {"IN": "IN"}, {"OUT": "o"}), Step("inc", {"X": "o"}, {"Y": "Y"}),
    ], max_batch_size=0)

    async def test() -> None:
        host = FakeHost({"inc": inc}, {"split": split})
        request = _request("failing", [5, 99], stream=True)
        with pytest.raises(GeserveError) as caught:
            await asyncio.wait_for(_scheduler(ensemble, [SPLIT, INC], host).enqueue(request), 5)
        assert isinstance(caught.value, InvalidArgumentError) and caught.value.failure_reason == "OTHER"
        assert caught.value.message == "in ensemble 'failing', inc refuses 99"
        assert finished == [5] and host.closed == ["split"]
        assert request.stream is not None and request.stream.fail(caught.value)  # nothing went out before it
        assert await _streamed(request) == [(None, True)]

    _run(test)


def test_cancelling_the_request_cancels_its_running_steps() -> None:
    cancelled: list[str] = []

    async def forever(arrays: Arrays) -> Arrays:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("step")
            raise
        return arrays

    ensemble = Ensemble("wide", [("IN", I32, ONE)], [("P", I32, ONE), ("Q", I32, ONE)], [
        Step("forever", {"X": "IN"}, {"Y": "P"}), Step("forever", {"X": "IN"}, {"Y": "Q"}),
    ], max_batch_size=0)

    async def test() -> None:
        scheduler = _scheduler(ensemble, [_model("forever", ("X",), ("Y",))], FakeHost({"forever": forever}))
        task = asyncio.create_task(scheduler.enqueue(_request("wide", [1])))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cancelled == ["step", "step"] and scheduler.inflight_count == 0

    _run(test)
