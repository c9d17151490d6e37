"""An ensemble's steps and data flow, worked out once per loaded version: which step reads and writes which tensor,
which steps a set of requested outputs needs, and after which decoupled step each step runs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from geserve.config import ModelConfig
from geserve.errors import InvalidArgumentError


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
        steps = _step_plans(config, step_configs)
        consumers, producer = _connections(steps)
        scopes = _Scopes(config.name, steps, producer)
        scopes.deepest([t.name for t in config.output], "the ensemble's outputs")
        return cls(
            name=config.name,
            batching=config.max_batch_size > 0,
            steps=tuple(replace(step, scope=scopes.of_step(step.index)) for step in steps),
            outputs=tuple(t.name for t in config.output),
            output_dims={t.name: tuple(t.dims) for t in config.output},
            optional_inputs=tuple(t.name for t in config.input if t.optional),
            consumers=consumers,
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
        needed = self._needed(outputs)
        read = {tensor for index in needed for tensor in self.steps[index].reads}
        readers = {tensor: [i for i in self.consumers[tensor] if i in needed] for tensor in read}
        step_outputs = {index: self._step_outputs(index, readers, outputs) for index in needed}
        # Checked at build: the outputs' scopes nest, so the deepest one sees them all.
        emit_scope = max((self.tensor_scope.get(t) for t in outputs), key=self._depth, default=None)
        return Route(frozenset(needed), self._releasable(readers, outputs), step_outputs, self._scope_steps(needed),
                     emit_scope)

    def _needed(self, outputs: frozenset[str]) -> set[int]:
        # Only the steps leading to `outputs` run, as Triton prunes the others.
        needed: set[int] = set()
        pending = list(outputs)
        while pending:
            index = self.producer.get(pending.pop())
            if index is not None and index not in needed:
                needed.add(index)
                pending.extend(self.steps[index].reads)
        return needed

    def _releasable(self, readers: dict[str, list[int]], outputs: frozenset[str]) -> dict[str, int]:
        # Released after their last reader: the intermediates that no run of a later scope may still read.
        return {t: len(r) for t, r in readers.items()
                if t not in outputs and all(self.steps[i].scope == self.tensor_scope.get(t) for i in r)}

    def _step_outputs(self, index: int, readers: dict[str, list[int]], outputs: frozenset[str]) -> tuple[str, ...]:
        return tuple(o for o, t in self.steps[index].outputs.items() if t in readers or t in outputs)

    def _scope_steps(self, needed: set[int]) -> dict[int | None, tuple[int, ...]]:
        scope_steps: dict[int | None, list[int]] = {}
        for index in sorted(needed):
            scope_steps.setdefault(self.steps[index].scope, []).append(index)
        return {k: tuple(v) for k, v in scope_steps.items()}

    def _depth(self, scope: int | None) -> int:
        depth = 0
        while scope is not None:
            depth, scope = depth + 1, self.steps[scope].scope
        return depth


@dataclass(frozen=True, slots=True)
class Route:
    """The steps one set of requested outputs needs, what each of them must return, and who reads what."""

    steps: frozenset[int]
    # Intermediate tensor -> how many of `steps` read it, in the run that holds it; dropped after the last one.
    releasable: dict[str, int]
    step_outputs: dict[int, tuple[str, ...]]  # step -> the model outputs some needed step or the request reads
    scope_steps: dict[int | None, tuple[int, ...]] = field(default_factory=dict)  # StepPlan.scope -> steps
    emit_scope: int | None = None  # each run of this scope answers the request once


def _step_plans(config: ModelConfig, step_configs: dict[str, ModelConfig]) -> list[StepPlan]:
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
    return steps


def _connections(steps: list[StepPlan]) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Which steps read each tensor, and which step writes it."""
    consumers: dict[str, list[int]] = {}
    producer: dict[str, int] = {}
    for step in steps:
        for tensor in step.reads:
            consumers.setdefault(tensor, []).append(step.index)
        for tensor in step.outputs.values():
            producer[tensor] = step.index
    return {t: tuple(s) for t, s in consumers.items()}, producer


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
