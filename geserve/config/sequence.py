"""Triton's `sequence_batching` section: its defaults, its checks (in Triton's words), and what the sequence batcher
and the backends read from it: the control inputs, the implicit states and their initial values."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc.model_config_pb2 import ModelConfig, ModelInput, ModelOutput, ModelSequenceBatching

from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.types.datatypes import BY_CONFIG, DataType

IDLE_DEFAULT_US = 1_000_000  # Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS
INITIAL_STATE_FOLDER = "initial_state"  # Triton's kInitialStateFolder, in the model's folder
_Control = ModelSequenceBatching.Control
# The boolean controls, and the kind the typed one (the correlation id) is.
BOOLEAN_KINDS = (_Control.CONTROL_SEQUENCE_START, _Control.CONTROL_SEQUENCE_END, _Control.CONTROL_SEQUENCE_READY)
CORRID = _Control.CONTROL_SEQUENCE_CORRID
_CORRID_TYPES = (
    model_config_pb2.TYPE_UINT64, model_config_pb2.TYPE_INT64, model_config_pb2.TYPE_UINT32,
    model_config_pb2.TYPE_INT32, model_config_pb2.TYPE_STRING,
)


def is_sequence_model(config: ModelConfig) -> bool:
    return config.WhichOneof("scheduling_choice") == "sequence_batching"


@dataclass(frozen=True, slots=True)
class ControlInput:
    """One control input the sequence batcher fills in: START, END, READY (false / true values) or CORRID."""

    kind: int  # ModelSequenceBatching.Control.Kind
    name: str
    datatype: DataType
    false_value: object = None  # the boolean kinds' values, as the config's *_false_true gives them
    true_value: object = None

    @property
    def kind_name(self) -> str:
        return str(_Control.Kind.Name(self.kind))


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One implicit state: fed to the model as `input_name`, read back from its `output_name` after each request."""

    input_name: str
    output_name: str
    datatype: DataType
    dims: tuple[int, ...]
    initial: np.ndarray | None  # the `initial_state` value, shaped by its dims; None: zeros (variable dims as 1)
    # `output_name` is a declared output too: as Triton's backends do (onnxruntime's `model_outputs_`), it still
    # carries the state and goes to a client that asks for it (or for every output).
    declared: bool = False


@dataclass(frozen=True, slots=True)
class SequenceSettings:
    """What the sequence batcher is built from: the strategy's numbers, the control inputs and the states."""

    max_batch_size: int
    idle_ns: int
    oldest: bool  # the `oldest` strategy; `direct` otherwise (Triton's default)
    slots_per_instance: int
    max_queue_delay_ns: int
    minimum_slot_utilization: float  # direct only
    preferred_batch_sizes: tuple[int, ...]  # oldest only; ascending
    controls: tuple[ControlInput, ...]
    states: tuple[StateSpec, ...]

    @property
    def corrid(self) -> ControlInput | None:
        return next((c for c in self.controls if c.kind == CORRID), None)

    @classmethod
    def from_config(cls, config: ModelConfig, model_dir: Path | None) -> SequenceSettings:
        """The settings of a validated sequence model; initial states from files are read from `model_dir`."""
        batching = config.sequence_batching
        oldest = batching.WhichOneof("strategy_choice") == "oldest"
        batch = max(1, config.max_batch_size)
        if oldest:
            # Triton makes no slot at all for 0 and never serves the model; one slot per batch row serves it.
            slots = batching.oldest.max_candidate_sequences or batch
            delay_us = batching.oldest.max_queue_delay_microseconds
            preferred = tuple(sorted(set(batching.oldest.preferred_batch_size))) or (batch,)
        else:
            slots = batch
            delay_us = batching.direct.max_queue_delay_microseconds
            preferred = ()
        return cls(
            max_batch_size=config.max_batch_size,
            idle_ns=(batching.max_sequence_idle_microseconds or IDLE_DEFAULT_US) * 1000,
            oldest=oldest,
            slots_per_instance=slots,
            max_queue_delay_ns=delay_us * 1000,
            minimum_slot_utilization=batching.direct.minimum_slot_utilization if not oldest else 0.0,
            preferred_batch_sizes=preferred,
            controls=control_inputs(config),
            states=tuple(_state_spec(config, state, model_dir) for state in batching.state),
        )


# ---- defaults and checks -------------------------------------------------------------------------------------


def fill_sequence_defaults(config: ModelConfig) -> None:
    """Triton's normalization of the section, which `/config` prints: the idle timeout, and the oldest strategy's
    preferred batch size (the largest one)."""
    if not is_sequence_model(config):
        return
    batching = config.sequence_batching
    if batching.max_sequence_idle_microseconds == 0:
        batching.max_sequence_idle_microseconds = IDLE_DEFAULT_US
    if batching.HasField("oldest") and not batching.oldest.preferred_batch_size and config.max_batch_size > 0:
        batching.oldest.preferred_batch_size.append(config.max_batch_size)


def validate_sequence_batching(config: ModelConfig) -> None:
    """Triton's checks of the section (ValidateModelConfig, then the scheduler's own on its states)."""
    if not is_sequence_model(config):
        return
    batching = config.sequence_batching
    name = config.name
    if batching.iterative_sequence:
        raise UnsupportedError(
            f"model '{name}': sequence_batching.iterative_sequence (requests rescheduled by the model) is not "
            f"supported by geserve"
        )
    control_inputs(config)  # each kind at most once, each tensor for one kind, well-formed values
    if batching.HasField("oldest"):
        for size in batching.oldest.preferred_batch_size:
            if size <= 0:
                raise InvalidArgumentError(f"sequence batching preferred batch size must be positive for {name}")
            if size > config.max_batch_size:
                raise InvalidArgumentError(
                    f"sequence batching preferred batch size must be <= max batch size for {name}"
                )
    if batching.HasField("direct"):
        utilization = batching.direct.minimum_slot_utilization
        if utilization < 0.0 or utilization > 1.0:
            raise InvalidArgumentError(
                f"sequence batching minimum slot utilization must be in range (0.0, 1.0] for {name}"
            )
    _validate_states(config)


def control_inputs(config: ModelConfig) -> tuple[ControlInput, ...]:
    """The control inputs, checked as Triton's GetBooleanSequenceControlProperties and
    GetTypedSequenceControlProperties check them (their messages)."""
    batching = config.sequence_batching
    name = config.name
    seen_tensors: set[str] = set()
    seen_kinds: set[int] = set()
    controls: list[ControlInput] = []
    for control_input in batching.control_input:
        if not control_input.name:
            raise InvalidArgumentError(f"sequence batching control tensor must have a name for {name}")
        if control_input.name in seen_tensors:
            raise InvalidArgumentError(
                f"sequence batching control tensor '{control_input.name}' is specified for multiple control kinds "
                f"for {name}"
            )
        seen_tensors.add(control_input.name)
        for control in control_input.control:
            kind_name = _Control.Kind.Name(control.kind)
            if control.kind in seen_kinds:
                raise InvalidArgumentError(f"sequence batching specifies multiple {kind_name} tensors for {name}")
            seen_kinds.add(control.kind)
            controls.append(_control(control_input.name, control, kind_name, name))
    return tuple(controls)


def _control(tensor: str, control: ModelSequenceBatching.Control, kind_name: str, model: str) -> ControlInput:
    given = [f for f in ("int32_false_true", "fp32_false_true", "bool_false_true") if len(getattr(control, f))]
    if control.kind == CORRID:
        if given:
            raise InvalidArgumentError(
                f"sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
                f"'bool_false_true' for {kind_name} for {model}"
            )
        if control.data_type not in _CORRID_TYPES:
            raise InvalidArgumentError(
                f"unexpected data type for control {kind_name} for {model}. Allowed data types are TYPE_UINT64, "
                f"TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"
            )
        return ControlInput(control.kind, tensor, BY_CONFIG[control.data_type])
    if not given:
        raise InvalidArgumentError(
            f"sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' "
            f"for {kind_name} for {model}"
        )
    if len(given) > 1:
        raise InvalidArgumentError(
            f"sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
            f"'bool_false_true' for {kind_name} for {model}"
        )
    field = given[0]
    values = list(getattr(control, field))
    if len(values) != 2:
        raise InvalidArgumentError(
            f"sequence batching control '{field}' must have exactly 2 entries for {kind_name} for {model}"
        )
    datatype = {"int32_false_true": "TYPE_INT32", "fp32_false_true": "TYPE_FP32", "bool_false_true": "TYPE_BOOL"}
    dtype = BY_CONFIG[model_config_pb2.DataType.Value(datatype[field])]
    return ControlInput(control.kind, tensor, dtype, dtype.numpy.type(values[0]), dtype.numpy.type(values[1]))


def _validate_states(config: ModelConfig) -> None:
    """The checks Triton's sequence batcher makes of each state when it is created (its messages)."""
    seen: set[str] = set()
    for state in config.sequence_batching.state:
        _validate_state_fields(config, state)
        if len(state.initial_state) > 1:
            raise InvalidArgumentError(
                f"initial_state field for state input '{state.input_name}' must contain exactly one or zero element. "
                f"Found '{len(state.initial_state)}' elements."
            )
        if state.initial_state:
            _validate_initial_state(state, state.initial_state[0], seen)


def _validate_state_fields(config: ModelConfig, state: ModelSequenceBatching.State) -> None:
    for field in ("input_name", "output_name"):
        if not getattr(state, field):
            raise InvalidArgumentError(f"sequence batching state of model '{config.name}' must set '{field}'")
    if state.data_type == model_config_pb2.TYPE_INVALID:
        raise InvalidArgumentError(
            f"sequence batching state '{state.input_name}' of model '{config.name}' must set 'data_type'"
        )
    if state.use_growable_memory:
        _validate_growable_memory(config, state)


def _validate_growable_memory(config: ModelConfig, state: ModelSequenceBatching.State) -> None:
    if not state.use_same_buffer_for_input_output:
        raise InvalidArgumentError(
            f"In order to 'use_growable_memory', you must also enable 'use_single_buffer' for state input name "
            f"'{state.input_name}'."
        )
    if any(g.kind != model_config_pb2.ModelInstanceGroup.KIND_GPU for g in config.instance_group):
        raise InvalidArgumentError(
            "'use_growable_memory' can only work with KIND_GPU model instances right now. Please either change "
            "the instance type to KIND_GPU or set 'use_growable_memory' to false for state input "
            f"'{state.input_name}'."
        )


def _validate_initial_state(
    state: ModelSequenceBatching.State, initial: ModelSequenceBatching.InitialState, seen: set[str]
) -> None:
    name = state.input_name
    if initial.data_type != state.data_type:
        raise InvalidArgumentError(
            f"The data type used for 'initial_state' field of state '{name}' does not match the state data type."
        )
    if not initial.name:
        raise InvalidArgumentError(f"Field 'name' must be set when using initial_state for state input '{name}'.")
    if name in seen:
        raise InvalidArgumentError(f"State input name '{name}' specified more than once.")
    seen.add(name)
    if len(initial.dims) != len(state.dims):
        raise InvalidArgumentError(
            f"Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for state input "
            f"'{name}'. {len(initial.dims)} != {len(state.dims)}"
        )
    for initial_dim, state_dim in zip(initial.dims, state.dims, strict=True):
        if initial_dim == -1:
            raise InvalidArgumentError(
                f"'initial_state' field for state input name '{name}' contains variable dimensions."
            )
        if state_dim != -1 and initial_dim != state_dim:
            raise InvalidArgumentError(
                f"'initial_state' dim for input name '{name}' doesn't match 'state' dim description. "
                f"{initial_dim} != {state_dim}"
            )
    if initial.WhichOneof("state_data") is None:
        raise InvalidArgumentError(f"initial_state setting expects state'{name}' to have state_data set")


# ---- what the backends see ----------------------------------------------------------------------------------


def sequence_inputs(config: ModelConfig) -> list[ModelInput]:
    """The inputs the sequence batcher adds to each request: the control inputs ([1] each) and the state inputs.
    A backend that checks its graph against the config accepts them; clients never see them (metadata, requests)."""
    if not is_sequence_model(config):
        return []
    inputs = [ModelInput(name=c.name, data_type=c.datatype.config, dims=[1]) for c in control_inputs(config)]
    for state in config.sequence_batching.state:
        inputs.append(ModelInput(name=state.input_name, data_type=state.data_type, dims=list(state.dims)))
    return inputs


def sequence_outputs(config: ModelConfig) -> list[ModelOutput]:
    """The state outputs the sequence batcher reads back and keeps, never answered to a client: those the config
    does not declare as outputs too (a declared one is a client's output as well, seen with the others)."""
    if not is_sequence_model(config):
        return []
    declared = {output.name for output in config.output}
    states = [s for s in config.sequence_batching.state if s.output_name not in declared]
    return [ModelOutput(name=s.output_name, data_type=s.data_type, dims=list(s.dims)) for s in states]


# ---- initial state ----------------------------------------------------------------------------------------------


def _state_spec(config: ModelConfig, state: ModelSequenceBatching.State, model_dir: Path | None) -> StateSpec:
    datatype = BY_CONFIG[state.data_type]
    initial = _initial_value(config, state, datatype, model_dir) if state.initial_state else None
    declared = any(output.name == state.output_name for output in config.output)
    return StateSpec(state.input_name, state.output_name, datatype, tuple(state.dims), initial, declared)


def _initial_value(
    config: ModelConfig, state: ModelSequenceBatching.State, datatype: DataType, model_dir: Path | None
) -> np.ndarray:
    initial = state.initial_state[0]
    dims = tuple(initial.dims)
    count = int(np.prod(dims, dtype=np.int64))
    if initial.WhichOneof("state_data") == "zero_data":
        if datatype.wire == "BYTES":
            return np.full(dims, b"", dtype=object)
        return np.zeros(dims, dtype=datatype.numpy)
    if model_dir is None:
        raise InvalidArgumentError(
            f"model '{config.name}': the initial state of '{state.input_name}' comes from a file, and the model has "
            f"no folder to read it from"
        )
    path = model_dir / INITIAL_STATE_FOLDER / initial.data_file
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(f"failed to read initial state file {path}: {exc.strerror or exc}") from None
    if datatype.wire == "BYTES":
        return np.array(_split_strings(raw, count, path), dtype=object).reshape(dims)
    needed = count * datatype.itemsize
    if needed > len(raw):
        raise InvalidArgumentError(
            f"initial_state setting expects {needed} bytes, but the data provided from {initial.data_file} only has "
            f"{len(raw)} bytes."
        )
    return np.frombuffer(raw[:needed], dtype=datatype.numpy).reshape(dims).copy()


def _split_strings(raw: bytes, count: int, path: Path) -> list[bytes]:
    """A BYTES initial state in Triton's serialization: each element a 4-byte little-endian length, then its bytes."""
    elements: list[bytes] = []
    offset = 0
    while len(elements) < count:
        if offset + 4 > len(raw):
            raise InvalidArgumentError(f"initial state file {path} holds {len(elements)} of {count} string elements")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidArgumentError(f"initial state file {path} ends inside string element {len(elements)}")
        elements.append(raw[offset:offset + length])
        offset += length
    return elements
