"""The ensemble scheduler: runs an ensemble's steps as a DAG, each step through its model's own data-plane path.

A step starts as soon as every tensor it reads exists, so independent branches run concurrently. Each step is a
plain inference request to the data plane (`InferenceHost.infer`): validation, the step model's scheduler (its
dynamic batcher included) and its statistics all apply. Tensors pass between steps as the same numpy arrays.

An ensemble with a decoupled step is decoupled itself, as in Triton: each response of that step runs the steps
after it once more, and each such run that completes the ensemble's outputs is one response of the ensemble.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from geserve.backends.base import InferenceHost
from geserve.errors import GeserveError, InternalError, InvalidArgumentError
from geserve.scheduling.ensemble_plan import EnsemblePlan, Route, StepPlan
from geserve.scheduling.inflight import InflightTracker
from geserve.statistics import ModelStatistics
from geserve.types import ComputeTimes, InferenceRequest, InferenceResponse, InputTensor, RequestedOutput
from geserve.types.streams import StreamResponse

# An ensemble tensor's value and the batch size of the request that made it (0: made without batching).
_Value = tuple[InputTensor | None, int]


@dataclass(frozen=True, slots=True)
class EnsembleSetup:
    """What `create_scheduler` needs to build an ensemble's scheduler."""

    plan: EnsemblePlan
    host: InferenceHost
    statistics: ModelStatistics


def _dims_match(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d == -1 or d == s for d, s in zip(dims, shape, strict=True))


def _adapt(tensor: InputTensor, name: str, dims: tuple[int, ...], batching: bool, batch: int) -> InputTensor:
    """`tensor` under `name`, moved between batching and non-batching shapes the way Triton's ensembles do it:
    a batching model gets a batch of 1 from a non-batching one; a non-batching model gets a batch of 1 without its
    batch dimension when its dims need that. The data is the same array (a reshape is a view)."""
    shape = tensor.shape
    if batching != (batch != 0):
        if batching and _dims_match(dims, shape):
            shape = (1, *shape)
        elif not batching and batch == 1 and not _dims_match(dims, shape):
            shape = shape[1:]
    data = tensor.data if shape == tensor.shape else tensor.data.reshape(shape)
    return InputTensor(name, tensor.datatype, shape, data)


def _in_ensemble(name: str, error: BaseException) -> GeserveError:
    """A step's error as the ensemble's, in Triton's wording; its status code stays the step's."""
    # Triton counts an ensemble's failures under OTHER, whatever failed in its steps.
    if isinstance(error, GeserveError):
        return type(error)(f"in ensemble '{name}', {error.message}", failure_reason="OTHER")
    return InternalError(f"in ensemble '{name}', {type(error).__name__}: {error}", failure_reason="OTHER")


class EnsembleScheduler:
    def __init__(self, plan: EnsemblePlan, host: InferenceHost, statistics: ModelStatistics) -> None:
        self._plan = plan
        self._host = host
        self._statistics = statistics
        self._inflight = InflightTracker()

    @property
    def inflight_count(self) -> int:
        return self._inflight.count

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse | None:
        """The response; for a decoupled ensemble, None once every response went to `request.stream`."""
        self._inflight.enter(request.model_name)
        try:
            if self._plan.decoupled:
                await self._stream(request)
                return None
            return await self._run(request)
        finally:
            self._inflight.leave()

    async def stop(self) -> None:
        """Let the ensemble requests in flight finish; there are no instances to release."""
        await self._inflight.drain()

    async def _run(self, request: InferenceRequest) -> InferenceResponse:
        plan = self._plan
        enqueued = time.monotonic_ns()
        wanted, values = self._start(request)
        route = plan.route(frozenset(wanted))
        waiting = {i: sum(1 for t in plan.steps[i].reads if t not in values) for i in route.steps}
        sink = ComputeTimes()
        started = time.monotonic_ns()
        await self._execute(request, route, values, waiting, sink)
        response = self._response(request, wanted, [values.get(name, (None, 0)) for name in wanted])
        self._record(request, enqueued, started, sink)
        return response

    def _start(self, request: InferenceRequest) -> tuple[tuple[str, ...], dict[str, _Value]]:
        """The outputs `request` wants, in order, and its inputs as ensemble tensors (optional ones left out: None)."""
        plan = self._plan
        wanted = tuple(dict.fromkeys(o.name for o in request.outputs)) if request.outputs else plan.outputs
        batch = request.batch_size if plan.batching else 0
        values: dict[str, _Value] = {t.name: (t, batch) for t in request.inputs}
        for name in plan.optional_inputs:
            values.setdefault(name, (None, batch))
        return wanted, values

    def _response(self, request: InferenceRequest, wanted: tuple[str, ...], values: list[_Value]) -> InferenceResponse:
        plan = self._plan
        outputs = []
        for name, (tensor, made_with) in zip(wanted, values, strict=True):
            if tensor is None:
                raise InvalidArgumentError(
                    f"in ensemble '{plan.name}', [request id: {request.id or '<id_unknown>'}] unexpected deadlock, "
                    f"at least one output is not set while no more ensemble steps can be made"
                )
            outputs.append(_adapt(tensor, name, plan.output_dims[name], plan.batching, made_with))
        return InferenceResponse(request.model_name, request.model_version, outputs, id=request.id)

    def _record(self, request: InferenceRequest, enqueued: int, started: int, sink: ComputeTimes) -> None:
        self._statistics.record_execution(
            1, request.batch_size, [started - enqueued], sink.input_ns, sink.infer_ns, sink.output_ns
        )
        if request.compute is not None:  # an ensemble inside an ensemble: the outer one reports this compute
            request.compute.add_times(sink)

    async def _stream(self, request: InferenceRequest) -> None:
        """Run a decoupled ensemble: each response of a decoupled step opens a scope in which the steps after it
        run once more; each completed run of the route's emitting scope is one response on `request.stream`.

        The first step failure cancels the request's other tasks and fails the request. A response goes out
        flagged final when nothing else of the request is still running; otherwise the final flag follows alone
        once everything has finished."""
        plan = self._plan
        enqueued = time.monotonic_ns()
        wanted, given = self._start(request)
        route = plan.route(frozenset(wanted))
        stream = request.stream
        loop = asyncio.get_running_loop()
        sink = ComputeTimes()
        tasks: set[asyncio.Task[None]] = set()
        live = [0]  # tasks still running; unlike `tasks`, counted down the moment one ends
        failures: list[BaseException] = []
        finished: asyncio.Future[None] = loop.create_future()

        def settled(value: _Value) -> asyncio.Future[_Value]:
            future: asyncio.Future[_Value] = loop.create_future()
            future.set_result(value)
            return future

        async def tracked(work: Coroutine[Any, Any, None]) -> None:
            try:
                await work
            finally:
                live[0] -= 1

        def spawn(work: Coroutine[Any, Any, None]) -> None:
            live[0] += 1
            task = loop.create_task(tracked(work))
            tasks.add(task)
            task.add_done_callback(ended)

        def ended(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None and not failures:
                failures.append(task.exception())
                for other in tasks:
                    other.cancel()
            if not tasks and not finished.done():
                finished.set_result(None)

        def open_scope(parent: _Scope | None, scope: int | None, given: dict[str, _Value]) -> None:
            tensors = {name: settled(value) for name, value in given.items()}
            for index in route.scope_steps.get(scope, ()):
                step = plan.steps[index]
                if not step.decoupled:  # a decoupled step's outputs live in the scopes its responses open
                    for output in route.step_outputs[index]:
                        tensors[step.outputs[output]] = loop.create_future()
            here = _Scope(parent, tensors)
            for index in route.scope_steps.get(scope, ()):
                spawn(run_step(plan.steps[index], here))
            if scope == route.emit_scope:
                spawn(emit(here))

        async def run_step(step: StepPlan, scope: _Scope) -> None:
            values = [await scope.get(item.tensor) for item in step.inputs]
            step_request = self._step_request(step, route, request, values, sink)
            if not step.decoupled:
                response = await self._host.infer(step_request)
                for tensor, value in self._produced(step, route, step_request, response).items():
                    scope.tensors[tensor].set_result(value)
                return
            async for item in self._host.infer_stream(step_request):
                if item.error is not None:
                    raise item.error
                if item.response is not None:
                    open_scope(scope, step.index, self._produced(step, route, step_request, item.response))

        async def emit(scope: _Scope) -> None:
            response = self._response(request, wanted, [await scope.get(name) for name in wanted])
            stream.send(StreamResponse(response, final=live[0] == 1))

        started = time.monotonic_ns()
        open_scope(None, None, given)
        try:
            await finished
        except BaseException:
            # The ensemble request itself was cancelled: its steps go with it.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if failures:
            raise _in_ensemble(plan.name, failures[0])
        if not stream.final_sent:
            stream.send(StreamResponse(None, final=True))
        self._record(request, enqueued, started, sink)

    async def _execute(
        self,
        request: InferenceRequest,
        route: Route,
        values: dict[str, _Value],
        waiting: dict[int, int],
        sink: ComputeTimes,
    ) -> None:
        """Start each step once its inputs exist; raise the first step error once no step is in flight.

        An intermediate tensor is dropped once the last step reading it has finished, so a long pipeline holds
        only the tensors still to be read, as Triton frees them."""
        plan = self._plan
        ready = [index for index, count in waiting.items() if count == 0]
        tasks: dict[asyncio.Task, int] = {}
        error: BaseException | None = None
        unread = dict(route.releasable)

        def produced(index: int, result: dict[str, _Value]) -> None:
            for tensor in plan.steps[index].reads:
                if tensor in unread:
                    unread[tensor] -= 1
                    if unread[tensor] == 0:
                        values.pop(tensor, None)
            for tensor, value in result.items():
                values[tensor] = value
                for index in plan.consumers.get(tensor, ()):
                    if index in waiting:
                        waiting[index] -= 1
                        if waiting[index] == 0:
                            ready.append(index)

        try:
            while ready or tasks:
                if len(ready) == 1 and not tasks:
                    # One step and none in flight (a chain): awaited here, without a task to schedule.
                    index = ready.pop()
                    try:
                        result = await self._run_step(plan.steps[index], route, request, values, sink)
                    except Exception as exc:
                        error = exc
                        break
                    produced(index, result)
                    continue
                for index in ready:
                    step = self._run_step(plan.steps[index], route, request, values, sink)
                    tasks[asyncio.ensure_future(step)] = index
                ready.clear()
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = tasks.pop(task)
                    if task.exception() is not None:
                        error = error or task.exception()
                    elif error is None:
                        produced(index, task.result())
                if error is not None:
                    ready.clear()  # no new steps once one failed; the ones in flight are waited for
        except BaseException:
            # The ensemble request itself was cancelled: its steps go with it.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if error is not None:
            raise _in_ensemble(plan.name, error)

    async def _run_step(
        self, step: StepPlan, route: Route, request: InferenceRequest, values: dict[str, _Value], sink: ComputeTimes
    ) -> dict[str, _Value]:
        step_request = self._step_request(step, route, request, [values[item.tensor] for item in step.inputs], sink)
        return self._produced(step, route, step_request, await self._host.infer(step_request))

    def _step_request(
        self, step: StepPlan, route: Route, request: InferenceRequest, values: list[_Value], sink: ComputeTimes
    ) -> InferenceRequest:
        """`values` are those of `step.inputs`, in order."""
        inputs = []
        for item, (tensor, made_with) in zip(step.inputs, values, strict=True):
            if tensor is not None:  # absent: an optional input left out, as Triton leaves it out
                inputs.append(_adapt(tensor, item.model_input, item.dims, step.batching, made_with))
        return InferenceRequest(
            step.model,
            step.version,
            inputs,
            outputs=[RequestedOutput(name) for name in route.step_outputs[step.index]],
            id=request.id,
            parameters=request.parameters,
            priority=request.priority,
            timeout_us=request.timeout_us,
            compute=sink,
        )

    @staticmethod
    def _produced(
        step: StepPlan, route: Route, step_request: InferenceRequest, response: InferenceResponse
    ) -> dict[str, _Value]:
        made_with = step_request.batch_size if step.batching else 0
        produced: dict[str, _Value] = {step.outputs[o]: (None, made_with) for o in route.step_outputs[step.index]}
        for output in response.outputs:
            tensor = step.outputs.get(output.name)
            if tensor is not None:
                produced[tensor] = (output, made_with)
        return produced


class _Scope:
    """The tensors of one run of a scope (see StepPlan.scope); those of enclosing runs are read through `parent`."""

    __slots__ = ("parent", "tensors")

    def __init__(self, parent: _Scope | None, tensors: dict[str, asyncio.Future[_Value]]) -> None:
        self.parent = parent
        self.tensors = tensors

    async def get(self, name: str) -> _Value:
        scope: _Scope | None = self
        while scope is not None:
            future = scope.tensors.get(name)
            if future is not None:
                return await future
            scope = scope.parent
        return None, 0

