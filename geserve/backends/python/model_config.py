"""`pb_utils.ModelConfig`: the config a model's `auto_complete_config` reads and completes, as a JSON dict."""

from __future__ import annotations

from typing import Any

_TENSOR_KEYS = ("name", "data_type", "dims")


class ModelConfig:
    """Wraps the config in its JSON form (what `/config` prints); the setters refuse what contradicts it."""

    def __init__(self, model_config: dict[str, Any]) -> None:
        self._model_config = model_config

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """The model's largest batch; a config may ask for less, never for more."""
        if not isinstance(max_batch_size, int) or max_batch_size < 0:
            raise ValueError(f"max_batch_size must be a non-negative integer, got {max_batch_size!r}")
        configured = int(self._model_config.get("max_batch_size", 0) or 0)
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config function for "
                f"model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        if configured == 0:
            self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        if "sequence_batching" in self._model_config:
            raise ValueError(
                f"configuration specified scheduling_choice as 'sequence_batching', but auto-complete-config "
                f"function for model '{self._name}' tries to set scheduling_choice as 'dynamic_batching'"
            )
        self._model_config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        unknown = set(transaction_policy_dict) - {"decoupled"}
        if unknown:
            raise ValueError(f"model_transaction_policy has no field(s) {sorted(unknown)}; only 'decoupled'")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        decoupled = bool(transaction_policy_dict.get("decoupled", False))
        if "decoupled" in policy and bool(policy["decoupled"]) != decoupled:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model '{self._name}', which is "
                f"already set to '{policy['decoupled']}'."
            )
        policy["decoupled"] = decoupled

    def add_input(self, input: dict[str, Any]) -> None:
        self._add_tensor("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add_tensor("output", output)

    def _add_tensor(self, kind: str, tensor: dict[str, Any]) -> None:
        """A new tensor is appended; one the config already names must agree with it (missing fields filled)."""
        if not isinstance(tensor, dict):
            raise ValueError(f"{kind} in auto-complete-config function for model '{self._name}' must be a dict")
        for key in _TENSOR_KEYS:
            if key not in tensor:
                raise ValueError(
                    f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model "
                    f"'{self._name}' is missing '{key}' property."
                )
        tensors = self._model_config.setdefault(kind, [])
        for existing in tensors:
            if existing.get("name") != tensor["name"]:
                continue
            for key, value in tensor.items():
                current = existing.get(key)
                if _unset(current):
                    existing[key] = value
                elif key in ("data_type", "dims") and _normal(current) != _normal(value):
                    raise ValueError(
                        f"unable to load model '{self._name}', configuration expects {key} {current} for {kind} "
                        f"'{tensor['name']}' but auto-complete-config function for model sets {value}"
                    )
            return
        tensors.append(dict(tensor))


def _unset(value: Any) -> bool:
    return value is None or value == [] or value == "" or value == "TYPE_INVALID"


def _normal(value: Any) -> Any:
    return [int(d) for d in value] if isinstance(value, list | tuple) else value
