"""The KServe v2 / Triton HTTP frontend as a plain ASGI application: routing and wire translation only."""

from __future__ import annotations

import base64
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import orjson

from geserve.config import message_to_json_dict
from geserve.errors import (
    GeserveError,
    InvalidArgumentError,
    UnavailableError,
    UnknownModelError,
    UnsupportedError,
)
from geserve.frontends.http.answers import (
    JSON,
    TEXT,
    Answer,
    BodyTooLarge,
    HeaderLengthError,
    Response,
    UnsupportedEncoding,
    error_body,
    error_response,
    infer_response,
)
from geserve.frontends.http.codec import RequestParseError, decode_infer_request, parse_json
from geserve.frontends.http.express import ExpressLane, infer_target
from geserve.service.context import ApiGroup, CallContext, Transport
from geserve.service.service import InferenceService
from geserve.types import InferenceRequest

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_MODEL_ACTIONS = {"": "GET", "ready": "GET", "config": "GET", "stats": "GET", "infer": "POST"}
_SHM_ACTIONS = {"status": "GET", "register": "POST", "unregister": "POST"}
# Triton's HTTP wording for a setting of the wrong JSON type (its parser's; it answers them with 500, geserve 400).
_JSON_TYPE_ERRORS = {
    bool: "attempt to access JSON non-boolean as boolean",
    int: "attempt to access JSON non-unsigned-integer as unsigned-integer",
    str: "attempt to access JSON non-string as string",
}
_LOG_TYPES = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int,
              "log_format": str}
# Triton's order; trace_level is an array on the wire, the others single strings
_TRACE_KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")

# A request's body: whole (the native server reads it before answering) or to receive (ASGI).
BodySource = bytes | Receive


class ClientDisconnected(Exception):
    pass


class HttpFrontend:
    def __init__(self, service: InferenceService, max_input_size: int) -> None:
        self._service = service
        self._max_input_size = max_input_size
        self.lane = ExpressLane(service, max_input_size)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry (uvicorn); the native server calls `respond` without the ASGI messages."""
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            status, body, content_type, extra, trace = await self.respond(
                scope["method"], scope["path"], dict(scope["headers"]), receive, scope.get("client"),
                scope.get("extensions"),
            )
        except ClientDisconnected:
            return
        response_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *extra]
        if trace is not None:
            trace.mark("HTTP_SEND_START")
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})
        if trace is not None:
            trace.finish("HTTP_SEND_END")

    async def respond(
        self, method: str, path: str, headers: dict[bytes, bytes], source: BodySource,
        client: tuple[str, int] | None, extensions: dict[str, Any] | None,
    ) -> Answer:
        """One request's answer: status, body, content type, more headers, and the trace to finish once it is sent
        (set only on a request the service traced). `headers` have lower-case names; `extensions` are ASGI's (TLS).
        Raises ClientDisconnected only while receiving the body."""
        context = _context(client, headers, extensions)
        try:
            status, body, content_type, extra = await self._dispatch(method, path, source, headers, context)
        except ClientDisconnected:
            raise
        except Exception as exc:
            status, body, content_type, extra = error_response(exc, method, path)
        return status, body, content_type, extra, context.trace

    async def _dispatch(
        self, method: str, path: str, source: BodySource, headers: dict[bytes, bytes], context: CallContext
    ) -> Response:
        """Triton's routes; a known route asked with the wrong method is 405, anything else 404."""
        service = self._service
        parts = path.split("/")[1:]
        if not parts or parts[0] != "v2":
            return _not_found()
        if len(parts) == 1:
            return _json(service.server_metadata(context)) if method == "GET" else _not_allowed()
        group = parts[1]
        if group == "models" and len(parts) == 2:  # not Triton's: the list a newcomer asks first (the index's content)
            return _json({"models": service.model_list(context)}) if method == "GET" else _not_allowed()
        if group == "models" and len(parts) > 2:
            if parts[2:] == ["stats"]:
                return _json(await service.statistics(context=context)) if method == "GET" else _not_allowed()
            return await self._model_route(method, path, parts[2:], source, headers, context)
        if group == "health" and len(parts) == 3 and parts[2] in ("live", "ready"):
            if method != "GET":
                return _not_allowed(TEXT)
            ok = service.live(context) if parts[2] == "live" else service.ready(context)
            return (200, b"", TEXT, []) if ok else (400, b"", TEXT, [])
        if group == "repository":
            if parts[2:] == ["index"]:
                if method != "POST":
                    return _not_allowed()
                body = await self._read_body(source, headers)
                options = parse_json(body) if body.strip() else {}
                ready = options.get("ready", False) if isinstance(options, dict) else False
                if not isinstance(ready, bool):
                    raise RequestParseError("Invalid value for 'ready': expected a boolean")  # newer Triton's words
                return _json(service.repository_index(ready, context))
            if len(parts) == 5 and parts[2] == "models" and parts[3] and parts[4] in ("load", "unload"):
                if method != "POST":
                    return _not_allowed()
                return await self._repository_action(parts[3], parts[4], source, headers, context)
        if group in ("systemsharedmemory", "cudasharedmemory"):
            return await self._shm_route(group, method, parts[2:], source, headers, context)
        if parts[1:] == ["logging"]:
            if method == "GET":
                return _json(await service.log_settings(context=context))
            if method != "POST":
                return _not_allowed()
            changes = _log_changes(parse_json(await self._read_body(source, headers)))
            return _json(await service.log_settings(changes, context))
        if parts[1:] == ["trace", "setting"]:
            return await self._trace_setting("", method, source, headers, context)
        return _not_found()

    async def _shm_route(
        self, group: str, method: str, rest: list[str], source: BodySource, headers: dict[bytes, bytes],
        context: CallContext,
    ) -> Response:
        """`rest` follows /v2/{system,cuda}sharedmemory/: [region/{name}/]status|unregister, region/{name}/register."""
        name = ""
        if len(rest) == 3 and rest[0] == "region" and rest[1]:
            name, rest = rest[1], rest[2:]
        action = rest[0] if len(rest) == 1 else ""
        if _SHM_ACTIONS.get(action) is None or (action == "register" and not name):
            return _not_found()
        if method != _SHM_ACTIONS[action]:
            return _not_allowed()
        cuda = group == "cudasharedmemory"
        service = self._service
        if action == "status":
            if cuda:
                return _json([
                    {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
                    for r in service.cuda_shared_memory_status(name, context)
                ])
            return _json([
                {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in service.shared_memory_status(name, context)
            ])
        if action == "unregister":
            if cuda:
                await service.unregister_cuda_shared_memory(name, context)
            else:
                await service.unregister_shared_memory(name, context)
            return 200, b"", JSON, []
        options = parse_json(await self._read_body(source, headers))
        options = options if isinstance(options, dict) else {}
        if cuda:
            return await self._register_cuda(name, options, context)
        for field in ("key", "byte_size"):
            if field not in options:
                raise InvalidArgumentError(f"Shared memory register request has no '{field}' field")
        key, offset, byte_size = options["key"], options.get("offset", 0), options["byte_size"]
        if not isinstance(key, str):
            raise RequestParseError(_JSON_TYPE_ERRORS[str])
        if not all(type(v) is int and v >= 0 for v in (offset, byte_size)):
            raise RequestParseError(_JSON_TYPE_ERRORS[int])
        await service.register_shared_memory(name, key, offset, byte_size, context)
        return 200, b"", JSON, []

    async def _register_cuda(self, name: str, options: dict[str, Any], context: CallContext) -> Response:
        """`{"raw_handle": {"b64": ...}, "device_id": ..., "byte_size": ...}`, as tritonclient sends it."""
        if "raw_handle" not in options:
            raise InvalidArgumentError("Shared memory register request has no 'raw_handle' field")
        handle = options["raw_handle"]
        encoded = handle.get("b64") if isinstance(handle, dict) else None
        try:
            raw = base64.b64decode(encoded, validate=True) if isinstance(encoded, str) else b""
        except ValueError:
            raw = b""
        device_id, byte_size = options.get("device_id", 0), options.get("byte_size", 0)
        if not all(type(v) is int and v >= 0 for v in (device_id, byte_size)):
            raise RequestParseError(_JSON_TYPE_ERRORS[int])
        await self._service.register_cuda_shared_memory(name, raw, device_id, byte_size, context)
        return 200, b"", JSON, []

    async def _trace_setting(
        self, model: str, method: str, source: BodySource, headers: dict[bytes, bytes], context: CallContext
    ) -> Response:
        if method not in ("GET", "POST"):
            return _not_allowed()
        changes = _trace_changes(parse_json(await self._read_body(source, headers))) if method == "POST" else None
        values = await self._service.trace_setting(model, changes, context)
        ordered = {k: values[k] for k in _TRACE_KEYS if k in values}
        return _json({k: v if k == "trace_level" else "".join(v[:1]) for k, v in ordered.items()})

    async def _model_route(
        self, method: str, path: str, parts: list[str], source: BodySource, headers: dict[bytes, bytes],
        context: CallContext,
    ) -> Response:
        """`parts` follow /v2/models/: {name}[/versions/{digits}][/ready|/config|/stats|/infer]."""
        name, version, rest = parts[0], "", parts[1:]
        if rest == ["trace", "setting"] and name:
            return await self._trace_setting(name, method, source, headers, context)
        if rest[:1] == ["versions"]:
            if len(rest) < 2 or not rest[1].isdigit():
                return _not_found()
            version, rest = rest[1], rest[2:]
        action = rest[0] if rest else ""
        if not name or len(rest) > 1 or action not in _MODEL_ACTIONS:
            return _not_found()
        if method != _MODEL_ACTIONS[action]:
            return _not_allowed(TEXT if action in ("infer", "ready") else JSON)
        service = self._service
        if action == "infer":
            return await self._infer(path, name, version, source, headers, context)
        if action == "":
            return _json(service.model_metadata(name, version, context))
        if action == "ready":
            if await service.model_ready(name, version, context):
                return 200, b"", TEXT, []
            return 400, error_body("Model version not ready"), TEXT, []
        if action == "config":
            return _json(message_to_json_dict(service.model_config(name, version, context)))
        return _json(await service.statistics(name, version, context))

    async def _repository_action(
        self, name: str, action: str, source: BodySource, headers: dict[bytes, bytes], context: CallContext
    ) -> Response:
        body = await self._read_body(source, headers)
        options = parse_json(body) if body.strip() else {}
        parameters = options.get("parameters", {}) if isinstance(options, dict) else {}
        if action == "load":
            await self._service.load_model(name, parameters if isinstance(parameters, dict) else {}, context)
        else:
            await self._service.unload_model(name, context)
        return 200, b"", JSON, []

    async def _infer(
        self, path: str, name: str, version: str, source: BodySource, headers: dict[bytes, bytes],
        context: CallContext,
    ) -> Response:
        # Admitted before the body is read and decoded: a caller who may not infer costs no decoding. The service
        # does not admit the call again; the faults of the body still come after the model's lookup.
        self._service.admit_ahead(ApiGroup.INFERENCE, context, "infer", name)
        traced = self._service.tracer is not None  # the receive times of a request the service may trace
        receive_start = time.monotonic_ns() if traced else 0
        body = b""
        try:
            body = await self._read_body(source, headers)
            if traced:
                context.trace_marks = [("HTTP_RECV_START", receive_start), ("HTTP_RECV_END", time.monotonic_ns())]
            request = self._decode(name, version, body, headers)
        except GeserveError as exc:  # reported once the model is known: an unknown model is 404 whatever the body
            request = InferenceRequest(name, version, [], fault=exc)
        try:
            response = await self._service.infer(request, context)
        except UnknownModelError as exc:  # a body left unread past the size limit cannot be skipped: close
            extra = [(b"connection", b"close")] if isinstance(request.fault, BodyTooLarge) else []
            return 404, error_body(exc.message), TEXT, extra
        answer = infer_response(response, request, headers)
        if isinstance(source, bytes):  # the native server's, which takes the lane
            self.lane.learn(path, headers, body)
        return answer

    def respond_soon(
        self, method: str, path: str, headers: dict[bytes, bytes], body: bytes, client: tuple[str, int] | None,
        extensions: dict[str, Any] | None, deliver: Callable[[Answer], None],
    ) -> Callable[[], None] | None:
        """The express lane (express.py) for a request it knows: queued, and answered later through `deliver`; the
        returned call withdraws it. None, having done nothing, for any other request: await `respond`."""
        if method != "POST" or extensions is not None:  # HTTPS: the caller's certificate is the routed path's
            return None
        return self.lane.submit(path, headers, body, deliver)

    def respond_now(
        self, method: str, path: str, headers: dict[bytes, bytes], body: bytes, client: tuple[str, int] | None,
        extensions: dict[str, Any] | None,
    ) -> Answer | None:
        """`respond` without awaiting, for an inference request whose model answers at once (see
        InferenceService.infer_now); None, having done nothing, for any other request: await `respond`."""
        target = infer_target(path) if method == "POST" else None
        if target is None:
            return None
        if extensions is None:  # HTTPS: the caller's certificate is the routed path's
            answer = self.lane.answer_now(path, headers, body)
            if answer is not None:
                return answer
        name, version = target
        model = self._service.model_now(name, version)
        if model is None:
            return None
        context = _context(client, headers, extensions)
        try:
            self._service.admit_ahead(ApiGroup.INFERENCE, context, "infer", name)  # as in `_infer`
            try:
                body = self._whole_body(body, headers)
                request = self._decode(name, version, body, headers)
            except GeserveError as exc:
                request = InferenceRequest(name, version, [], fault=exc)
            status, payload, content_type, extra = infer_response(
                self._service.infer_now(model, request, context), request, headers
            )
            self.lane.learn(path, headers, body)
        except Exception as exc:
            status, payload, content_type, extra = error_response(exc, method, path)
        return status, payload, content_type, extra, None

    def _decode(self, name: str, version: str, body: bytes, headers: dict[bytes, bytes]) -> InferenceRequest:
        length = _header_length(headers, len(body))
        return decode_infer_request(body, length, name, version, shm=self._service.shared_memory)

    async def _read_body(self, source: BodySource, headers: dict[bytes, bytes]) -> bytes:
        if isinstance(source, bytes):
            return self._whole_body(source, headers)
        return self._undo_codings(await _receive_body(source, headers, self._max_input_size), headers)

    def _whole_body(self, body: bytes, headers: dict[bytes, bytes]) -> bytes:
        """A body the native server read whole (it enforced the same limit), its content codings undone."""
        if len(body) > self._max_input_size:
            raise BodyTooLarge(_too_large(len(body), self._max_input_size))
        return self._undo_codings(body, headers)

    def _undo_codings(self, body: bytes, headers: dict[bytes, bytes]) -> bytes:
        limit = self._max_input_size
        encoding = headers.get(b"content-encoding")
        transfer = headers.get(b"transfer-encoding")
        if encoding or (transfer and transfer.strip().lower() != b"chunked"):
            for coding in reversed(_codings(encoding, transfer)):  # the last applied is the first undone
                body = _decompress(body, coding, limit)
        return body


class _HeaderView(Mapping[str, str]):
    """The request's headers as the service reads them (str, lower-case names), decoded on access: most requests
    read none or one, and decoding all of them was 2% of a small model's request."""

    __slots__ = ("_raw",)

    def __init__(self, raw: dict[bytes, bytes]) -> None:
        self._raw = raw

    def __getitem__(self, name: str) -> str:
        try:
            return self._raw[name.encode("latin-1")].decode("latin-1")
        except UnicodeEncodeError:  # no header has such a name
            raise KeyError(name) from None

    def __iter__(self) -> Iterator[str]:
        return (name.decode("latin-1") for name in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


async def _receive_body(receive: Receive, headers: dict[bytes, bytes], limit: int) -> bytes:
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
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _context(
    client: tuple[str, int] | None, headers: dict[bytes, bytes], extensions: dict[str, Any] | None
) -> CallContext:
    context = CallContext(Transport.HTTP, f"{client[0]}:{client[1]}" if client else "", _HeaderView(headers))
    if extensions is not None and "tls" in extensions:  # HTTPS; under mutual TLS, the verified client certificate
        context.peer_certificate_subject = extensions["tls"].get("client_cert_name")
    return context


def _header_length(headers: dict[bytes, bytes], body_size: int) -> int | None:
    """`Inference-Header-Content-Length`: the JSON header's size when binary tensor data follows it."""
    raw = headers.get(b"inference-header-content-length")
    if raw is None:
        return None
    try:
        length = int(raw)
    except ValueError:
        raise RequestParseError(
            f"Inference-Header-Content-Length must be an integer, got {raw.decode(errors='replace')}"
        ) from None
    if not 0 <= length <= body_size:
        raise HeaderLengthError(f"inference header size should be in range (0, {body_size}), got: {length}")
    return length


def _log_changes(body: Any) -> dict[str, Any]:
    """A logging request's changes, type-checked with Triton's HTTP messages (a non-object changes nothing)."""
    if not isinstance(body, dict):
        return {}
    changes = {k: v for k, v in body.items() if k in _LOG_TYPES}
    for key, value in changes.items():
        expected = _LOG_TYPES[key]
        if type(value) is not expected or (isinstance(value, int) and value < 0):
            raise RequestParseError(_JSON_TYPE_ERRORS[expected])
    if "log_file" in changes:
        raise UnsupportedError("log file location can not be updated through network protocol")
    log_format = changes.get("log_format")
    if log_format is not None and log_format not in ("default", "ISO8601"):
        raise UnavailableError(f"invalid argument for --log_format, got: {log_format}")  # sic: Triton's 503
    return changes


def _trace_changes(body: Any) -> dict[str, list[str]]:
    """A trace setting request's changes: `trace_level` an array of strings, the others a string; null clears."""
    if not isinstance(body, dict):
        return {}
    changes: dict[str, list[str]] = {}
    for key in _TRACE_KEYS[:-1]:  # trace_mode is fixed at start-up: Triton ignores a change
        if key not in body:
            continue
        value = body[key]
        if value is None:
            changes[key] = []
        elif key == "trace_level":
            if not isinstance(value, list):
                raise RequestParseError("attempt to access JSON non-array as array")
            if not all(isinstance(v, str) for v in value):
                raise RequestParseError(_JSON_TYPE_ERRORS[str])
            changes[key] = value
        elif isinstance(value, str):
            changes[key] = [value]
        else:
            raise RequestParseError(_JSON_TYPE_ERRORS[str])
    return changes


# A body of many tiny gzip members costs a decoder each: bounded, far above what a streaming client writes (one
# member per chunk: 64 MiB in 4 KiB chunks is 16384).
_MAX_GZIP_MEMBERS = 16384
_INFLATE_STEP = 16 * 1024
_GZIP_MAGIC = b"\x1f\x8b"


def _too_large(size: int, limit: int) -> str:
    return (
        f"request size of {size} bytes exceeds the maximum allowed value of {limit} bytes; "
        f"use --http-max-input-size to increase the limit"
    )


def _codings(content: bytes | None, transfer: bytes | None) -> list[bytes]:
    """The codings applied to a request body, in the order they were applied: its Content-Encoding list, then the
    Transfer-Encoding list but `chunked` (the HTTP server has undone that one). `identity` changes nothing."""
    codings = []
    for header, skipped in ((content, b""), (transfer, b"chunked")):
        if header:
            for item in header.split(b","):
                coding = item.strip().lower()
                if coding and coding not in (b"identity", skipped):
                    codings.append(coding)
    return codings


def _decompress(body: bytes, encoding: bytes, limit: int) -> bytes:
    """`body` decoded, at most `limit` bytes of it.

    A gzip body may hold several members one after another (RFC 1952): what a client writes when it compresses
    as it streams, one member per chunk or flush. Each is decoded and the results joined, as gzip(1) does; before,
    only the first was, and the cut-off JSON was answered 400 (as Triton 2.51 still does). As in Triton and before,
    a stream cut short yields what it holds and data after the end that is no gzip member is ignored: the parse
    that follows judges the result."""
    if encoding not in (b"gzip", b"x-gzip", b"deflate"):
        raise UnsupportedEncoding("Unsupported compression type")
    failed = f"failed to decompress the {encoding.decode()} request body: "
    deflate = encoding == b"deflate"
    wbits = zlib.MAX_WBITS if deflate else 16 + zlib.MAX_WBITS
    view = memoryview(body)
    parts: list[bytes] = []
    size = offset = members = 0
    while offset < len(body):
        members += 1
        if members > _MAX_GZIP_MEMBERS:
            raise InvalidArgumentError(f"{failed}more than {_MAX_GZIP_MEMBERS} gzip members")
        decompressor = zlib.decompressobj(wbits)
        while not decompressor.eof and offset < len(body):
            # The first member gets the rest of the body in one call (the usual body is one member); later ones get
            # bounded slices, so that the copy zlib makes of the data after a member stays small however many follow.
            chunk = view[offset:] if members == 1 else view[offset : offset + _INFLATE_STEP]
            try:
                part = decompressor.decompress(chunk, limit + 1 - size)
            except zlib.error as exc:
                raise InvalidArgumentError(f"{failed}{exc}") from None
            size += len(part)
            if size > limit:  # also the only way input is left unconsumed (`unconsumed_tail`)
                raise BodyTooLarge(_too_large(size, limit))
            parts.append(part)
            offset += len(chunk) - len(decompressor.unused_data)
        if deflate or not decompressor.eof or view[offset : offset + 2] != _GZIP_MAGIC:
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _json(value: Any) -> Response:
    return 200, orjson.dumps(value), JSON, []


def _not_found() -> Response:
    return 404, error_body("Not Found"), TEXT, []


def _not_allowed(content_type: bytes = JSON) -> Response:
    return 405, error_body("Method Not Allowed"), content_type, []


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
