"""The backends this server provides, each declared by its own package (a BackendKind): maps a config's `platform`
/ `backend` (or its model file) to the backend that serves it, and creates each backend once. A new backend
declares its BackendKind in its package and gets one line in BACKEND_KINDS."""

from __future__ import annotations

from pathlib import Path

from geserve.backends import ensemble, ge, python
from geserve.backends.base import Backend, BackendKind, BackendSettings, InferenceHost
from geserve.config import ModelConfig
from geserve.errors import InvalidArgumentError
from geserve.metrics.custom import CustomMetricStore

BACKEND_KINDS: tuple[BackendKind, ...] = (ge.BACKEND_KIND, python.BACKEND_KIND, ensemble.BACKEND_KIND)

# The kinds indexed by what selects them; tests/test_backend_registry.py checks that no two kinds claim one name.
_BY_NAME = {name: kind for kind in BACKEND_KINDS for name in kind.names}
_BY_PLATFORM = {platform: kind for kind in BACKEND_KINDS for platform in kind.platforms}
_MODEL_FILES = {file: selected for kind in BACKEND_KINDS for file, selected in kind.model_files.items()}
# A platform's default model file (Triton's `model.savedmodel` for tensorflow_savedmodel, ...), where it has one.
_FILE_OF_PLATFORM = {platform: file for file, (platform, _) in _MODEL_FILES.items() if platform}


def _detect_from_files(config: ModelConfig, model_dir: Path) -> tuple[str, str]:
    """(platform, backend) of the first version folder's model file that selects a kind; empty when none does."""
    for version_dir in sorted(p for p in model_dir.iterdir() if p.name.isdigit()):
        for filename, (platform, backend) in _MODEL_FILES.items():
            named = config.default_model_filename  # a named file counts for the kind its suffix says
            if named and Path(named).suffix != Path(filename).suffix:
                continue
            if (version_dir / (named or filename)).exists():
                return platform, backend
    return "", ""


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
        """The service's model host, which is built after the registry (it needs the model manager)."""
        self._host = host

    def complete_platform(self, config: ModelConfig, model_dir: Path) -> None:
        """Triton derives the backend from the platform (and the platform from the model file) when absent."""
        if not config.platform and not config.backend:
            config.platform, config.backend = _detect_from_files(config, model_dir)
        if config.platform and not config.backend:
            kind = _BY_PLATFORM.get(config.platform)
            if kind is None:
                raise InvalidArgumentError(
                    f"unexpected platform type '{config.platform}' for {config.name}; "
                    f"supported: {', '.join(sorted(_BY_PLATFORM))}"
                )
            config.backend = kind.platforms[config.platform]
        if config.backend and not config.platform:
            named_kind = _BY_NAME.get(config.backend)
            if named_kind is not None:
                config.platform = named_kind.implied_platforms.get(config.backend, "")
        if not config.default_model_filename:
            config.default_model_filename = _FILE_OF_PLATFORM.get(config.platform, "")

    def backend_for(self, config: ModelConfig) -> Backend:
        name = config.backend
        if not name and config.platform in _BY_PLATFORM:  # an ensemble: its platform alone names its backend
            name = _BY_PLATFORM[config.platform].names[0]
        if not name:
            raise InvalidArgumentError(
                f"model '{config.name}' names no 'backend' or 'platform', and none could be detected from its files"
            )
        kind = _BY_NAME.get(name)
        if kind is None:
            raise InvalidArgumentError(
                f"unable to find backend '{name}' for model '{config.name}'; "
                f"this server provides: {', '.join(sorted(_BY_NAME))}"
            )
        if name not in self._instances:
            merged = {**self._settings.get(kind.names[0], {}), **self._settings.get(name, {})}
            self._instances[name] = kind.create(BackendSettings(merged), self.host, self.custom_metrics)
        return self._instances[name]
