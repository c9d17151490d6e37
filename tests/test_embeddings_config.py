"""The `openai.embeddings` model parameter (geserve/config/embeddings.py): read and checked against the model's config
when it loads, each mistake refused naming the model, the parameter and the problem."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from geserve.backends.ge.parameters import parse_ge_options
from geserve.config import validate
from geserve.config.embeddings import embeddings_spec
from geserve.errors import InvalidArgumentError

TENSORS = """
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }, { name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }, { name: "LABEL" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "RAGGED" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
GOOD = '{"input": "TEXT", "output": "EMBEDDING", "tokenizer": "tokenizer.json"}'


def _config(
    value: str | None, max_batch_size: int = 8, platform: str = "onnxruntime_onnx"
) -> model_config_pb2.ModelConfig:
    text = f'name: "m" platform: "{platform}" max_batch_size: {max_batch_size} {TENSORS}'
    if value is not None:
        text += f" parameters {{ key: \"openai.embeddings\" value: {{ string_value: '{value}' }} }}"
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_a_model_without_the_parameter_is_not_exposed() -> None:
    assert embeddings_spec(_config(None)) is None


def test_the_parameter_read_with_its_defaults() -> None:
    spec = embeddings_spec(_config(GOOD))
    assert spec is not None
    assert (spec.input, spec.output, spec.tokenizer, spec.size) == ("TEXT", "EMBEDDING", "tokenizer.json", 384)
    assert (spec.max_input_tokens, spec.truncate, spec.dimensions, spec.rows_per_request) == (None, False,
                                                                                             frozenset(), 8)
    assert spec.allows(384) and not spec.allows(128)


def test_dimensions_any_or_a_list() -> None:
    anything = embeddings_spec(_config(GOOD[:-1] + ', "dimensions": "any", "truncate": true}'))
    assert anything is not None and anything.truncate
    assert anything.allows(1) and anything.allows(383) and anything.allows(384) and not anything.allows(385)
    listed = embeddings_spec(_config(GOOD[:-1] + ', "dimensions": [128, 256], "max_input_tokens": 64}'))
    assert listed is not None and listed.max_input_tokens == 64
    assert [d for d in (64, 128, 256, 384) if listed.allows(d)] == [128, 256, 384]


def test_a_model_without_batching_takes_one_text_per_request() -> None:
    spec = embeddings_spec(_config(GOOD, max_batch_size=0))
    assert spec is not None and spec.rows_per_request == 1


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("{not json", "is not JSON"),
        ('["TEXT"]', "must be a JSON object"),
        (GOOD[:-1] + ', "pooling": "mean"}', "unknown fields ['pooling']"),
        ('{"output": "EMBEDDING", "tokenizer": "t.json"}', "needs the field 'input'"),
        ('{"input": "TEXT", "tokenizer": "t.json"}', "needs the field 'output'"),
        ('{"input": "TEXT", "output": "EMBEDDING"}', "needs the field 'tokenizer'"),
        ('{"input": "NOPE", "output": "EMBEDDING", "tokenizer": "t.json"}', "input 'NOPE', which the model does not"),
        ('{"input": "IDS", "output": "EMBEDDING", "tokenizer": "t.json"}', "must be TYPE_STRING"),
        ('{"input": "TEXT", "output": "NOPE", "tokenizer": "t.json"}', "output 'NOPE', which the model does not"),
        ('{"input": "TEXT", "output": "LABEL", "tokenizer": "t.json"}', "must be a floating-point tensor"),
        ('{"input": "TEXT", "output": "RAGGED", "tokenizer": "t.json"}', "one fixed dimension per row"),
        (GOOD[:-1] + ', "max_input_tokens": 0}', "'max_input_tokens' must be a positive integer"),
        (GOOD[:-1] + ', "truncate": "yes"}', "'truncate' must be true or false"),
        (GOOD[:-1] + ', "dimensions": [512]}', "a list of sizes from 1 to 384"),
        (GOOD[:-1] + ', "dimensions": []}', "a list of sizes from 1 to 384"),
    ],
)
def test_mistakes_fail_the_load_naming_the_problem(value: str, problem: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"model 'm': parameter 'openai\.embeddings'") as caught:
        validate(_config(value), "m")
    assert problem in caught.value.message


def test_the_ge_backend_accepts_the_parameter() -> None:
    config = _config(GOOD, platform="graph_executor")
    parse_ge_options(config)  # the GE dialects refuse unknown keys: this one is known
    validate(config, "m")
