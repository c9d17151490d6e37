"""The trace settings a client reads and changes at run time, global and per model, and which requests they sample.

Kept and answered as Triton keeps them: values are lists of strings on the wire; a model's settings are the global
ones overlaid with its own; each scope (the global one, each model with settings of its own) samples every
`trace_rate`-th request until `trace_count` traces are taken (-1: no end), and reports the count left. The count
is the server's: its workers (--workers) count down the same one (ledger.py).
"""

from __future__ import annotations

from geserve.errors import InvalidArgumentError, UnsupportedError
from geserve.service.tracing.config import TraceConfig
from geserve.service.tracing.ledger import Ledger, Remaining

TIMESTAMPS = 1
TENSORS = 2
_LEVEL_FLAGS = {"TIMESTAMPS": TIMESTAMPS, "TENSORS": TENSORS}
_UINT32 = 0xFFFFFFFF
KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")


def level_flags(levels: list[str]) -> int:
    flags = 0
    for name in levels:
        flags |= _LEVEL_FLAGS.get(name, 0)  # Triton ignores a name it does not know
    return flags


class Scope:
    """One set of effective settings and its sampling state."""

    __slots__ = ("level", "log_frequency", "rate", "remaining", "seen", "values")

    def __init__(self, values: dict[str, list[str]], remaining: Remaining) -> None:
        self.values = values
        self.level = level_flags(values["trace_level"])
        self.rate = int(values["trace_rate"][0])
        self.remaining = remaining
        self.log_frequency = int(values["log_frequency"][0])
        self.seen = 0

    @property
    def count(self) -> int:
        return self.remaining.left

    @property
    def on(self) -> bool:
        return bool(self.level) and self.remaining.left != 0

    def sample(self) -> int:
        """The level to trace the next request at; 0: not traced. Every `rate`-th request this process sees (the
        workers of a server sample apart), while the server has traces left to take."""
        remaining = self.remaining
        if not self.level or not remaining.left or not self.rate:
            return 0
        self.seen += 1
        if self.seen % self.rate or not remaining.take():
            return 0
        return self.level

    def report(self) -> dict[str, list[str]]:
        return {**self.values, "trace_count": [str(self.remaining.left)]}


class TraceSettings:
    """The global scope and the models' own; `update` validates with Triton's messages, then applies."""

    def __init__(self, config: TraceConfig | None = None, ledger: Ledger | None = None) -> None:
        """`ledger`: where the traces left are counted (shared by the workers of a server; by default this
        process's)."""
        config = config or TraceConfig()
        self.mode = config.mode
        self._ledger = ledger or Ledger()
        self._defaults: dict[str, list[str]] = {
            "trace_level": list(config.level), "trace_rate": [str(config.rate)], "trace_count": [str(config.count)],
            "log_frequency": [str(config.log_frequency)], "trace_file": [config.file], "trace_mode": [config.mode],
        }
        self.global_scope = Scope({k: list(v) for k, v in self._defaults.items()}, self._new_count(self._defaults))
        self._overrides: dict[str, dict[str, list[str]]] = {}
        self.model_scopes: dict[str, Scope] = {}

    @property
    def on(self) -> bool:
        """Whether any scope may still trace a request."""
        return self.global_scope.on or any(scope.on for scope in self.model_scopes.values())

    def scope(self, model: str) -> Scope:
        return self.model_scopes.get(model, self.global_scope)

    def get(self, model: str = "") -> dict[str, list[str]]:
        return self.scope(model).report() if model else self.global_scope.report()

    def update(self, changes: dict[str, list[str]], model: str = "", grpc: bool = False) -> dict[str, list[str]]:
        """Apply `changes` (an empty list clears a setting: a model's falls back to the global one, the global one
        to its start-up value). Nothing is applied when one change is refused."""
        given = {key: _parse(key, values, grpc) for key, values in changes.items() if key in KEYS[:-1]}
        parsed = {key: values for key, values in given.items() if values is not None}
        staged = self._staged(parsed, model)
        effective = {**self.global_scope.values, **staged} if model else staged
        carried, left = self._count(parsed, staged, effective, model)
        _check(effective, self.mode, left)
        self._apply(model, staged, carried)
        return self.get(model)

    def _staged(self, parsed: dict[str, list[str]], model: str) -> dict[str, list[str]]:
        """The scope's own settings with `parsed` applied: a cleared one dropped (a model's) or back to its
        start-up value (the global scope's)."""
        current = self._overrides.get(model, {}) if model else self.global_scope.values
        staged = dict(current)
        for key, values in parsed.items():
            if values:
                staged[key] = values
            elif model:
                staged.pop(key, None)
            else:
                staged[key] = list(self._defaults[key])
        return staged

    def _count(
        self, parsed: dict[str, list[str]], staged: dict[str, list[str]], effective: dict[str, list[str]], model: str
    ) -> tuple[Remaining | None, int]:
        """The count the changed scope keeps (None: a new one, or the server's for a model without its own) and
        the traces it has left."""
        # The traces left carry over unless this change sets the count (Triton's settings keep their count).
        carried = None if "trace_count" in parsed else self.scope(model).remaining
        if model and "trace_count" not in staged:
            return None, self.global_scope.remaining.left  # the model counts down the server's traces
        return carried, carried.left if carried is not None else int(effective["trace_count"][0])

    def _apply(self, model: str, staged: dict[str, list[str]], carried: Remaining | None) -> None:
        if model:
            self._overrides[model] = staged
            self.model_scopes[model] = self._model_scope(staged, carried)
            return
        self.global_scope = Scope(staged, carried if carried is not None else self._new_count(staged))
        for name, overrides in self._overrides.items():  # the models' scopes see the new global values
            self.model_scopes[name] = self._model_scope(overrides, self.model_scopes[name].remaining)

    def _model_scope(self, overrides: dict[str, list[str]], own: Remaining | None) -> Scope:
        """A model's scope: its own count of traces left when it sets `trace_count`, else the server's."""
        if "trace_count" not in overrides:
            return Scope({**self.global_scope.values, **overrides}, self.global_scope.remaining)
        return Scope({**self.global_scope.values, **overrides}, own if own is not None else self._new_count(overrides))

    def _new_count(self, values: dict[str, list[str]]) -> Remaining:
        return self._ledger.remaining(int(values["trace_count"][0]))


def _parse(key: str, values: list[str], grpc: bool) -> list[str] | None:
    """One setting's new value as Triton parses it (an empty list: cleared; None: left as it is)."""
    if key == "trace_file":
        raise UnsupportedError("trace file location can not be updated through network protocol")
    if not values:
        return []
    if key == "trace_level":
        return _parse_level(values)
    return _parse_number(key, values, grpc)


def _parse_level(values: list[str]) -> list[str] | None:
    if "OFF" in values:
        if len(values) > 1:
            raise InvalidArgumentError("Expect only one trace level 'OFF' is specified")
        return ["OFF"]
    names = [name for name in dict.fromkeys(values) if name in _LEVEL_FLAGS]
    return names or None  # no level Triton knows: the level stays as it is


def _parse_number(key: str, values: list[str], grpc: bool) -> list[str]:
    """trace_rate, trace_count, log_frequency."""
    try:
        number = int(values[0])
    except ValueError:
        raise InvalidArgumentError(f"Unable to parse '{key}', got: {values[0]}") from None
    if key == "trace_count":
        if number < -1:
            space = " " if grpc else ""  # sic: Triton's two frontends word it apart
            raise InvalidArgumentError(f"Unable to parse 'trace_count'. Expecting value >= -1, got:{space}{number}")
        return [str(number)]
    return [str(number & _UINT32)]  # Triton reads rates as unsigned 32-bit numbers: -1 is 4294967295


def _check(values: dict[str, list[str]], mode: str, left: int) -> None:
    if level_flags(values["trace_level"]):
        if int(values["trace_rate"][0]) == 0:
            raise InvalidArgumentError("Attempting to set invalid trace setting :sample rate must be non-zero")
        if mode == "triton" and not values["trace_file"][0]:
            raise InvalidArgumentError("Attempting to set invalid trace setting :trace file name is not given")
        if left == 0:  # sic: Triton gives no reason for a traced setting with no trace left to take
            raise InvalidArgumentError("Attempting to set invalid trace setting :")
