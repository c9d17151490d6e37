"""The Python backend: `backend: "python"` models (a `model.py` defining TritonPythonModel), run in the server's
process, or each instance in a process of its own when the config asks (isolation/)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from tritonclient.grpc.model_config_pb2 import ModelInstanceGroup

from geserve.backends.base import BackendKind, BackendSettings, InferenceHost, ModelInstance, ModelSource
from geserve.backends.python import completion, isolation, loader, metrics, runtime
from geserve.backends.python.instance import PythonInstance
from geserve.config import ModelConfig, message_to_json_dict
from geserve.errors import GeserveError
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
        self._spares = isolation.Spares()  # isolated models' auto-complete processes, for their first instances
        runtime.set_default_host(host)
        metrics.set_default_store(self._custom_metrics)

    def auto_complete_config(self, config: ModelConfig, source: ModelSource) -> None:
        """Call the model's static `auto_complete_config(ModelConfig)`, if it has one, on the config's JSON form: in
        a short-lived process of its own for an isolated model, as Triton runs it in a stub."""
        path = model_file(config, source)
        if isolation.wanted(config):
            isolation.complete_config(config, path, self._host, self._custom_metrics, self._spares)
        else:
            completion.complete(config, path, self._custom_metrics)

    def create_instances(self, config: ModelConfig, source: ModelSource) -> list[ModelInstance]:
        """One instance per execution context of every instance group, each importing model.py afresh (in its own
        process when the config asks for isolation)."""
        path = model_file(config, source)
        config_json = json.dumps(message_to_json_dict(config), separators=(",", ":"))
        outputs = [o.name for o in config.output]
        decoupled = config.model_transaction_policy.decoupled
        isolated = isolation.wanted(config)
        instances: list[ModelInstance] = []
        try:
            for group, name, device_id in _placements(config):
                args = {
                    "model_config": config_json,
                    "model_instance_kind": _KIND_NAMES.get(group.kind, "CPU"),
                    "model_instance_name": name,
                    "model_instance_device_id": str(device_id),
                    "model_repository": str(source.model_dir),
                    "model_version": str(source.version),
                    "model_name": config.name,
                }
                if isolated:
                    spec = isolation.InstanceSpec(name, config.name, str(path), outputs, decoupled, args)
                    instance: ModelInstance = isolation.start_instance(
                        spec, self._host, self._custom_metrics, self._spares)
                else:
                    module, scope = loader.import_for_instance(self._custom_metrics, path, config.name, name)
                    instance = PythonInstance(name, module, self._host, outputs, decoupled, scope)
                    instance.initialize(args)
                instances.append(instance)
        except GeserveError:
            for created in instances:
                created.finalize()
            raise
        logger.info("loaded Python model '%s' version %d: %d instance(s)%s%s", config.name, source.version,
                    len(instances), ", decoupled" if decoupled else "", ", each in its own process" if isolated else "")
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
