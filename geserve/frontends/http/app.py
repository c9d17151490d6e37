"""The KServe v2 / Triton HTTP frontend as a plain ASGI application: routing and wire translation only."""

from __future__ import annotations

import gzip
import logging
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from geserve.core.dataplane import DataPlane
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.frontends.http.codec import RequestParseError, decode_infer_request, encode_infer_response, parse_json
from geserve.frontends.http.status import HTTP_STATUS

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = b"application/json"
_TEXT = b"text/plain"
_OCTETS = b"application/octet-stream"
_EMPTY_OK = (200, b"", _TEXT)


class BodyTooLarge(InvalidArgumentError):
    pass


class ClientDisconnected(Exception):
    pass


class HttpFrontend:
    def __init__(self, dataplane: DataPlane, max_input_size: int) -> None:
        self._dataplane = dataplane
        self._max_input_size = max_input_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        try:
            status, body, content_type, extra = await self._dispatch(scope, receive, headers)
        except ClientDisconnected:
            return
        except GeserveError as exc:
            status, body, content_type = HTTP_STATUS[exc.code], _error_body(exc.message), _JSON
            extra = [(b"connection", b"close")] if isinstance(exc, BodyTooLarge) else []
        except Exception as exc:  # never let one request take the server down
            logger.exception("unhandled error serving %s %s", scope["method"], scope["path"])
            status, body, content_type, extra = 500, _error_body(f"internal error: {exc}"), _JSON, []
        response_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})

    async def _dispatch(
        self, scope: Scope, receive: Receive, headers: dict[bytes, bytes]
    ) -> tuple[int, bytes, bytes, list[tuple[bytes, bytes]]]:
        method = scope["method"]
        parts = scope["path"].strip("/").split("/")
        if not parts or parts[0] != "v2":
            return _not_found()
        if len(parts) >= 3 and parts[1] == "models" and (parts[2] != "stats" or len(parts) > 3):
            name = parts[2]
            version = ""
            rest = parts[3:]
            if len(rest) >= 2 and rest[0] == "versions":
                version, rest = rest[1], rest[2:]
            action = rest[0] if rest else ""
            if len(rest) > 1:
                return _not_found()
            if action == "infer" and method == "POST":
                return await self._infer(name, version, receive, headers)
            if method != "GET" and not (action == "stats" and method == "POST"):
                return _not_found()
            return self._model_get(name, version, action)
        route = "/".join(parts[1:])
        if method == "GET":
            if route == "health/live":
                return _EMPTY_OK + ([],) if self._dataplane.live() else (400, b"", _TEXT, [])
            if route == "health/ready":
                return _EMPTY_OK + ([],) if self._dataplane.ready() else (400, b"", _TEXT, [])
            if route == "":
                return _json(self._dataplane.server_metadata())
            if route == "models/stats":
                return _json(self._dataplane.statistics())
            return _not_found()
        if method == "POST":
            if route == "repository/index":
                body = await self._read_body(receive, headers)
                options = parse_json(body) if body.strip() else {}
                ready = bool(options.get("ready", False)) if isinstance(options, dict) else False
                return _json(self._dataplane.repository_index(ready))
            if len(parts) == 5 and parts[1] == "repository" and parts[2] == "models":
                return await self._repository_action(parts[3], parts[4], receive, headers)
        return _not_found()

    def _model_get(self, name: str, version: str, action: str) -> tuple[int, bytes, bytes, list]:
        if action == "":
            return _json(self._dataplane.model_metadata(name, version))
        if action == "ready":
            if self._dataplane.model_ready(name, version):
                return _EMPTY_OK + ([],)
            return 400, _error_body("Model version not ready"), _TEXT, []
        if action == "config":
            return _json(self._dataplane.model_config(name, version))
        if action == "stats":
            return _json(self._dataplane.statistics(name, version))
        return _not_found()

    async def _repository_action(
        self, name: str, action: str, receive: Receive, headers: dict[bytes, bytes]
    ) -> tuple[int, bytes, bytes, list]:
        body = await self._read_body(receive, headers)
        options = parse_json(body) if body.strip() else {}
        parameters = options.get("parameters", {}) if isinstance(options, dict) else {}
        if action == "load":
            config = parameters.get("config")
            if config is not None and not isinstance(config, str):
                raise InvalidArgumentError("the 'config' parameter of a load request must be a JSON string")
            files = [k for k in parameters if k.startswith("file:")]
            if files:
                raise InvalidArgumentError(
                    f"load request carries model files {files}; geserve loads model files from the repository only"
                )
            await self._dataplane.load_model(name, config)
            return 200, b"", _JSON, []
        if action == "unload":
            await self._dataplane.unload_model(name)
            return 200, b"", _JSON, []
        return _not_found()

    async def _infer(
        self, name: str, version: str, receive: Receive, headers: dict[bytes, bytes]
    ) -> tuple[int, bytes, bytes, list]:
        body = await self._read_body(receive, headers)
        header_length = headers.get(b"inference-header-content-length")
        length: int | None = None
        if header_length is not None:
            try:
                length = int(header_length)
            except ValueError:
                raise RequestParseError(
                    f"Inference-Header-Content-Length must be an integer, got {header_length.decode(errors='replace')}"
                ) from None
        raw_model = self._dataplane.model(name, version) if length == 0 else None
        request = decode_infer_request(body, length, name, version, raw_model)
        response = await self._dataplane.infer(request)
        parts, json_length = encode_infer_response(response, request)
        payload = parts[0] if len(parts) == 1 else b"".join(parts)
        extra: list[tuple[bytes, bytes]] = []
        content_type = _JSON
        if json_length is not None:
            extra.append((b"inference-header-content-length", str(json_length).encode()))
            content_type = _OCTETS
        encoding = _response_encoding(headers.get(b"accept-encoding"))
        if encoding is not None:
            payload = gzip.compress(payload, 1) if encoding == b"gzip" else zlib.compress(payload, 1)
            extra.append((b"content-encoding", encoding))
        return 200, payload, content_type, extra

    async def _read_body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes:
        limit = self._max_input_size
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(_too_large(int(declared), limit))
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(_too_large(size, limit))
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = headers.get(b"content-encoding")
        if encoding:
            body = _decompress(body, encoding.strip().lower(), limit)
        return body


def _too_large(size: int, limit: int) -> str:
    return (
        f"request size of {size} bytes exceeds the maximum allowed value of {limit} bytes; "
        f"use --http-max-input-size to increase the limit"
    )


def _decompress(body: bytes, encoding: bytes, limit: int) -> bytes:
    if encoding == b"identity":
        return body
    if encoding not in (b"gzip", b"deflate"):
        raise InvalidArgumentError(f"unsupported Content-Encoding '{encoding.decode(errors='replace')}'")
    wbits = 16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS
    decompressor = zlib.decompressobj(wbits)
    try:
        result = decompressor.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidArgumentError(f"failed to decompress the {encoding.decode()} request body: {exc}") from None
    if len(result) > limit or decompressor.unconsumed_tail:
        raise BodyTooLarge(_too_large(len(result), limit))
    return result


def _response_encoding(accept: bytes | None) -> bytes | None:
    if not accept:
        return None
    offered = [part.split(b";")[0].strip().lower() for part in accept.split(b",")]
    for encoding in offered:
        if encoding in (b"gzip", b"deflate"):
            return encoding
    return None


def _json(value: Any) -> tuple[int, bytes, bytes, list]:
    return 200, orjson.dumps(value), _JSON, []


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def _not_found() -> tuple[int, bytes, bytes, list]:
    return 404, _error_body("Not Found"), _TEXT, []


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
