"""A Python model's static `auto_complete_config(ModelConfig)` hook, run on the config's JSON form in this process
(the server's, or for an isolated model a short-lived process of its own, as Triton runs it in a stub)."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format

from geserve.backends.python import loader, metrics
from geserve.backends.python.model_config import ModelConfig as AutoCompleteConfig
from geserve.config import ModelConfig, message_to_json_dict
from geserve.errors import InvalidArgumentError


def complete(config: ModelConfig, path: Path, store: metrics.MetricStore) -> None:
    """Fill `config` in place from the hook of the model file at `path`, if it has one."""
    # Metric families the file makes here (at import, in the hook) belong to this throwaway import only.
    scope = metrics.MetricScope(store, config.name)
    try:
        with metrics.bound(scope):
            _complete(config, path)
    finally:
        scope.close()


def _complete(config: ModelConfig, path: Path) -> None:
    module = loader.import_model_file(path, config.name)
    try:
        hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
        if hook is None:
            return
        wrapper = AutoCompleteConfig(message_to_json_dict(config))
        try:
            result = hook(wrapper)
        except BaseException as exc:
            raise InvalidArgumentError(
                f"auto_complete_config of Python model '{config.name}' failed: {loader.describe(exc)}"
            ) from None
        completed = (result if isinstance(result, AutoCompleteConfig) else wrapper).as_dict()
        parsed = ModelConfig()
        try:
            json_format.ParseDict(completed, parsed)
        except (json_format.ParseError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"auto_complete_config of Python model '{config.name}' produced an invalid config: {exc}"
            ) from None
        config.CopyFrom(parsed)
    finally:
        loader.forget(module)
