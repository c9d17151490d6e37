"""The ensemble scheduler: runs an ensemble's steps as a DAG, each step through its model's own data-plane path.

A step starts as soon as every tensor it reads exists, so independent branches run concurrently. Each step is a
plain inference request to the data plane (`InferenceHost.infer`): validation, the step model's scheduler (its
dynamic batcher included) and its statistics all apply. Tensors pass between steps as the same numpy arrays.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from geserve.backends.base import InferenceHost
from geserve.config import ModelConfig
from geserve.core.statistics import ModelStatistics
from geserve.errors import GeserveError, InternalError, InvalidArgumentError
from geserve.scheduling.inflight import InflightTracker
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, RequestedOutput

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
    _routes: dict[frozenset[str], Route] = field(default_factory=dict)

    @classmethod
    def build(cls, config: ModelConfig, step_configs: dict[str, ModelConfig]) -> EnsemblePlan:
        steps = []
        for index, step in enumerate(config.ensemble_scheduling.step):
            model = step_configs[step.model_name]
            dims = {t.name: tuple(t.dims) for t in model.input}
            inputs = tuple(StepInput(i, t, dims[i]) for i, t in sorted(step.input_map.items()))
            version = "" if step.model_version < 0 else str(step.model_version)
            steps.append(
                StepPlan(index, step.model_name, version, model.max_batch_size > 0, inputs, dict(step.output_map),
                         frozenset(step.input_map.values()))
            )
        consumers: dict[str, list[int]] = {}
        producer: dict[str, int] = {}
        for step in steps:
            for tensor in step.reads:
                consumers.setdefault(tensor, []).append(step.index)
            for tensor in step.outputs.values():
                producer[tensor] = step.index
        return cls(
            name=config.name,
            batching=config.max_batch_size > 0,
            steps=tuple(steps),
            outputs=tuple(t.name for t in config.output),
            output_dims={t.name: tuple(t.dims) for t in config.output},
            optional_inputs=tuple(t.name for t in config.input if t.optional),
            consumers={t: tuple(s) for t, s in consumers.items()},
            producer=producer,
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
        return Route(frozenset(needed), {t: readers[t] for t in kept}, step_outputs)


@dataclass(frozen=True, slots=True)
class Route:
    """The steps one set of requested outputs needs, what each of them must return, and who reads what."""

    steps: frozenset[int]
    releasable: dict[str, int]  # intermediate tensor -> how many of `steps` read it; dropped after the last one
    step_outputs: dict[int, tuple[str, ...]]  # step -> the model outputs some needed step or the request reads


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

    async def enqueue(self, request: InferenceRequest) -> InferenceResponse:
        self._inflight.enter(request.model_name)
        try:
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
        outputs = []
        for name in wanted:
            tensor, made_with = values.get(name, (None, 0))
            if tensor is None:
                raise InvalidArgumentError(
                    f"in ensemble '{plan.name}', [request id: {request.id or '<id_unknown>'}] unexpected deadlock, "
                    f"at least one output is not set while no more ensemble steps can be made"
                )
            outputs.append(_adapt(tensor, name, plan.output_dims[name], plan.batching, made_with))
        self._statistics.record_execution(1, request.batch_size, [started - enqueued], *sink)
        if request.compute_sink is not None:  # an ensemble inside an ensemble: the outer one reports this compute
            for k in range(3):
                request.compute_sink[k] += sink[k]
        return InferenceResponse(request.model_name, request.model_version, outputs, id=request.id)

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
        inputs = []
        for item in step.inputs:
            tensor, made_with = values[item.tensor]
            if tensor is not None:  # absent: an optional input left out, as Triton leaves it out
                inputs.append(_adapt(tensor, item.model_input, item.dims, step.batching, made_with))
        step_request = InferenceRequest(
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
        response = await self._host.infer(step_request)
        made_with = step_request.batch_size if step.batching else 0
        produced: dict[str, _Value] = {step.outputs[o]: (None, made_with) for o in route.step_outputs[step.index]}
        for output in response.outputs:
            tensor = step.outputs.get(output.name)
            if tensor is not None:
                produced[tensor] = (output, made_with)
        return produced
