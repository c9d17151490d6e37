"""The `openai.embeddings` model parameter: which model answers OpenAI's `/v1/embeddings`, with which tensors,
tokenizer, length limit and `dimensions` rule; read from the config and checked against its tensors at load.

The value is one JSON object (config.pbtxt takes it in single quotes):

    parameters {
      key: "openai.embeddings"
      value: { string_value: '{"input": "TEXT", "output": "EMBEDDING", "tokenizer": "tokenizer.json",
                               "max_input_tokens": 256}' }
    }

`input` is a TYPE_STRING input taking one text per row, `output` a floating-point output of fixed size per row (the
vector), `tokenizer` a Hugging Face `tokenizers` file (tokenizer.json) inside the model's folder: the model's own,
which counts `usage` and decodes token-array inputs. `max_input_tokens` (default: the tokenizer file's truncation
length) is the most tokens a text may have, special tokens included; a longer one is refused with 400 unless
`truncate` is true, when it is cut to that many tokens first. `dimensions` says which `dimensions` a request may ask
for, the vector then cut to its first N values and L2-normalized again: `"any"` (1 up to the output's size) or a list
of sizes; it belongs only on Matryoshka-trained models, whose leading values are an embedding on their own. Without
it a request may ask only for the output's own size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tritonclient.grpc import model_config_pb2
from tritonclient.grpc.model_config_pb2 import ModelConfig

from geserve.errors import InvalidArgumentError

PARAMETER = "openai.embeddings"
_FIELDS = frozenset({"input", "output", "tokenizer", "max_input_tokens", "truncate", "dimensions"})
_FLOATS = frozenset(
    {model_config_pb2.TYPE_FP16, model_config_pb2.TYPE_FP32, model_config_pb2.TYPE_FP64, model_config_pb2.TYPE_BF16}
)
_ANY = "any"


@dataclass(frozen=True, slots=True)
class EmbeddingsSpec:
    """A model's `openai.embeddings` parameter, checked against its config."""

    input: str
    output: str
    tokenizer: str
    """The tokenizer file, relative to the model's folder."""
    size: int
    """Values per vector: the output's size per row."""
    max_input_tokens: int | None
    """None: the tokenizer file's truncation length (read with the file)."""
    truncate: bool
    dimensions: frozenset[int] | None
    """The `dimensions` a request may ask for besides `size`; None: any from 1 to `size`."""
    rows_per_request: int
    """Texts one inference request carries: the model's max_batch_size, 1 for a model without batching."""

    def allows(self, dimensions: int) -> bool:
        if dimensions == self.size:
            return True
        if self.dimensions is None:
            return 1 <= dimensions < self.size
        return dimensions in self.dimensions


def embeddings_spec(config: ModelConfig) -> EmbeddingsSpec | None:
    """The model's `openai.embeddings` parameter read and checked (InvalidArgumentError naming the problem); None
    for a model without it."""
    parameter = config.parameters.get(PARAMETER)
    if parameter is None:
        return None
    fields = _fields(config.name, parameter.string_value)
    output = _string(config.name, fields, "output")
    size = _vector_size(config, output)
    return EmbeddingsSpec(
        input=_text_input(config, _string(config.name, fields, "input")),
        output=output,
        tokenizer=_string(config.name, fields, "tokenizer"),
        size=size,
        max_input_tokens=_positive(config.name, "max_input_tokens", fields.get("max_input_tokens")),
        truncate=_flag(config.name, fields.get("truncate", False)),
        dimensions=_dimensions(config.name, fields.get("dimensions"), size),
        rows_per_request=max(config.max_batch_size, 1),
    )


def _fields(model: str, value: str) -> dict[str, Any]:
    try:
        fields = json.loads(value)
    except ValueError as exc:
        raise _invalid(model, f"is not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise _invalid(model, "must be a JSON object")
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise _invalid(model, f"has unknown fields {unknown}; it takes {sorted(_FIELDS)}")
    return fields


def _string(model: str, fields: dict[str, Any], field: str) -> str:
    value = fields.get(field)
    if not isinstance(value, str) or not value:
        raise _invalid(model, f"needs the field '{field}' (a string)")
    return value


def _text_input(config: ModelConfig, name: str) -> str:
    tensor = next((t for t in config.input if t.name == name), None)
    if tensor is None:
        raise _invalid(config.name, f"names input '{name}', which the model does not have")
    if tensor.data_type != model_config_pb2.TYPE_STRING:
        raise _invalid(config.name, f"input '{name}' must be TYPE_STRING (one text per row)")
    if list(tensor.dims) not in ([1], [-1]):
        raise _invalid(config.name, f"input '{name}' must have dims [1] or [-1] (one text per row)")
    return name


def _vector_size(config: ModelConfig, name: str) -> int:
    tensor = next((t for t in config.output if t.name == name), None)
    if tensor is None:
        raise _invalid(config.name, f"names output '{name}', which the model does not have")
    if tensor.data_type not in _FLOATS:
        raise _invalid(config.name, f"output '{name}' must be a floating-point tensor")
    dims = list(tensor.dims)
    if config.max_batch_size == 0 and len(dims) == 2 and dims[0] == 1:  # one text per request: [1, size]
        dims = dims[1:]
    if len(dims) != 1 or dims[0] < 1:
        raise _invalid(config.name, f"output '{name}' must have one fixed dimension per row ([384], say)")
    return int(dims[0])


def _positive(model: str, field: str, value: object) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise _invalid(model, f"field '{field}' must be a positive integer")
    return value


def _flag(model: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _invalid(model, "field 'truncate' must be true or false")
    return value


def _dimensions(model: str, value: object, size: int) -> frozenset[int] | None:
    """None for "any"; the sizes of a list; an empty set when absent (the output's own size only)."""
    if value is None:
        return frozenset()
    if value == _ANY:
        return None
    if isinstance(value, list) and value and all(type(v) is int and 1 <= v <= size for v in value):
        return frozenset(value)
    raise _invalid(model, f"field 'dimensions' must be \"any\" or a list of sizes from 1 to {size}")


def _invalid(model: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"model '{model}': parameter '{PARAMETER}' {problem}")
