"""The backend registry: which backend a config's platform, backend name or model file selects (no server)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from geserve.backends.base import Backend, BackendSettings
from geserve.backends.ensemble import EnsembleBackend
from geserve.backends.ge import GeBackend
from geserve.backends.registry import BACKEND_KINDS, BackendRegistry
from geserve.config import ModelConfig, parse_config_text
from geserve.errors import InvalidArgumentError


class _Host:
    """An inference host nothing here calls."""

    loop = None


def _registry(settings: dict[str, dict[str, str]] | None = None) -> BackendRegistry:
    registry = BackendRegistry(settings or {})
    registry.attach_host(_Host())  # type: ignore[arg-type]
    return registry


def _completed(text: str, model_dir: Path, files: tuple[str, ...] = ()) -> ModelConfig:
    for name in files:
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "1" / name).write_bytes(b"")
    config = parse_config_text(text, "test")
    _registry().complete_platform(config, model_dir)
    return config


@pytest.mark.parametrize(
    ("text", "files", "platform", "backend"),
    [
        ('name: "m"', ("model.onnx",), "onnxruntime_onnx", "onnxruntime"),
        ('name: "m"', ("model.py",), "", "python"),
        ('name: "m" default_model_filename: "net.onnx"', ("net.onnx",), "onnxruntime_onnx", "onnxruntime"),
        ('name: "m" default_model_filename: "net.py"', ("net.py", "model.onnx"), "", "python"),
        ('name: "m" platform: "graph_executor"', (), "graph_executor", "ge"),
        ('name: "m" platform: "onnxruntime_onnx"', (), "onnxruntime_onnx", "onnxruntime"),
        ('name: "m" backend: "onnxruntime"', (), "onnxruntime_onnx", "onnxruntime"),
        ('name: "m" backend: "npu_ge"', (), "", "npu_ge"),
        ('name: "m" backend: "python"', (), "", "python"),
        ('name: "m" platform: "ensemble"', (), "ensemble", ""),
        ('name: "m"', ("model.graphdef",), "tensorflow_graphdef", "tensorflow"),
        ('name: "m" platform: "tensorflow_savedmodel"', (), "tensorflow_savedmodel", "tensorflow"),
    ],
)
def test_platform_and_backend_are_completed_as_triton_does(
    tmp_path: Path, text: str, files: tuple[str, ...], platform: str, backend: str
) -> None:
    config = _completed(text, tmp_path / "m", files)
    assert (config.platform, config.backend) == (platform, backend)


def test_a_platform_names_its_default_model_file_as_triton_does(tmp_path: Path) -> None:
    assert _completed('name: "m" platform: "tensorflow_savedmodel"', tmp_path / "m").default_model_filename == (
        "model.savedmodel")
    assert _completed('name: "m"', tmp_path / "g", ("model.graphdef",)).default_model_filename == "model.graphdef"
    assert _completed('name: "m" platform: "graph_executor"', tmp_path / "m").default_model_filename == ""
    named = 'name: "m" platform: "tensorflow_graphdef" default_model_filename: "frozen.pb"'
    assert _completed(named, tmp_path / "m").default_model_filename == "frozen.pb"


def test_an_unknown_platform_is_refused_with_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(InvalidArgumentError, match="unexpected platform type 'tensorrt_plan' for m; supported: "
                       "ensemble, graph_executor, onnxruntime_onnx, tensorflow_graphdef, "
                       "tensorflow_savedmodel"):
        _completed('name: "m" platform: "tensorrt_plan"', tmp_path / "m")


def test_backend_for_names_the_backend_or_says_what_exists() -> None:
    registry = _registry()
    assert isinstance(registry.backend_for(parse_config_text('name: "m" backend: "npu_ge"', "t")), GeBackend)
    assert isinstance(registry.backend_for(parse_config_text('name: "e" platform: "ensemble"', "t")), EnsembleBackend)
    # Triton's TensorFlow models are converted to ONNX and run by the GE backend.
    assert isinstance(registry.backend_for(parse_config_text('name: "m" backend: "tensorflow"', "t")), GeBackend)
    with pytest.raises(InvalidArgumentError, match="unable to find backend 'pytorch' for model 'm'; this server "
                       "provides: ensemble, ge, npu_ge, onnxruntime, python, tensorflow"):
        registry.backend_for(parse_config_text('name: "m" backend: "pytorch"', "t"))
    with pytest.raises(InvalidArgumentError, match="model 'm' names no 'backend' or 'platform'"):
        registry.backend_for(parse_config_text('name: "m"', "t"))


def test_each_backend_is_created_once_with_its_settings_over_the_shared_ones() -> None:
    registry = _registry({"ge": {"default-max-batch-size": "2", "a": "ge"}, "npu_ge": {"a": "npu"}})
    npu = registry.backend_for(parse_config_text('name: "m" backend: "npu_ge"', "t"))
    assert registry.backend_for(parse_config_text('name: "n" backend: "npu_ge"', "t")) is npu
    ge = registry.backend_for(parse_config_text('name: "m" backend: "ge"', "t"))
    assert ge is not npu
    assert isinstance(npu, GeBackend) and isinstance(ge, GeBackend)
    assert npu.default_max_batch_size == 2 and _settings(npu).values["a"] == "npu"
    assert _settings(ge).values["a"] == "ge"


def _settings(backend: Backend) -> BackendSettings:
    settings = backend._settings  # type: ignore[attr-defined]
    assert isinstance(settings, BackendSettings)
    return settings


def test_no_two_backends_claim_one_name_platform_or_model_file() -> None:
    for claims in (
        [name for kind in BACKEND_KINDS for name in kind.names],
        [platform for kind in BACKEND_KINDS for platform in kind.platforms],
        [file for kind in BACKEND_KINDS for file in kind.model_files],
    ):
        assert [claim for claim, count in Counter(claims).items() if count > 1] == []
