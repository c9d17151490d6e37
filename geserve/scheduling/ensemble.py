"""The ensemble scheduler: runs an ensemble's steps as a DAG, each step through its model's own path in the service.

A step starts as soon as every tensor it reads exists, so independent branches run concurrently. Each step is a
plain inference request to the service (`InferenceHost.infer`; `infer_stream` for a decoupled step): validation,
the step model's scheduler (its dynamic batcher included) and its statistics all apply. Tensors pass between steps
as the same numpy arrays. The request opens one run of the steps that follow no decoupled step (see `StepPlan.scope`)
and each response of a decoupled step one run of the steps after it; each completed run of the answering scope is a
response: a plain ensemble's one run is its response, a decoupled ensemble streams them to `request.stream`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field

from geserve.backends.base import InferenceHost
from geserve.config.ensemble import is_ensemble
from geserve.errors import DeadlineExceededError, GeserveError, InternalError, InvalidArgumentError
from geserve.scheduling.ensemble_plan import EnsemblePlan, StepPlan
from geserve.scheduling.inflight import InflightTracker
from geserve.scheduling.scheduler import AnswersLater, Scheduler, SchedulerKind, SchedulerParts
from geserve.statistics import ModelStatistics
from geserve.types import ComputeTimes, InferenceRequest, InferenceResponse, InputTensor, RequestedOutput, id_prefix
from geserve.types.streams import StreamResponse

# An ensemble tensor's value and the batch size of the request that made it (0: made without batching).
_Value = tuple[InputTensor | None, int]
# What one call of a step made (None: nothing, as a final flag sent alone) and whether the step is done.
_Made = tuple[dict[str, _Value] | None, bool]
# Where a run of the answering scope waits for the requested outputs, beside its steps' indexes.
_ANSWER = -1
_ENDED = StreamResponse(None, final=True)  # a stream that ends without the final flag: as if it came alone
# Decoupled steps' streams being closed after their ensemble failed (kept referenced until they are).
_CLOSING: set[asyncio.Task[None]] = set()


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


class EnsembleScheduler(AnswersLater):
    def __init__(self, plan: EnsemblePlan, host: InferenceHost, statistics: ModelStatistics) -> None:
        self._plan = plan
        self._host = host
        self._statistics = statistics
        self._inflight = InflightTracker()

    def queue_timeout_us(self, request: InferenceRequest) -> int:
        """None: as in Triton, the `timeout` parameter goes to every step, each its own queue timeout there."""
        return 0

    @property
    def inflight_count(self) -> int:
        return self._inflight.count

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        """The response; for a decoupled ensemble, an empty one once every response went to `request.stream` (as a
        decoupled Python model answers)."""
        self._inflight.enter(request.model_name)
        try:
            enqueued = time.monotonic_ns()
            execution = _Execution(self._plan, self._host, request)
            started = time.monotonic_ns()
            response = await execution.run()
            compute = execution.compute
            self._statistics.record_execution(
                1, request.batch_size, [started - enqueued], compute.input_ns, compute.infer_ns, compute.output_ns
            )
            if request.compute is not None:  # an ensemble inside an ensemble: the outer one reports this compute
                request.compute.add_times(compute)
            return response
        finally:
            self._inflight.leave()

    async def stop(self) -> None:
        """Let the ensemble requests in flight finish; there are no instances to release."""
        await self._inflight.drain()


@dataclass(slots=True)
class _Run:
    """One run of a scope: the tensors made in it (those of enclosing runs are read through `parent`)."""

    parent: _Run | None
    scope: int | None
    values: dict[str, _Value]
    unread: dict[str, int]  # tensor -> readers in this run yet to finish (see Route.releasable)
    waiting: dict[int, int] = field(default_factory=dict)  # step (or _ANSWER) -> tensors it still waits for
    watchers: dict[str, list[tuple[_Run, int]]] = field(default_factory=dict)  # tensor to be made here -> waiting


@dataclass(slots=True)
class _Call:
    """One step's request in one run; a decoupled step's call is read once per response until its last."""

    run: _Run
    step: StepPlan
    request: InferenceRequest
    responses: AsyncGenerator[StreamResponse, None] | None = None


class _Execution:
    """One ensemble request: its runs, the calls ready to go and in flight, and the first failure.

    After a failure no step starts and no response goes out; steps already running finish first, except that a
    decoupled step is no longer read (its stream is cancelled: it may run on for long)."""

    __slots__ = ("_answered", "_error", "_host", "_plan", "_ready", "_request", "_response", "_route", "_tasks",
                 "_wanted", "compute")

    def __init__(self, plan: EnsemblePlan, host: InferenceHost, request: InferenceRequest) -> None:
        self._plan = plan
        self._host = host
        self._request = request
        self._wanted = tuple(dict.fromkeys(o.name for o in request.outputs)) if request.outputs else plan.outputs
        self._route = plan.route(frozenset(self._wanted))
        self.compute = ComputeTimes()  # the steps' compute, added by their schedulers
        self._ready: list[_Call] = []
        self._tasks: dict[asyncio.Task[_Made], _Call] = {}
        self._answered: list[_Run] = []  # runs whose requested outputs all exist, to answer with
        self._error: GeserveError | None = None
        self._response: InferenceResponse | None = None

    async def run(self) -> InferenceResponse:
        plan, request = self._plan, self._request
        batch = request.batch_size if plan.batching else 0
        given: dict[str, _Value] = {t.name: (t, batch) for t in request.inputs}
        for name in plan.optional_inputs:  # left out: None, as Triton leaves them out of the steps
            given.setdefault(name, (None, batch))
        root = self._open(None, None, given)
        await self._drive()
        if self._error is not None:
            raise self._error
        stream = request.stream
        if stream is None:
            # Its one run answered, unless an output never came: then this raises Triton's deadlock error.
            return self._response if self._response is not None else self._respond(root)
        if not stream.final_sent:
            stream.send(StreamResponse(None, final=True))
        return InferenceResponse(request.model_name, request.model_version, [], id=request.id)

    async def _drive(self) -> None:
        """Start each call once its inputs exist, until none is ready or in flight."""
        ready, tasks = self._ready, self._tasks
        try:
            while ready or tasks:
                if len(ready) == 1 and not tasks:
                    # One call and none in flight (a chain): awaited here, without a task to schedule.
                    call = ready.pop()
                    try:
                        made, done = await self._advance(call)
                    except Exception as exc:
                        self._fail(_in_ensemble(self._plan.name, exc))
                    else:
                        self._settle(call, made, done)
                else:
                    await self._run_concurrently()
                self._answer()
        except BaseException:
            # The ensemble request itself was cancelled, or a run found an output missing: its steps go with it.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _run_concurrently(self) -> None:
        """Start the ready calls as tasks and settle those that finish first."""
        tasks = self._tasks
        for call in self._ready:
            tasks[asyncio.create_task(self._advance(call))] = call
        self._ready.clear()
        # Returning drops `finished`: a finished task holds what its step made until the task goes.
        finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in finished:
            call = tasks.pop(task)
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None:
                self._fail(_in_ensemble(self._plan.name, error))
            elif self._error is None:
                self._settle(call, *task.result())

    async def _advance(self, call: _Call) -> _Made:
        """Run `call`'s step, or read a decoupled step's next response."""
        step, request = call.step, call.request
        if not step.decoupled:
            return self._made(step, request, await self._host.infer(request)), True
        if call.responses is None:
            call.responses = self._host.infer_stream(request)
        item = await anext(call.responses, _ENDED)
        if item.error is not None:
            await call.responses.aclose()  # the step's failure is counted now, not when the collector finds its stream
            raise item.error
        if item.final:
            await anext(call.responses, None)  # read on to the stream's end, where the host closes the step's request
        return (None if item.response is None else self._made(step, request, item.response)), item.final

    def _settle(self, call: _Call, made: dict[str, _Value] | None, done: bool) -> None:
        if made is not None:
            if call.step.decoupled:
                self._open(call.run, call.step.index, made)
            else:
                self._set(call.run, made)
        if not done:
            self._ready.append(call)  # a decoupled step: read its next response
            return
        # An intermediate tensor is dropped once the last step reading it has finished, as Triton frees it.
        unread = call.run.unread
        for tensor in call.step.reads:
            if tensor in unread:
                unread[tensor] -= 1
                if unread[tensor] == 0:
                    call.run.values.pop(tensor, None)

    def _fail(self, error: GeserveError) -> None:
        if self._error is None:
            # A step that failed once the ensemble's own deadline had passed failed by it: the ensemble's timer and
            # its step's are due together, and whichever runs first, the ensemble counts its own deadline.
            deadline = self._request.deadline
            passed = deadline is not None and deadline <= time.monotonic()
            self._error = DeadlineExceededError() if passed else error
        # A decoupled step between two of its responses is let go with the ready calls: its stream is closed now, so
        # that its request is cancelled and counted now, not whenever the collector finds it.
        for call in self._ready:
            if call.responses is not None:
                closing = asyncio.ensure_future(call.responses.aclose())
                _CLOSING.add(closing)
                closing.add_done_callback(_CLOSING.discard)
        self._ready.clear()
        self._answered.clear()
        for task, call in self._tasks.items():
            if call.responses is not None:
                task.cancel()

    def _open(self, parent: _Run | None, scope: int | None, given: dict[str, _Value]) -> _Run:
        """A new run of `scope` holding `given`; its steps start once what they read exists."""
        route = self._route
        run = _Run(parent, scope, given, dict(route.releasable))
        for index in route.scope_steps.get(scope, ()):
            self._wait(run, index, self._plan.steps[index].reads)
        if scope == route.emit_scope:
            self._wait(run, _ANSWER, self._wanted)
        return run

    def _wait(self, run: _Run, index: int, reads: Iterable[str]) -> None:
        missing = 0
        for tensor in reads:
            holder = self._holder(run, tensor)
            if tensor not in holder.values:
                missing += 1
                holder.watchers.setdefault(tensor, []).append((run, index))
        if missing:
            run.waiting[index] = missing
        else:
            self._enable(run, index)

    def _set(self, run: _Run, made: dict[str, _Value]) -> None:
        for tensor, value in made.items():
            run.values[tensor] = value
            for waiter, index in run.watchers.pop(tensor, ()):
                waiter.waiting[index] -= 1
                if waiter.waiting[index] == 0:
                    self._enable(waiter, index)

    def _enable(self, run: _Run, index: int) -> None:
        """Everything step `index` (or the answer) of `run` reads exists."""
        if index == _ANSWER:
            self._answered.append(run)
            return
        step = self._plan.steps[index]
        inputs = []
        for item in step.inputs:
            tensor, made_with = self._value(run, item.tensor)
            if tensor is not None:  # absent: an optional input left out, as Triton leaves it out
                inputs.append(_adapt(tensor, item.model_input, item.dims, step.batching, made_with))
        request, outputs = self._request, [RequestedOutput(name) for name in self._route.step_outputs[index]]
        self._ready.append(_Call(run, step, InferenceRequest(
            step.model, step.version, inputs, outputs, id=request.id, parameters=request.parameters,
            priority=request.priority, timeout_us=request.timeout_us, deadline=request.deadline, compute=self.compute,
            identity=request.identity,  # the caller of the ensemble is the caller of its steps (Python models read it)
            trace=None if request.trace is None else request.trace.child(),  # a step of a traced ensemble is traced
        )))

    def _answer(self) -> None:
        """Answer with each completed run: the response of a plain ensemble, else one streamed response, flagged
        final when nothing else of the request is left to run (else the final flag follows alone)."""
        answered, stream = self._answered, self._request.stream
        while answered:
            response = self._respond(answered.pop(0))
            if stream is None:
                self._response = response
            else:
                stream.send(StreamResponse(response, final=not (answered or self._ready or self._tasks)))

    def _respond(self, run: _Run) -> InferenceResponse:
        plan, request = self._plan, self._request
        outputs = []
        for name in self._wanted:
            tensor, made_with = self._value(run, name)
            if tensor is None:
                raise InvalidArgumentError(
                    f"in ensemble '{plan.name}', {id_prefix(request.id)}unexpected deadlock, "
                    f"at least one output is not set while no more ensemble steps can be made"
                )
            outputs.append(_adapt(tensor, name, plan.output_dims[name], plan.batching, made_with))
        return InferenceResponse(request.model_name, request.model_version, outputs, id=request.id)

    def _holder(self, run: _Run, tensor: str) -> _Run:
        """The run of `run`'s chain that holds `tensor`: the one of the scope it is made in."""
        scope = self._plan.tensor_scope.get(tensor)
        while run.scope != scope and run.parent is not None:
            run = run.parent
        return run

    def _value(self, run: _Run, tensor: str) -> _Value:
        return self._holder(run, tensor).values.get(tensor, (None, 0))

    def _made(self, step: StepPlan, request: InferenceRequest, response: InferenceResponse) -> dict[str, _Value]:
        """The ensemble tensors `response` of `step` makes; those it was asked for and left out are None."""
        made_with = request.batch_size if step.batching else 0
        outputs = self._route.step_outputs[step.index]
        made: dict[str, _Value] = {step.outputs[o]: (None, made_with) for o in outputs}
        for output in response.outputs:
            tensor = step.outputs.get(output.name)
            if tensor is not None:
                made[tensor] = (output, made_with)
        return made


def _build(parts: SchedulerParts) -> Scheduler:
    setup = parts.ensemble_setup()
    return EnsembleScheduler(setup.plan, setup.host, setup.statistics)


SCHEDULER_KIND = SchedulerKind("ensemble", is_ensemble, _build)
