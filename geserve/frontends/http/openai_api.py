"""OpenAI's embeddings API on the HTTP port, as wire <-> core types: the JSON of `/v1/models` and `/v1/embeddings`,
and the one table from neutral error codes to OpenAI's statuses and error bodies. The rules are the service's
(service/embeddings.py); app.py routes the three paths here.

Error bodies are OpenAI's: `{"error": {"message", "type", "param", "code"}}`, `type` being `invalid_request_error` for
a 4xx and `server_error` for a 5xx, as OpenAI words them. Statuses are the HTTP frontend's table but where OpenAI has
none: an unsupported request is 400 (not 501: OpenAI's clients retry every 5xx).
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from geserve.errors import ErrorCode, GeserveError, UnauthenticatedError
from geserve.frontends.http.answers import JSON, Response, error_response
from geserve.service.embeddings import EmbeddingsCall, EmbeddingsError, EmbeddingsResult, ExposedModel

_FORMATS = ("float", "base64")
_STATUS = {ErrorCode.UNSUPPORTED: 400, ErrorCode.ALREADY_EXISTS: 400}  # else the HTTP frontend's (status.py)
_INPUT_SHAPES = "a string, an array of strings, an array of token ids or an array of token id arrays"


def embeddings_call(body: bytes) -> tuple[EmbeddingsCall, str]:
    """A `POST /v1/embeddings` body as the call and its `encoding_format`. `user` and fields OpenAI may add later are
    ignored."""
    try:
        fields = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise EmbeddingsError(f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(fields, dict):
        raise EmbeddingsError("The request body must be a JSON object")
    model = fields.get("model")
    if not isinstance(model, str) or not model:
        raise EmbeddingsError("You must provide a model parameter (a string)", param="model")
    encoding = fields.get("encoding_format") or "float"
    if encoding not in _FORMATS:
        raise EmbeddingsError(f"encoding_format must be 'float' or 'base64', got {encoding!r}", param="encoding_format")
    dimensions = fields.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions < 1):
        raise EmbeddingsError("dimensions must be a positive integer", param="dimensions")
    texts, tokens = _inputs(fields.get("input"))
    return EmbeddingsCall(model, texts, tokens, dimensions), encoding


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, None) or (None, token arrays)."""
    if isinstance(value, str):
        return [value], None
    if not isinstance(value, list) or not value:
        raise EmbeddingsError(f"'input' must be {_INPUT_SHAPES}, and not empty", param="input")
    if all(_is_token(v) for v in value):  # one input, as token ids
        return None, [value]
    return _several(value)


def _several(value: list[Any]) -> tuple[list[str] | None, list[list[int]] | None]:
    """A list of inputs: all texts, or all token arrays."""
    if all(isinstance(v, str) for v in value):
        return value, None
    if all(_is_token_array(v) for v in value):
        return None, value
    raise EmbeddingsError(f"'input' must be {_INPUT_SHAPES}", param="input")


def _is_token(value: Any) -> bool:
    return type(value) is int  # not a bool


def _is_token_array(value: Any) -> bool:
    return isinstance(value, list) and all(_is_token(v) for v in value)


def embeddings_body(result: EmbeddingsResult, encoding: str) -> bytes:
    vectors = result.vectors
    if encoding == "base64":  # little-endian float32, as OpenAI's clients decode it
        little = vectors.astype("<f4", copy=False)
        embeddings: list[Any] = [base64.b64encode(row.tobytes()).decode("ascii") for row in little]
    else:
        embeddings = list(vectors)
    data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(embeddings)]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    body = {"object": "list", "data": data, "model": result.model, "usage": usage}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def model_body(model: ExposedModel) -> dict[str, Any]:
    return {"id": model.id, "object": "model", "created": model.created, "owned_by": model.owned_by}


def models_body(models: list[ExposedModel]) -> bytes:
    return orjson.dumps({"object": "list", "data": [model_body(m) for m in models]})


def openai_error(exc: Exception, method: str, path: str) -> Response:
    """A failed call's answer in OpenAI's shape, with the headers the frontend's own answer carries (WWW-Authenticate,
    Retry-After, connection: close after an unread body) and its logging of unexpected errors."""
    status, _, _, extra = error_response(exc, method, path)
    param = reason = None
    if isinstance(exc, GeserveError):
        status = _STATUS.get(exc.code, status)
        message = exc.message
        if isinstance(exc, EmbeddingsError):
            param, reason = exc.param, exc.reason
        elif isinstance(exc, UnauthenticatedError):
            reason = "invalid_api_key"
    else:
        message = f"internal error: {exc}"
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": param, "code": reason}
    return status, orjson.dumps({"error": error}), JSON, extra
