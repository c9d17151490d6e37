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
from dataclasses import dataclass, field, replace
from typing import Any

from geserve.backends.base import InferenceHost
from geserve.config import ModelConfig
from geserve.core.statistics import ModelStatistics
from geserve.errors import GeserveError, InternalError, InvalidArgumentError
from geserve.scheduling.inflight import InflightTracker
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, RequestedOutput
from geserve.types.streams import StreamResponse

# An ensemble tensor's value and the batch size of the request that made it (0: made without batching).
_Value = tuple[InputTensor | None, int]


@dataclass(frozen=True, slots=True)
class StepInput:
    model_input: str
    tensor: str
    dims: tuple[int, ...]  # the step model's config dims, to move a tensor between batching and non-batching


@dataclass(frozen=True, slots=True)
class StepPlan:
    index: int
    model: str
    version: str  # "" for the latest ready version (model_version -1)
    batching: bool
    inputs: tuple[StepInput, ...]
    outputs: dict[str, str]  # model output -> ensemble tensor
    reads: frozenset[str]  # the distinct ensemble tensors the step waits for
    decoupled: bool = False
    # The innermost decoupled step this one runs after (once per response of it); None: once per request.
    scope: int | None = None


@dataclass(slots=True)
class EnsemblePlan:
    """The steps and how tensors connect them; built once per loaded ensemble version."""

    name: str
    batching: bool
    steps: tuple[StepPlan, ...]
    outputs: tuple[str, ...]  # ensemble outputs, in config order
    output_dims: dict[str, tuple[int, ...]]
    optional_inputs: tuple[str, ...]
    consumers: dict[str, tuple[int, ...]]  # tensor -> steps reading it
    producer: dict[str, int]  # tensor -> the step writing it
    decoupled: bool = False  # some step is decoupled, so the ensemble answers with a stream
    tensor_scope: dict[str, int | None] = field(default_factory=dict)  # see StepPlan.scope
    _routes: dict[frozenset[str], Route] = field(default_factory=dict)

    @classmethod
    def build(cls, config: ModelConfig, step_configs: dict[str, ModelConfig]) -> EnsemblePlan:
        steps = []
        for index, step in enumerate(config.ensemble_scheduling.step):
            model = step_configs[step.model_name]
            dims = {t.name: tuple(t.dims) for t in model.input}
            inputs = tuple(StepInput(i, t, dims[i]) for i, t in sorted(step.input_map.items()))
            version = "" if step.model_version < 0 else str(step.model_version)
            outputs = dict(sorted(step.output_map.items()))
            steps.append(
                StepPlan(index, step.model_name, version, model.max_batch_size > 0, inputs, outputs,
                         frozenset(step.input_map.values()), model.model_transaction_policy.decoupled)
            )
        consumers: dict[str, list[int]] = {}
        producer: dict[str, int] = {}
        for step in steps:
            for tensor in step.reads:
                consumers.setdefault(tensor, []).append(step.index)
            for tensor in step.outputs.values():
                producer[tensor] = step.index
        scopes = _Scopes(config.name, steps, producer)
        scopes.deepest([t.name for t in config.output], "the ensemble's outputs")
        return cls(
            name=config.name,
            batching=config.max_batch_size > 0,
            steps=tuple(replace(step, scope=scopes.of_step(step.index)) for step in steps),
            outputs=tuple(t.name for t in config.output),
            output_dims={t.name: tuple(t.dims) for t in config.output},
            optional_inputs=tuple(t.name for t in config.input if t.optional),
            consumers={t: tuple(s) for t, s in consumers.items()},
            producer=producer,
            decoupled=any(step.decoupled for step in steps),
            tensor_scope=scopes.tensors,
        )

    def route(self, outputs: frozenset[str]) -> Route:
        """How a request for `outputs` runs; built once per distinct set of requested outputs."""
        route = self._routes.get(outputs)
        if route is None:
            route = self._routes[outputs] = self._build_route(outputs)
        return route

    def _build_route(self, outputs: frozenset[str]) -> Route:
        # Only the steps leading to `outputs` run, as Triton prunes the others.
        needed: set[int] = set()
        pending = list(outputs)
        while pending:
            index = self.producer.get(pending.pop())
            if index is not None and index not in needed:
                needed.add(index)
                pending.extend(self.steps[index].reads)
        readers: dict[str, int] = {}
        for index in needed:
            for tensor in self.steps[index].reads:
                readers[tensor] = readers.get(tensor, 0) + 1
        kept = {t for t in readers if t not in outputs}  # intermediates, released after their last reader
        step_outputs = {
            index: tuple(o for o, t in self.steps[index].outputs.items() if t in readers or t in outputs)
            for index in needed
        }
        scope_steps: dict[int | None, list[int]] = {}
        for index in sorted(needed):
            scope_steps.setdefault(self.steps[index].scope, []).append(index)
        # Checked at build: the outputs' scopes nest, so the deepest one sees them all.
        emit_scope = max((self.tensor_scope.get(t) for t in outputs), key=self._depth, default=None)
        return Route(frozenset(needed), {t: readers[t] for t in kept}, step_outputs,
                     {k: tuple(v) for k, v in scope_steps.items()}, emit_scope)

    def _depth(self, scope: int | None) -> int:
        depth = 0
        while scope is not None:
            depth, scope = depth + 1, self.steps[scope].scope
        return depth


@dataclass(frozen=True, slots=True)
class Route:
    """The steps one set of requested outputs needs, what each of them must return, and who reads what."""

    steps: frozenset[int]
    releasable: dict[str, int]  # intermediate tensor -> how many of `steps` read it; dropped after the last one
    step_outputs: dict[int, tuple[str, ...]]  # step -> the model outputs some needed step or the request reads
    scope_steps: dict[int | None, tuple[int, ...]] = field(default_factory=dict)  # StepPlan.scope -> steps
    emit_scope: int | None = None  # each run of this scope answers the request once


class _Scopes:
    """Which decoupled step each step and tensor runs after: the innermost one among those it depends on.

    Those must nest (each runs after the other). A step reading the responses of two decoupled steps that do not
    would need their responses paired up, which Triton leaves undefined: such an ensemble is refused."""

    def __init__(self, name: str, steps: list[StepPlan], producer: dict[str, int]) -> None:
        self._name, self._steps, self._producer = name, steps, producer
        self._step_scopes: dict[int, int | None] = {}
        self.tensors: dict[str, int | None] = {}

    def of_step(self, index: int) -> int | None:
        if index not in self._step_scopes:
            step = self._steps[index]
            self._step_scopes[index] = self.deepest(sorted(step.reads), f"step {index} ({step.model})")
        return self._step_scopes[index]

    def of_tensor(self, tensor: str) -> int | None:
        if tensor not in self.tensors:
            index = self._producer.get(tensor)
            scope = None if index is None else index if self._steps[index].decoupled else self.of_step(index)
            self.tensors[tensor] = scope
        return self.tensors[tensor]

    def _chain(self, scope: int | None) -> list[int]:
        chain = []
        while scope is not None:
            chain.append(scope)
            scope = self.of_step(scope)
        return chain

    def deepest(self, tensors: list[str], reader: str) -> int | None:
        deepest: int | None = None
        for scope in map(self.of_tensor, tensors):
            if scope is None or scope in self._chain(deepest):
                continue
            if deepest is not None and deepest not in self._chain(scope):
                first, second = self._steps[deepest], self._steps[scope]
                raise InvalidArgumentError(
                    f"in ensemble '{self._name}', {reader} reads the responses of decoupled steps {first.index} "
                    f"({first.model}) and {second.index} ({second.model}), neither of which runs after the other: "
                    f"their responses cannot be paired"
                )
            deepest = scope
        return deepest


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
    if isinstance(error, GeserveError):
        wrapped = type(error)(f"in ensemble '{name}', {error.message}")
    else:
        wrapped = InternalError(f"in ensemble '{name}', {type(error).__name__}: {error}")
    wrapped.failure_reason = "OTHER"  # Triton counts an ensemble's failures under OTHER
    return wrapped


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
        """The response; for a decoupled ensemble, None once every response went to `request.responses`."""
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
        wanted = tuple(dict.fromkeys(o.name for o in request.outputs)) if request.outputs else plan.outputs
        route = plan.route(frozenset(wanted))
        batch = request.batch_size if plan.batching else 0
        values: dict[str, _Value] = {t.name: (t, batch) for t in request.inputs}
        for name in plan.optional_inputs:
            values.setdefault(name, (None, batch))
        waiting = {i: sum(1 for t in plan.steps[i].reads if t not in values) for i in route.steps}
        sink = [0, 0, 0]
        started = time.monotonic_ns()
        await self._execute(request, route, values, waiting, sink)
        response = self._response(request, wanted, [values.get(name, (None, 0)) for name in wanted])
        self._record(request, enqueued, started, sink)
        return response

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

    def _record(self, request: InferenceRequest, enqueued: int, started: int, sink: list[int]) -> None:
        self._statistics.record_execution(1, request.batch_size, [started - enqueued], *sink)
        if request.compute_sink is not None:  # an ensemble inside an ensemble: the outer one reports this compute
            for k in range(3):
                request.compute_sink[k] += sink[k]

    async def _stream(self, request: InferenceRequest) -> None:
        """Run a decoupled ensemble: each response of a decoupled step opens a scope in which the steps after it
        run once more; each completed run of the route's emitting scope is one response on `request.responses`.

        The first step failure cancels the request's other tasks and fails the request. A response goes out
        flagged final when nothing else of the request is still running; otherwise the final flag follows alone
        once everything has finished."""
        plan = self._plan
        enqueued = time.monotonic_ns()
        wanted = tuple(dict.fromkeys(o.name for o in request.outputs)) if request.outputs else plan.outputs
        route = plan.route(frozenset(wanted))
        stream = request.responses
        loop = asyncio.get_running_loop()
        batch = request.batch_size if plan.batching else 0
        sink = [0, 0, 0]
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

        given = {t.name: (t, batch) for t in request.inputs}
        for name in plan.optional_inputs:
            given.setdefault(name, (None, batch))
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
        sink: list[int],
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
        self, step: StepPlan, route: Route, request: InferenceRequest, values: dict[str, _Value], sink: list[int]
    ) -> dict[str, _Value]:
        step_request = self._step_request(step, route, request, [values[item.tensor] for item in step.inputs], sink)
        return self._produced(step, route, step_request, await self._host.infer(step_request))

    def _step_request(
        self, step: StepPlan, route: Route, request: InferenceRequest, values: list[_Value], sink: list[int]
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
            compute_sink=sink,
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

