"""Model files in a load request (Triton's model file override): the rules a `file:<path>` parameter must pass.

A load request may carry the model's files as `file:<version>/<name>` parameters, with the config in `config`
(required then, as in Triton): base64 text over HTTP (JSON cannot hold bytes), bytes over gRPC (`bytes_param`) and
in process. The service checks them here, once for every protocol, before anything is written:

- the path stays inside the model's folder: no absolute path, no `..`, no empty or `.` segment, no NUL (stricter
  than Triton, which accepts `1/../1/model.onnx` once normalized: one spelling per file leaves nothing to
  normalize, and nothing to collide);
- the files' total size, decoded, is at most `--model-load-max-file-bytes`, checked from the sizes alone before
  anything is decoded;
- the value has the protocol's type (Triton's words for a gRPC string), and HTTP's base64 is strict.

The repository writes what passes into a private folder (repository/store.py), and checks again that each file
lands inside it.
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from collections.abc import Mapping
from typing import Any

from geserve.errors import InvalidArgumentError
from geserve.service.context import Transport

FILE_PREFIX = "file:"
# A model file bigger than this rarely travels in a request: an ONNX file without external data is under 2 GiB (a
# protobuf limit), and the request holds the whole file in memory while it loads (over HTTP as base64 text too, a
# third larger, beside the decoded bytes). 1 GiB covers the models that are sent this way and keeps one request from
# taking the server's memory or temporary disk; larger models belong in the repository.
DEFAULT_MAX_FILE_BYTES = 1 << 30


def check_model_name(name: str) -> None:
    """Triton's check of a model name a load request gives: the name becomes a folder's name."""
    if not name:
        raise InvalidArgumentError("model name must not be empty")
    if not name.strip(" \t\n\v\f\r"):
        raise InvalidArgumentError("model name must not contain only whitespace characters")
    if ".." in name or "/" in name or "\0" in name:
        raise InvalidArgumentError(
            f"invalid model name '{name}', model name must not contain path traversal characters"
        )


def model_files(
    parameters: Mapping[str, Any], transport: Transport, limit: int, model: str
) -> dict[str, bytes] | None:
    """The files of a load request's `file:` parameters, by path inside the model's folder; None without any."""
    keys = [key for key in parameters if key.startswith(FILE_PREFIX)]
    if not keys:
        return None
    if parameters.get("config") is None:
        raise InvalidArgumentError("Load parameter 'config' must be specified for model file override")
    for key in keys:
        check_path(key)
    values = {key: _value(key, parameters[key], transport) for key in keys}
    total = sum(_decoded_size(value) for value in values.values())
    if total > limit:
        raise InvalidArgumentError(
            f"the model files of the load request for '{model}' are {total} bytes, more than the {limit} bytes "
            f"--model-load-max-file-bytes allows"
        )
    return {key[len(FILE_PREFIX):]: _decode(key, value) for key, value in values.items()}


def check_path(key: str) -> None:
    """A `file:` parameter's path must name a file inside the model's folder, in one spelling only."""
    path = key[len(FILE_PREFIX):]
    if path.startswith("/") or ".." in path.split("/"):
        normalized = posixpath.normpath(path) if path else path
        raise InvalidArgumentError(
            f"Invalid file parameter '{key}' with normalized path '{normalized}' must stay within model directory."
        )
    if "\0" in path:
        raise InvalidArgumentError(f"Invalid file parameter '{key}': the path holds a NUL character")
    if any(segment in ("", ".") for segment in path.split("/")):
        raise InvalidArgumentError(
            f"Invalid file parameter '{key}': the path must be <version>/<name>, relative, without empty or '.' "
            f"segments"
        )


def _value(key: str, value: Any, transport: Transport) -> str | bytes:
    if transport is Transport.HTTP:
        if not isinstance(value, str):
            raise InvalidArgumentError(f"File parameter '{key}' must have a base64-encoded string for its value")
        return value
    if not isinstance(value, bytes):
        raise InvalidArgumentError(f"File parameter '{key}' must have bytes type for its value")  # Triton's
    return value


def _decoded_size(value: str | bytes) -> int:
    """What a value holds once decoded, from its length alone (exact for valid base64; decoding checks the rest)."""
    if isinstance(value, bytes):
        return len(value)
    padding = 2 if value.endswith("==") else 1 if value.endswith("=") else 0
    return max(len(value) // 4 * 3 - padding, 0)


def _decode(key: str, value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:  # ValueError: a character outside ASCII
        raise InvalidArgumentError(f"File parameter '{key}' is not valid base64: {exc}") from None
