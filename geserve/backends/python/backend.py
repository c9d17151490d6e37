"""The Python backend: `backend: "python"` models (a `model.py` defining TritonPythonModel), run in-process."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from google.protobuf import json_format
from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup

from geserve.backends.base import BackendKind, BackendSettings, InferenceHost, ModelSource
from geserve.backends.python import loader, metrics, runtime
from geserve.backends.python.instance import PythonInstance
from geserve.backends.python.model_config import ModelConfig as AutoCompleteConfig
from geserve.config import ModelConfig, message_to_json_dict
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.metrics.custom import CustomMetricStore

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILENAME = "model.py"
_KIND_NAMES = {0: "CPU", 1: "GPU", 2: "CPU", 3: "MODEL"}  # KIND_AUTO runs on the CPU here


def model_file(config: ModelConfig, source: ModelSource) -> Path:
    return source.version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)


class PythonBackend:
    name = "python"
    default_model_filename = DEFAULT_MODEL_FILENAME

    def __init__(
        self, settings: BackendSettings, host: InferenceHost, custom_metrics: CustomMetricStore | None = None
    ) -> None:
        self._settings = settings
        self._host = host
        self._custom_metrics = custom_metrics if custom_metrics is not None else CustomMetricStore()
        runtime.set_default_host(host)
        metrics.set_default_store(self._custom_metrics)

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        """Call the model's static `auto_complete_config(ModelConfig)`, if it has one, on the config's JSON form."""
        # Metric families the file makes here (at import, in the hook) belong to this throwaway import only.
        scope = metrics.MetricScope(self._custom_metrics, config.name)
        try:
            with metrics.bound(scope):
                self._auto_complete(config, source)
        finally:
            scope.close()

    def _auto_complete(self, config: ModelConfig, source: ModelSource) -> None:
        module = loader.import_model_file(model_file(config, source), config.name)
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

    def _import(self, path: Path, model_name: str, instance_name: str) -> tuple[ModuleType, metrics.MetricScope]:
        """A fresh import of model.py for one instance, with the metrics scope its import-time families go to."""
        scope = metrics.MetricScope(self._custom_metrics, instance_name)
        try:
            with metrics.bound(scope):  # families made at import belong to the instance
                module = loader.import_model_file(path, model_name)
        except GeserveError:
            scope.close()
            raise
        return module, scope

    def create_instances(self, config: ModelConfig, source: ModelSource) -> list[PythonInstance]:
        """One instance per execution context of every instance group, each importing model.py afresh."""
        path = model_file(config, source)
        config_json = json.dumps(message_to_json_dict(config), separators=(",", ":"))
        outputs = [o.name for o in config.output]
        decoupled = config.model_transaction_policy.decoupled
        instances: list[PythonInstance] = []
        try:
            for group, name, device_id in _placements(config):
                module, scope = self._import(path, config.name, name)
                instance = PythonInstance(name, module, self._host, outputs, decoupled, scope)
                instance.initialize({
                    "model_config": config_json,
                    "model_instance_kind": _KIND_NAMES.get(group.kind, "CPU"),
                    "model_instance_name": name,
                    "model_instance_device_id": str(device_id),
                    "model_repository": str(source.model_dir),
                    "model_version": str(source.version),
                    "model_name": config.name,
                })
                instances.append(instance)
        except GeserveError:
            for instance in instances:
                instance.finalize()
            raise
        logger.info("loaded Python model '%s' version %d: %d instance(s)%s", config.name, source.version,
                    len(instances), ", decoupled" if decoupled else "")
        return instances


def _placements(config: ModelConfig) -> Iterator[tuple[ModelInstanceGroup, str, int]]:
    """Each instance to create: its group, its name and its device, in Triton's order."""
    for group in config.instance_group:
        device_ids = list(group.gpus) if group.kind == 1 and group.gpus else [0]
        index = 0
        for device_id in device_ids:
            for _ in range(group.count):
                yield group, f"{group.name}_{index}", device_id
                index += 1


BACKEND_KIND = BackendKind(
    names=("python",),
    create=PythonBackend,
    model_files={DEFAULT_MODEL_FILENAME: ("", "python")},  # Triton leaves a Python model's platform empty
)
