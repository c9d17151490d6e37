"""Model configuration: config.pbtxt <-> Triton's ModelConfig, defaults, validation and the JSON form."""

from geserve.config.json_form import message_to_json_dict
from geserve.config.loader import ModelConfig, parse_config_json, parse_config_text, read_model_config
from geserve.config.validate import fill_defaults, validate

__all__ = [
    "ModelConfig",
    "fill_defaults",
    "message_to_json_dict",
    "parse_config_json",
    "parse_config_text",
    "read_model_config",
    "validate",
]
