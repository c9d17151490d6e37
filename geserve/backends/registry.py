"""Maps a config's `platform` / `backend` to the backend that serves it, and fills the implied name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from geserve.backends.base import Backend, BackendSettings, InferenceHost
from geserve.backends.ensemble import EnsembleBackend
from geserve.backends.ge import GeBackend
from geserve.backends.python import PythonBackend
from geserve.config import ModelConfig
from geserve.config.ensemble import ENSEMBLE_PLATFORM
from geserve.errors import InvalidArgumentError
from geserve.metrics.custom import CustomMetricStore

# backend name -> factory(settings, host, custom metrics); every GE dialect also reads `--backend-config=ge,...`
_BACKENDS: dict[str, Callable[[BackendSettings, InferenceHost, CustomMetricStore], Backend]] = {
    "ge": lambda settings, _host, _metrics: GeBackend(settings),
    "npu_ge": lambda settings, _host, _metrics: GeBackend(settings),
    "onnxruntime": lambda settings, _host, _metrics: GeBackend(settings),
    "ensemble": lambda settings, host, _metrics: EnsembleBackend(settings, host),
    "python": PythonBackend,
}
# platform -> backend, as Triton pairs them; an ensemble keeps its `backend` empty, as Triton prints it
_PLATFORMS = {"graph_executor": "ge", "onnxruntime_onnx": "onnxruntime", ENSEMBLE_PLATFORM: "ensemble"}
_DETECTABLE = {"model.onnx": ("onnxruntime_onnx", "onnxruntime"), "model.py": ("", "python")}


class BackendRegistry:
    """Creates each backend once, with the server's `--backend-config` settings for it and the store of the
    custom metrics models create."""

    def __init__(self, settings: dict[str, dict[str, str]], custom_metrics: CustomMetricStore | None = None) -> None:
        self._settings = settings
        self.custom_metrics = custom_metrics if custom_metrics is not None else CustomMetricStore()
        self._instances: dict[str, Backend] = {}
        self._host: InferenceHost | None = None

    @property
    def host(self) -> InferenceHost:
        if self._host is None:
            raise RuntimeError("the backend registry has no inference host attached")
        return self._host

    def attach_host(self, host: InferenceHost) -> None:
        """The data plane, which is built after the registry (it needs the model manager)."""
        self._host = host

    def complete_platform(self, config: ModelConfig, model_dir: Path) -> None:
        """Triton derives the backend from the platform (and the platform from the model file) when absent."""
        if not config.platform and not config.backend:
            for version_dir in sorted(p for p in model_dir.iterdir() if p.name.isdigit()):
                for filename, (platform, backend) in _DETECTABLE.items():
                    named = config.default_model_filename  # a named file counts for the kind its suffix says
                    if named and Path(named).suffix != Path(filename).suffix:
                        continue
                    if (version_dir / (named or filename)).exists():
                        config.platform, config.backend = platform, backend
                        return
        if config.platform == ENSEMBLE_PLATFORM:
            return
        if config.platform and not config.backend:
            backend = _PLATFORMS.get(config.platform)
            if backend is None:
                raise InvalidArgumentError(
                    f"unexpected platform type '{config.platform}' for {config.name}; "
                    f"supported: {', '.join(sorted(_PLATFORMS))}"
                )
            config.backend = backend
        if config.backend == "onnxruntime" and not config.platform:
            config.platform = "onnxruntime_onnx"

    def backend_for(self, config: ModelConfig) -> Backend:
        name = config.backend or (ENSEMBLE_PLATFORM if config.platform == ENSEMBLE_PLATFORM else "")
        if not name:
            raise InvalidArgumentError(
                f"model '{config.name}' names no 'backend' or 'platform', and none could be detected from its files"
            )
        factory = _BACKENDS.get(name)
        if factory is None:
            raise InvalidArgumentError(
                f"unable to find backend '{name}' for model '{config.name}'; "
                f"this server provides: {', '.join(sorted(_BACKENDS))}"
            )
        if name not in self._instances:
            merged = {**self._settings.get("ge", {}), **self._settings.get(name, {})}
            self._instances[name] = factory(BackendSettings(merged), self.host, self.custom_metrics)
        return self._instances[name]
