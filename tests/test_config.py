"""config.pbtxt parsing, Triton's defaults, validation and the `/config` JSON form (no server)."""

from __future__ import annotations

import pytest

from geserve.config import fill_defaults, message_to_json_dict, parse_config_json, parse_config_text, validate
from geserve.devices import KIND_CPU
from geserve.errors import InvalidArgumentError

SIMPLE = """
name: "m"
platform: "graph_executor"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4, -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 2, 2 ] } } ]
dynamic_batching { max_queue_delay_microseconds: 100 }
"""


def test_json_form_prints_defaults_and_int64_as_numbers() -> None:
    config = parse_config_text(SIMPLE, "test")
    fill_defaults(config, KIND_CPU, "model.onnx")
    as_json = message_to_json_dict(config)
    assert as_json["input"][0]["dims"] == [4, -1]
    assert as_json["output"][0]["reshape"] == {"shape": [2, 2]}
    assert as_json["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    assert as_json["version_policy"] == {"latest": {"num_versions": 1}}
    assert as_json["instance_group"][0]["name"] == "m"  # Triton's default group is named after the model
    assert as_json["instance_group"][0]["kind"] == "KIND_CPU"
    assert as_json["instance_group"][0]["count"] == 1
    assert as_json["default_model_filename"] == "model.onnx"
    assert as_json["input"][0]["format"] == "FORMAT_NONE"  # a default printed, as Triton does
    assert as_json["model_warmup"] == []


def test_unnamed_configured_groups_are_numbered() -> None:
    config = parse_config_text(SIMPLE + "instance_group [ { count: 2 }, { count: 1 } ]", "test")
    fill_defaults(config, KIND_CPU, "model.onnx")
    assert [(g.name, g.count, g.kind) for g in config.instance_group] == [("m_0", 2, KIND_CPU), ("m_1", 1, KIND_CPU)]


def test_json_round_trip_through_load_override_form() -> None:
    config = parse_config_text(SIMPLE, "test")
    again = parse_config_json(__import__("json").dumps(message_to_json_dict(config)), "override")
    assert again == config


def test_parse_error_names_the_source() -> None:
    with pytest.raises(InvalidArgumentError, match=r"failed to parse /x/config\.pbtxt"):
        parse_config_text("max_batch_size: eight", "/x/config.pbtxt")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (SIMPLE.replace('name: "m"', 'name: "other"'), "expected 'm'"),
        (SIMPLE.replace("max_batch_size: 8", "max_batch_size: -1"), "max_batch_size"),
        (SIMPLE.replace("dims: [ 4, -1 ]", "dims: [ 0 ]"), "dimension must be integer >= 1"),
        (SIMPLE.replace("data_type: TYPE_FP32 dims: [ 4, -1 ]", "dims: [ 4 ]"), "must specify 'data_type'"),
        (SIMPLE + 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]', "specified multiple times"),
        (SIMPLE + "instance_group [ { count: -2 } ]", "'count' >= 1"),
    ],
)
def test_validation_rejects_what_triton_rejects(text: str, message: str) -> None:
    config = parse_config_text(text, "test")
    fill_defaults(config, KIND_CPU, "model.onnx")
    with pytest.raises(InvalidArgumentError, match=message):
        validate(config, "m")
