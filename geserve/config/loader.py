"""Reads a model's `config.pbtxt` (or a JSON override) into Triton's ModelConfig message."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc.model_config_pb2 import ModelConfig as ModelConfig  # re-exported by geserve.config

from geserve.errors import InvalidArgumentError

CONFIG_FILENAME = "config.pbtxt"


def parse_config_text(text: str, source: str) -> ModelConfig:
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        raise InvalidArgumentError(f"failed to parse {source}: {exc}") from None


def parse_config_json(text: str | bytes, source: str) -> ModelConfig:
    """The `config` parameter of a load request carries the config as JSON, as in Triton."""
    try:
        return json_format.Parse(text, ModelConfig())
    except json_format.ParseError as exc:
        raise InvalidArgumentError(f"failed to parse {source}: {exc}") from None


def read_model_config(model_dir: Path, allow_missing: bool) -> ModelConfig:
    """The config on disk; an empty one (to auto-complete) when absent and `allow_missing`."""
    path = model_dir / CONFIG_FILENAME
    if not path.is_file():
        if not allow_missing:
            raise InvalidArgumentError(
                f"{path}: model configuration file is missing and auto-complete is disabled"
            )
        return ModelConfig()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"failed to read {path}: {exc}") from None
    return parse_config_text(text, str(path))
