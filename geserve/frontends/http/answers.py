"""The HTTP answers of inference and of failed calls: status, body, content type and headers, as Triton words them
(shared by every path of the frontend, app.py)."""

from __future__ import annotations

import gzip
import logging
import zlib

import orjson

from geserve.errors import GeserveError, InvalidArgumentError, UnsupportedError
from geserve.frontends.http.codec import HeaderLengthError, encode_infer_response
from geserve.frontends.http.status import HTTP_STATUS
from geserve.service.context import FrontendTrace
from geserve.service.shared_memory import OutputPlacementError
from geserve.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

JSON = b"application/json"
TEXT = b"text/plain"
OCTETS = b"application/octet-stream"

Response = tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]
# A response and the trace to finish once it is sent (HttpFrontend.respond).
Answer = tuple[int, bytes, bytes, list[tuple[bytes, bytes]], FrontendTrace | None]


class BodyTooLarge(InvalidArgumentError):
    pass


class UnsupportedEncoding(UnsupportedError):
    pass


# Triton answers these from its HTTP layer with a text/plain content type (the body is still JSON).
_PLAIN_TEXT_ERRORS = (HeaderLengthError, UnsupportedEncoding, OutputPlacementError)


def error_response(exc: Exception, method: str, path: str) -> Response:
    """A failed call's answer: a GeserveError by its code, anything else 500 (never taking the server down)."""
    if isinstance(exc, GeserveError):
        content_type = TEXT if isinstance(exc, _PLAIN_TEXT_ERRORS) else JSON
        extra = [(b"connection", b"close")] if isinstance(exc, BodyTooLarge) else []
        extra += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in exc.headers]
        return HTTP_STATUS[exc.code], error_body(exc.message), content_type, extra
    logger.error("unhandled error serving %s %s", method, path, exc_info=exc)
    return 500, error_body(f"internal error: {exc}"), JSON, []


def infer_response(response: InferenceResponse, request: InferenceRequest, headers: dict[bytes, bytes]) -> Response:
    """A successful inference's HTTP answer: binary outputs after the JSON header, compressed if the client asks."""
    parts, json_length = encode_infer_response(response, request)
    payload = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
    extra = []
    content_type = JSON
    if json_length is not None:
        extra.append((b"inference-header-content-length", str(json_length).encode()))
        content_type = OCTETS
    encoding = _response_encoding(headers.get(b"accept-encoding"))
    if encoding is not None:
        payload = gzip.compress(payload, 1) if encoding == b"gzip" else zlib.compress(payload, 1)
        extra.append((b"content-encoding", encoding))
    return 200, payload, content_type, extra


def _response_encoding(accept: bytes | None) -> bytes | None:
    if not accept:
        return None
    offered = [part.split(b";")[0].strip().lower() for part in accept.split(b",")]
    for encoding in offered:
        if encoding in (b"gzip", b"deflate"):
            return encoding
    return None


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})
