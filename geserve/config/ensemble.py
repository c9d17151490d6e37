"""Ensemble configurations: the checks Triton makes on `ensemble_scheduling`, alone and against the step models.

`validate_ensemble_graph` needs only the ensemble's own config (run at parse time); `validate_ensemble_steps`
needs the loaded step models' configs (run once they are loaded). Messages follow Triton's wording.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInput, ModelOutput

from geserve.errors import InvalidArgumentError

ENSEMBLE_PLATFORM = "ensemble"


def is_ensemble(config: ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM


def step_model_names(config: ModelConfig) -> list[str]:
    """The composing models, each once, in step order."""
    return list(dict.fromkeys(step.model_name for step in config.ensemble_scheduling.step))


def _error(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(message)


# What an ensemble's config must not hold (or must), in the order Triton checks it: (is wrong, message).
_ENSEMBLE_FIELDS: tuple[tuple[Callable[[ModelConfig], bool], str], ...] = (
    (lambda c: not c.HasField("ensemble_scheduling"),
     "ensemble scheduling must be set for ensemble {name} whose platform is ensemble"),
    (lambda c: bool(c.instance_group), "instance group should not be specified for ensemble '{name}'"),
    (lambda c: c.HasField("optimization"), "optimization should not be specified for ensemble '{name}'"),
    (lambda c: bool(c.model_warmup), "model_warmup can not be specified for ensemble '{name}'"),
    (lambda c: not c.ensemble_scheduling.step, "must specify 'step' for ensemble '{name}'"),
)
_STEP_FIELDS = ("model_name", "input_map", "output_map")


def validate_ensemble_graph(config: ModelConfig) -> None:
    """What can be checked without the step models: fields, single producers, data flow, cycles, unused tensors."""
    if config.HasField("ensemble_scheduling") and not is_ensemble(config):
        raise _error(f"ensemble scheduling cannot be set for model '{config.name}' whose platform is not ensemble")
    if not is_ensemble(config):
        return
    for wrong, message in _ENSEMBLE_FIELDS:
        if wrong(config):
            raise _error(message.format(name=config.name))
    producer = _producers(config)
    _check_reads(config, producer)
    _reject_cycles(config, producer)
    _reject_unused(config, producer)


def _producers(config: ModelConfig) -> dict[str, int]:
    """The step that writes each ensemble tensor, checking each step's fields and that no tensor is written twice."""
    name = config.name
    producer: dict[str, int] = {}
    for index, step in enumerate(config.ensemble_scheduling.step):
        for field in _STEP_FIELDS:
            if not getattr(step, field):
                raise _error(f"must specify '{field}' in step {index} of ensemble '{name}'")
        for _, tensor in sorted(step.output_map.items()):  # protobuf maps have no order: messages need one
            if tensor in producer:
                raise _error(
                    f"ensemble tensor '{tensor}' can appear in an output map only once for ensemble '{name}' "
                    f"step {index}"
                )
            producer[tensor] = index
    return producer


def _check_reads(config: ModelConfig, producer: dict[str, int]) -> None:
    """Every tensor a step reads comes from outside (an ensemble input) or from a step, never from both."""
    name, steps = config.name, config.ensemble_scheduling.step
    inputs = {t.name for t in config.input}
    for tensor in inputs & producer.keys():
        raise _error(
            f"ensemble tensor '{tensor}' of ensemble '{name}' is an ensemble input and also written by step "
            f"{producer[tensor]} (model '{steps[producer[tensor]].model_name}')"
        )
    for index, step in enumerate(steps):
        for _, tensor in sorted(step.input_map.items()):
            if tensor not in inputs and tensor not in producer:
                raise _error(
                    f"in ensemble '{name}', step {index} (model '{step.model_name}') reads ensemble tensor "
                    f"'{tensor}', which is neither an ensemble input nor an output of any step"
                )


def _reject_unused(config: ModelConfig, producer: dict[str, int]) -> None:
    """Every ensemble input is read, every ensemble output written, every step output read or returned."""
    read = {tensor for step in config.ensemble_scheduling.step for tensor in step.input_map.values()}
    for tensor in config.input:
        if tensor.name not in read:
            raise _error(f"ensemble input '{tensor.name}' for ensemble '{config.name}' is not used")
    _reject_unwritten(config, producer, read)


def _reject_unwritten(config: ModelConfig, producer: dict[str, int], read: set[str]) -> None:
    """Every ensemble output is written, and every tensor a step writes is read by a step or returned."""
    name = config.name
    outputs = {t.name for t in config.output}
    for tensor in config.output:
        if tensor.name not in producer:
            raise _error(f"output '{tensor.name}' for ensemble '{name}' is not written")
    for tensor in producer:
        if tensor not in read and tensor not in outputs:
            raise _error(f"ensemble tensor '{tensor}' is unused in ensemble '{name}'")


def _reject_cycles(config: ModelConfig, producer: dict[str, int]) -> None:
    """Steps form a graph through their tensors; a step that (indirectly) needs its own output never runs."""
    steps = config.ensemble_scheduling.step
    needs = [sorted({producer[t] for t in step.input_map.values() if t in producer}) for step in steps]
    state = [0] * len(steps)  # 0 unvisited, 1 on the current path, 2 done
    path: list[int] = []

    def visit(index: int) -> None:
        state[index] = 1
        path.append(index)
        for before in needs[index]:
            if state[before] == 1:
                loop = [*path[path.index(before):], before]
                described = " -> ".join(f"step {i} ({steps[i].model_name})" for i in loop)
                raise _error(f"ensemble '{config.name}' has a cycle: {described} (each needs an output of the next)")
            if state[before] == 0:
                visit(before)
        path.pop()
        state[index] = 2

    for index in range(len(steps)):
        if state[index] == 0:
            visit(index)


@dataclass(frozen=True, slots=True)
class _TensorNode:
    """What one model says about an ensemble tensor: its data type and dims (full dims add -1 when batching)."""

    model: str
    data_type: int
    dims: tuple[int, ...]
    batching: bool

    @property
    def full_dims(self) -> tuple[int, ...]:
        return (-1, *self.dims) if self.batching else self.dims


def _dims_compatible(lhs: tuple[int, ...], rhs: tuple[int, ...]) -> bool:
    return len(lhs) == len(rhs) and all(a == b or a == -1 or b == -1 for a, b in zip(lhs, rhs, strict=True))


def _dims_text(dims: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in dims) + "]"


def _check_consistent(ensemble: str, tensor: str, lhs: _TensorNode, rhs: _TensorNode) -> None:
    prefix = f"in ensemble {ensemble}, ensemble tensor {tensor}: "
    if lhs.data_type != rhs.data_type:
        raise _error(
            f"{prefix}inconsistent data type: {model_config_pb2.DataType.Name(lhs.data_type)} is inferred from "
            f"model {lhs.model} while {model_config_pb2.DataType.Name(rhs.data_type)} is inferred from model "
            f"{rhs.model}"
        )
    # A tensor may pass between a batching and a non-batching model when the full shapes agree.
    if not _dims_compatible(lhs.dims, rhs.dims) and not _dims_compatible(lhs.full_dims, rhs.full_dims):
        raise _error(
            f"{prefix}inconsistent shape: {_dims_text(lhs.full_dims)} is inferred from model {lhs.model} while "
            f"{_dims_text(rhs.full_dims)} is inferred from model {rhs.model}"
        )


def _io_dims(tensor: ModelInput | ModelOutput) -> tuple[int, ...]:
    return tuple(tensor.reshape.shape) if tensor.HasField("reshape") else tuple(tensor.dims)


def validate_ensemble_steps(config: ModelConfig, step_configs: Mapping[str, ModelConfig]) -> None:
    """Check each step's maps against its model (`step_configs` by model name): names, types, shapes, batch size."""
    name = config.name
    batching = config.max_batch_size > 0
    tensors: dict[str, _TensorNode] = {}
    for tensor in (*config.input, *config.output):
        tensors[tensor.name] = _TensorNode(name, tensor.data_type, _io_dims(tensor), batching)
    for step in config.ensemble_scheduling.step:
        model = step_configs[step.model_name]
        _check_step_batch_size(config, step.model_name, model)
        _check_input_map(name, step, model)
        # Lazily: each node is checked as it comes, so the first problem in step order is the one reported.
        for tensor, node in itertools.chain(_input_nodes(name, step, model), _output_nodes(name, step, model)):
            # The first model to name a tensor sets what it is; every later one must agree.
            known = tensors.setdefault(tensor, node)
            if known is not node:
                _check_consistent(name, tensor, known, node)


def _check_step_batch_size(config: ModelConfig, model_name: str, model: ModelConfig) -> None:
    if model.max_batch_size != 0 and model.max_batch_size < config.max_batch_size:
        raise _error(
            f"ensemble {config.name} allows maximum batch size {config.max_batch_size}, but it contains model "
            f"{model_name} which only allows maximum batch size to be {model.max_batch_size}"
        )


def _check_input_map(name: str, step: model_config_pb2.ModelEnsembling.Step, model: ModelConfig) -> None:
    model_inputs = {t.name: t for t in model.input}
    for model_input, tensor in sorted(step.input_map.items()):
        if model_input not in model_inputs:
            raise _error(
                f"in ensemble {name}, ensemble tensor {tensor} is mapping to non-existing input {model_input} "
                f"in model {step.model_name}"
            )


def _input_nodes(
    name: str, step: model_config_pb2.ModelEnsembling.Step, model: ModelConfig
) -> Iterator[tuple[str, _TensorNode]]:
    """The ensemble tensor each of the step model's inputs reads, as that input sees it."""
    step_batching = model.max_batch_size > 0
    for model_input in model.input:
        tensor = step.input_map.get(model_input.name)
        if tensor is None:
            if model_input.optional:
                continue
            raise _error(
                f"in ensemble {name}, input {model_input.name} in model {step.model_name} is not mapped to any "
                f"ensemble tensors"
            )
        yield tensor, _TensorNode(step.model_name, model_input.data_type, tuple(model_input.dims), step_batching)


def _output_nodes(
    name: str, step: model_config_pb2.ModelEnsembling.Step, model: ModelConfig
) -> Iterator[tuple[str, _TensorNode]]:
    """The ensemble tensor each of the step's mapped outputs writes, as the step model produces it."""
    step_batching = model.max_batch_size > 0
    model_outputs = {t.name: t for t in model.output}
    for model_output, tensor in sorted(step.output_map.items()):
        output = model_outputs.get(model_output)
        if output is None:
            raise _error(
                f"in ensemble {name}, ensemble tensor {tensor} is mapped from non-existing output "
                f"{model_output} in model {step.model_name}"
            )
        yield tensor, _TensorNode(step.model_name, output.data_type, tuple(output.dims), step_batching)
