"""What an instance is handed for one request of a sequence: the request with its control inputs and its sequence's
implicit state added, the not-ready null request that fills an empty slot of a direct batch, and the response with
the state outputs taken back out (a client sees a state only where the config also declares it as an output).

The client's request is never changed: the instance gets a copy that carries the added inputs, so the service still
reads the request's own outputs (shared memory placements, classification) afterwards.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from geserve.config.sequence import CORRID, ControlInput, SequenceSettings
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, RequestedOutput

logger = logging.getLogger(__name__)

SequenceId = int | str  # Triton's correlation id: an unsigned 64-bit integer or a string
_UINT64 = 1 << 64
_START = 0  # ModelSequenceBatching.Control.Kind values, for the boolean controls
_READY = 1
_END = 2


def sequence_id(value: Any) -> SequenceId | None:
    """A request's `sequence_id` parameter as a correlation id; None when it has none (absent, 0 or "", as in
    Triton). gRPC carries it as int64: a negative one is the uint64 with the same bits, as Triton reads it."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        return int(value) % _UINT64 or None
    return None


@dataclass(eq=False, slots=True)
class SequenceState:
    """One sequence's implicit state between its requests: each state input's value, with the batch axis when the
    model batches; what the model's state outputs held after its latest request."""

    tensors: dict[str, np.ndarray]


class SequenceInputs:
    """Builds the requests an instance runs for a sequence model (one per model, shared by its slots)."""

    def __init__(self, model_name: str, settings: SequenceSettings) -> None:
        self._model = model_name
        self._batch_axis: tuple[int, ...] = (1,) if settings.max_batch_size > 0 else ()
        self._booleans = [c for c in settings.controls if c.kind != CORRID]
        self._corrid = settings.corrid
        self._states = settings.states
        self._state_outputs = {s.output_name: s.input_name for s in settings.states}
        self._declared_states = frozenset(s.output_name for s in settings.states if s.declared)
        self._warned_missing_state = False
        # The boolean controls' tensors never change: built once, shared by every request (nothing writes them).
        self._control_values: dict[tuple[str, bool], InputTensor] = {}
        for control in self._booleans:
            for value in (False, True):
                self._control_values[(control.name, value)] = self._tensor(
                    control, np.array(control.true_value if value else control.false_value)
                )

    @property
    def has_state(self) -> bool:
        return bool(self._states)

    def initial_state(self) -> SequenceState:
        """A new sequence's state: each `initial_state` value, else zeros with any variable dimension as 1."""
        tensors: dict[str, np.ndarray] = {}
        for state in self._states:
            if state.initial is not None:
                value = state.initial.copy()  # a Python model may write into its inputs: never share them
            else:
                shape = tuple(1 if d == -1 else d for d in state.dims)
                value = (np.full(shape, b"", dtype=object) if state.datatype.wire == "BYTES"
                         else np.zeros(shape, dtype=state.datatype.numpy))
            tensors[state.input_name] = value.reshape(self._batch_axis + value.shape)
        return SequenceState(tensors)

    def state_shapes(self, state: SequenceState | None) -> tuple[tuple[int, ...], ...]:
        """The shapes past the batch axis a request with this state feeds (the initial state's when None)."""
        tensors = (state or self.initial_state()).tensors
        skip = len(self._batch_axis)
        return tuple(tensors[s.input_name].shape[skip:] for s in self._states)

    def execution(
        self, request: InferenceRequest, start: bool, end: bool, corrid: SequenceId, state: SequenceState | None
    ) -> InferenceRequest:
        """The copy of `request` its instance runs: its inputs, the control inputs, the state inputs; its requested
        outputs plus the state outputs."""
        inputs = list(request.inputs)
        inputs += [self._control_values[(c.name, self._value_of(c, start, end, True))] for c in self._booleans]
        if self._corrid is not None:
            inputs.append(self._corrid_tensor(corrid))
        outputs = request.outputs
        if state is not None:
            for spec in self._states:
                value = state.tensors[spec.input_name]
                inputs.append(InputTensor(spec.input_name, spec.datatype.wire, value.shape, value))
            if outputs is not None:  # asked for by name too, so the instance computes them (None: it sends all)
                outputs = [*outputs, *self._unrequested_states(outputs)]
        return dataclasses.replace(request, inputs=inputs, outputs=outputs)

    def null(self, like: InferenceRequest) -> InferenceRequest:
        """Triton's null request for an empty slot of a direct batch: `like`'s inputs as zeros, the controls saying
        not ready (READY false, START and END false, correlation id 0) and no outputs asked for."""
        inputs: list[InputTensor] = []
        controls = {c.name: c for c in self._booleans}
        for tensor in like.inputs:
            control = controls.get(tensor.name)
            if control is not None:
                inputs.append(self._control_values[(control.name, self._value_of(control, False, False, False))])
            elif self._corrid is not None and tensor.name == self._corrid.name:
                inputs.append(self._corrid_tensor("" if self._corrid.datatype.wire == "BYTES" else 0))
            else:
                zeros = (np.full(tensor.shape, b"", dtype=object) if tensor.datatype == "BYTES"
                         else np.zeros(tensor.shape, dtype=tensor.data.dtype))
                inputs.append(InputTensor(tensor.name, tensor.datatype, tensor.shape, zeros))
        null = InferenceRequest(like.model_name, like.model_version, inputs, outputs=[])
        null.batch_size = like.batch_size
        return null

    def take_state(
        self, response: InferenceResponse, state: SequenceState, requested: list[RequestedOutput] | None
    ) -> None:
        """Move the state outputs out of `response` into `state`; a state the model did not send keeps its value.
        One the config also declares as an output stays in `response` when the client asked for it (`requested`;
        None: every output), as Triton's backends answer it while still carrying it as the state."""
        if not self._states:
            return
        returned = self._returned_states(requested)
        kept = []
        taken = 0
        for output in response.outputs:
            name = self._state_outputs.get(output.name)
            if name is None:
                kept.append(output)
                continue
            taken += 1
            if output.name in returned:
                kept.append(output)
                # The response's array is encoded later, perhaps after the next request ran (a Python model may
                # write into its inputs): the state keeps its own copy.
                state.tensors[name] = output.data.copy()
            else:
                state.tensors[name] = output.data
        if taken != len(self._state_outputs):
            self._warn_missing_state()
        response.outputs = kept

    def _unrequested_states(self, outputs: list[RequestedOutput]) -> list[RequestedOutput]:
        """The state outputs a request that names its outputs did not name (a declared state may be among them)."""
        if not self._declared_states:
            return [RequestedOutput(name) for name in self._state_outputs]
        named = {o.name for o in outputs}
        return [RequestedOutput(name) for name in self._state_outputs if name not in named]

    def _returned_states(self, requested: list[RequestedOutput] | None) -> frozenset[str]:
        """The declared state outputs the client gets: those it asked for, or all of them when it named none."""
        if not self._declared_states or requested is None:
            return self._declared_states
        return self._declared_states.intersection(o.name for o in requested)

    def _warn_missing_state(self) -> None:
        if not self._warned_missing_state:
            self._warned_missing_state = True
            logger.warning(
                "model '%s' answered a request of a sequence without all of its state outputs %s: a state it did not "
                "send keeps its value", self._model, sorted(self._state_outputs),
            )

    # ---- tensors --------------------------------------------------------------------------------------------

    @staticmethod
    def _value_of(control: ControlInput, start: bool, end: bool, ready: bool) -> bool:
        if control.kind == _START:
            return start and ready
        if control.kind == _END:
            return end and ready
        return ready

    def _tensor(self, control: ControlInput, value: np.ndarray) -> InputTensor:
        shape = (*self._batch_axis, 1)
        data = value.reshape(shape)
        return InputTensor(control.name, control.datatype.wire, shape, data)

    def _corrid_tensor(self, corrid: SequenceId) -> InputTensor:
        control = self._corrid
        assert control is not None
        if control.datatype.wire == "BYTES":
            text = corrid if isinstance(corrid, str) else str(corrid)
            return self._tensor(control, np.array(text.encode(), dtype=object))
        # As Triton copies the id's low bytes into a narrower control: the value wraps, it is never refused.
        number = np.array(int(corrid) if not isinstance(corrid, str) else 0, dtype=np.uint64)
        return self._tensor(control, number.astype(control.datatype.numpy))
