"""The KServe v2 / Triton HTTP frontend as a plain ASGI application: routing and wire translation only."""

from __future__ import annotations

import base64
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from functools import partial
from operator import itemgetter
from typing import Any, NamedTuple

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
    Response,
    UnsupportedEncoding,
    error_body,
    error_response,
    infer_response,
)
from geserve.frontends.http.codec import (
    RequestParseError,
    decode_infer_request,
    load_json,
    parse_json,
    refuse_deep_json,
    remember_prepared,
)
from geserve.frontends.http.openai_api import embeddings_body, embeddings_call, model_body, models_body, openai_error
from geserve.service.context import ApiGroup, CallContext, Transport
from geserve.service.deadlines import HTTP_DEADLINE_HEADER, http_deadline
from geserve.service.service import InferenceService
from geserve.types import InferenceRequest, InferenceResponse

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

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


class _Call(NamedTuple):
    """A routed request as its route's handler sees it: `args` are the path's parameters, in the pattern's order."""

    path: str
    args: tuple[str, ...]
    source: BodySource
    headers: dict[bytes, bytes]
    context: CallContext


Handler = Callable[["HttpFrontend", _Call], Awaitable[Response]]


class _Route:
    """One path pattern: its segments (a `{parameter}` takes any non-empty segment, `{version}` only digits), the
    handler of each method it serves, and the content type of the 405 that answers the others."""

    __slots__ = ("_literals", "_params", "_wanted", "handlers", "not_allowed", "segments")

    def __init__(self, pattern: str, not_allowed: bytes) -> None:
        self.segments = tuple(_segment(s) for s in pattern.split("/")[1:])
        self.handlers: dict[str, Handler] = {}
        self.not_allowed = not_allowed
        # one C call reads a path's segments where the pattern has literals (a tuple, or the one string); the same
        # call on the pattern gives the literals it wants there
        self._literals = itemgetter(*[i for i, s in enumerate(self.segments) if isinstance(s, str)])
        self._wanted = self._literals(self.segments)
        self._params = [(i, s) for i, s in enumerate(self.segments) if not isinstance(s, str)]

    def match(self, parts: list[str]) -> tuple[str, ...] | None:
        """The path's parameters if `parts` (as many as the pattern's segments) fit the pattern, else None."""
        if self._literals(parts) != self._wanted:
            return None
        args = []
        for i, accepts in self._params:
            if not accepts(parts[i]):
                return None
            args.append(parts[i])
        return tuple(args)


def _segment(text: str) -> str | Callable[[str], bool]:
    """A pattern's segment: itself, or for a parameter the test of the values it takes."""
    if not text.startswith("{"):
        return text
    return str.isdigit if text == "{version}" else bool


_SEEN_PATHS = 1024  # paths remembered by the router
_SEEN_PATH_SIZE = 256  # longest remembered: what they hold stays small whatever clients send


class _Router:
    """The route table compiled: routes grouped by pattern, tried in table order among those that could fit the path
    (as many segments, and the same last one unless the pattern's is a parameter). What is before the path's first
    `/` is not looked at."""

    def __init__(self, table: Iterable[tuple[str, str, Handler, bytes]]) -> None:
        routes: dict[str, _Route] = {}
        for method, pattern, handler, not_allowed in table:
            route = routes.setdefault(pattern, _Route(pattern, not_allowed))
            if route.not_allowed != not_allowed or method in route.handlers:
                raise ValueError(f"route {method} {pattern} given twice or with two 405 content types")
            route.handlers[method] = handler
        ordered = list(routes.values())
        # by segment count, the routes ending in a parameter; by count and last segment, those ending in it as well
        self._open = {size: _fitting(ordered, size, None) for size, _ in _ends(ordered)}
        self._by_tail = {
            (size, tail): _fitting(ordered, size, tail) for size, tail in _ends(ordered) if tail is not None
        }
        self._seen: dict[str, tuple[_Route, tuple[str, ...]]] = {}

    def find(self, path: str) -> tuple[_Route, tuple[str, ...]] | None:
        """The route `path` fits and its parameters; a short path that fitted is remembered (clients repeat theirs)."""
        found = self._seen.get(path)
        if found is None:
            found = self._search(path)
            if found is not None and len(path) <= _SEEN_PATH_SIZE:
                if len(self._seen) >= _SEEN_PATHS:
                    self._seen.clear()
                self._seen[path] = found
        return found

    def _search(self, path: str) -> tuple[_Route, tuple[str, ...]] | None:
        parts = path.split("/")[1:]
        size = len(parts)
        routes = self._by_tail.get((size, parts[-1])) if parts else None
        for route in self._open.get(size, ()) if routes is None else routes:
            args = route.match(parts)
            if args is not None:
                return route, args
        return None


def _ends(routes: list[_Route]) -> set[tuple[int, str | None]]:
    """Each route's segment count and last segment (None for a parameter)."""
    return {(len(r.segments), r.segments[-1] if isinstance(r.segments[-1], str) else None) for r in routes}


def _fitting(routes: list[_Route], size: int, tail: str | None) -> list[_Route]:
    """The routes, in order, that may fit a path of `size` segments ending in `tail` (None: in a segment no pattern
    ends in)."""
    return [
        r for r in routes
        if len(r.segments) == size and (r.segments[-1] == tail or not isinstance(r.segments[-1], str))
    ]


class HttpFrontend:
    def __init__(self, service: InferenceService, max_input_size: int) -> None:
        self._service = service
        self._max_input_size = max_input_size
        self.shortcuts = service.shortcuts

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
        """Triton's routes (`_ROUTER`): a known route asked with the wrong method is 405, anything else 404."""
        found = _ROUTER.find(path)
        if found is None:
            return _not_found()
        route, args = found
        handler = route.handlers.get(method)
        if handler is None:
            return _not_allowed(route.not_allowed)
        return await handler(self, _Call(path, args, source, headers, context))

    # ---- the routes' handlers (`_ROUTES` says which path and method each serves) ----

    async def _server_metadata(self, call: _Call) -> Response:
        return _json(self._service.server_metadata(call.context))

    async def _model_list(self, call: _Call) -> Response:  # not Triton's: the list a newcomer asks first
        return _json({"models": self._service.model_list(call.context)})

    async def _server_stats(self, call: _Call) -> Response:
        return _json(await self._service.statistics(context=call.context))

    async def _live(self, call: _Call) -> Response:
        return _health(self._service.live(call.context))

    async def _ready(self, call: _Call) -> Response:
        return _health(self._service.ready(call.context))

    async def _repository_index(self, call: _Call) -> Response:
        body = await self._read_body(call.source, call.headers)
        # `ready` is judged before the nesting depth: Triton's depth limit guards its reading of inference data, so
        # a deeply nested index request whose `ready` is no boolean is refused for `ready` there (qa/L0_http).
        options = load_json(body) if body.strip() else {}
        ready = options.get("ready", False) if isinstance(options, dict) else False
        if not isinstance(ready, bool):
            raise RequestParseError("Invalid value for 'ready': expected a boolean")  # newer Triton's words
        refuse_deep_json(body)
        return _json(self._service.repository_index(ready, call.context))

    async def _load(self, call: _Call) -> Response:
        return await self._repository_action(call.args[0], "load", call)

    async def _unload(self, call: _Call) -> Response:
        return await self._repository_action(call.args[0], "unload", call)

    async def _repository_action(self, name: str, action: str, call: _Call) -> Response:
        body = await self._read_body(call.source, call.headers)
        options = parse_json(body) if body.strip() else {}
        parameters = options.get("parameters", {}) if isinstance(options, dict) else {}
        if action == "load":
            await self._service.load_model(name, parameters if isinstance(parameters, dict) else {}, call.context)
        else:
            await self._service.unload_model(name, call.context)
        return 200, b"", JSON, []

    async def _system_shm_status(self, call: _Call) -> Response:
        return _json([
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in self._service.shared_memory_status(_region(call), call.context)
        ])

    async def _cuda_shm_status(self, call: _Call) -> Response:
        return _json([
            {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
            for r in self._service.cuda_shared_memory_status(_region(call), call.context)
        ])

    async def _system_shm_unregister(self, call: _Call) -> Response:
        await self._service.unregister_shared_memory(_region(call), call.context)
        return 200, b"", JSON, []

    async def _cuda_shm_unregister(self, call: _Call) -> Response:
        await self._service.unregister_cuda_shared_memory(_region(call), call.context)
        return 200, b"", JSON, []

    async def _system_shm_register(self, call: _Call) -> Response:
        options = await self._register_options(call)
        for field in ("key", "byte_size"):
            if field not in options:
                raise InvalidArgumentError(f"Shared memory register request has no '{field}' field")
        key, offset, byte_size = options["key"], options.get("offset", 0), options["byte_size"]
        if not isinstance(key, str):
            raise RequestParseError(_JSON_TYPE_ERRORS[str])
        if not all(type(v) is int and v >= 0 for v in (offset, byte_size)):
            raise RequestParseError(_JSON_TYPE_ERRORS[int])
        await self._service.register_shared_memory(call.args[0], key, offset, byte_size, call.context)
        return 200, b"", JSON, []

    async def _cuda_shm_register(self, call: _Call) -> Response:
        """`{"raw_handle": {"b64": ...}, "device_id": ..., "byte_size": ...}`, as tritonclient sends it."""
        options = await self._register_options(call)
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
        await self._service.register_cuda_shared_memory(call.args[0], raw, device_id, byte_size, call.context)
        return 200, b"", JSON, []

    async def _register_options(self, call: _Call) -> dict[str, Any]:
        options = parse_json(await self._read_body(call.source, call.headers))
        return options if isinstance(options, dict) else {}

    async def _get_log_settings(self, call: _Call) -> Response:
        return _json(await self._service.log_settings(context=call.context))

    async def _set_log_settings(self, call: _Call) -> Response:
        changes = _log_changes(parse_json(await self._read_body(call.source, call.headers)))
        return _json(await self._service.log_settings(changes, call.context))

    async def _get_trace_setting(self, call: _Call) -> Response:
        return await self._trace_setting(call, None)

    async def _set_trace_setting(self, call: _Call) -> Response:
        body = await self._read_body(call.source, call.headers)
        return await self._trace_setting(call, _trace_changes(parse_json(body)))

    async def _trace_setting(self, call: _Call, changes: dict[str, list[str]] | None) -> Response:
        """The server's settings (no path parameter) or a model's (its name)."""
        values = await self._service.trace_setting(call.args[0] if call.args else "", changes, call.context)
        ordered = {k: values[k] for k in _TRACE_KEYS if k in values}
        return _json({k: v if k == "trace_level" else "".join(v[:1]) for k, v in ordered.items()})

    # OpenAI's embeddings API (openai_api.py): its own error shape, whatever fails
    async def _openai_models(self, call: _Call) -> Response:
        try:
            return 200, models_body(self._service.embeddings.models(call.context)), JSON, []
        except Exception as exc:
            return openai_error(exc, "GET", call.path)

    async def _openai_model(self, call: _Call) -> Response:
        try:
            return _json(model_body(self._service.embeddings.model(call.args[0], call.context)))
        except Exception as exc:
            return openai_error(exc, "GET", call.path)

    async def _openai_embeddings(self, call: _Call) -> Response:
        try:
            request, encoding = embeddings_call(await self._read_body(call.source, call.headers))
            result = await self._service.embeddings.create(request, call.context)
            return 200, embeddings_body(result, encoding), JSON, []
        except ClientDisconnected:
            raise
        except Exception as exc:
            return openai_error(exc, "POST", call.path)

    async def _model_metadata(self, call: _Call) -> Response:
        return _json(self._service.model_metadata(*_model(call), call.context))

    async def _model_ready(self, call: _Call) -> Response:
        if await self._service.model_ready(*_model(call), call.context):
            return 200, b"", TEXT, []
        return 400, error_body("Model version not ready"), TEXT, []

    async def _model_config(self, call: _Call) -> Response:
        return _json(message_to_json_dict(self._service.model_config(*_model(call), call.context)))

    async def _model_stats(self, call: _Call) -> Response:
        return _json(await self._service.statistics(*_model(call), call.context))

    async def _model_infer(self, call: _Call) -> Response:
        return await self._infer(call.path, *_model(call), call.source, call.headers, call.context)

    async def _infer(
        self, path: str, name: str, version: str, source: BodySource, headers: dict[bytes, bytes],
        context: CallContext,
    ) -> Response:
        """The inference route, for a request `begin` did not take (ASGI's, or one pipelined behind another's answer):
        the same steps, awaited."""
        request = InferenceRequest(name, version, [])
        try:
            request, body = await self._received(name, version, source, headers, context)
            response = await self._service.infer(request, context)
        except Exception as exc:
            return _failed(exc, request, path)
        return _answer(response, request, headers, body)

    def begin(
        self, method: str, path: str, headers: dict[bytes, bytes], body: bytes, client: tuple[str, int] | None,
        extensions: dict[str, Any] | None, deliver: Callable[[Answer], None],
    ) -> Answer | Callable[[], None] | None:
        """An inference request, read whole, started without a task: its answer when the service answered it at once
        (a model that runs it on the loop, or any failure), else the call that withdraws it, its answer coming through
        `deliver`. None, having done nothing, for any other request: await `respond`."""
        target = infer_target(path) if method == "POST" else None
        if target is None:
            return None
        context = _context(client, headers, extensions)
        request = InferenceRequest(*target, [])
        try:
            request, body = self._received_now(*target, body, headers, context)
            outcome = self._service.submit(
                request, context, partial(_delivered, deliver, path, request, headers, body, context)
            )
        except Exception as exc:
            return *_failed(exc, request, path), None
        if isinstance(outcome, InferenceResponse):
            return *_answer(outcome, request, headers, body), context.trace
        return outcome

    async def _received(
        self, name: str, version: str, source: BodySource, headers: dict[bytes, bytes], context: CallContext
    ) -> tuple[InferenceRequest, bytes]:
        """`_received_now`, the body received first where ASGI hands it in messages (admitted before it is read)."""
        receive_start = self._admitted(name, version, context)
        if not isinstance(source, bytes):
            try:
                source = await _receive_body(source, headers, self._max_input_size)
            except GeserveError as exc:  # reported once the model is known: an unknown model is 404 whatever the body
                return InferenceRequest(name, version, [], fault=exc), b""
        return self._request(name, version, source, headers, context, receive_start)

    def _received_now(
        self, name: str, version: str, body: bytes, headers: dict[bytes, bytes], context: CallContext
    ) -> tuple[InferenceRequest, bytes]:
        """An inference request from a body read whole (the native server's), admitted before it is decoded."""
        return self._request(name, version, body, headers, context, self._admitted(name, version, context))

    def _admitted(self, name: str, version: str, context: CallContext) -> int:
        """Admit the call before its body is read and decoded: a caller who may not infer, or whom the model's
        admission control sheds, costs no decoding, and the service does not admit it again. When the service may
        trace it, when its receiving started (else 0)."""
        self._service.admit_ahead(ApiGroup.INFERENCE, context, "infer", name, version)
        return time.monotonic_ns() if self._service.tracer is not None else 0

    def _request(
        self, name: str, version: str, body: bytes, headers: dict[bytes, bytes], context: CallContext,
        receive_start: int,
    ) -> tuple[InferenceRequest, bytes]:
        """The request a whole body makes (its content codings undone), or its decoding fault, reported once the model
        is known (an unknown model is 404 whatever the body)."""
        try:
            body = self._whole_body(body, headers)
            if receive_start:
                context.trace_marks = [("HTTP_RECV_START", receive_start), ("HTTP_RECV_END", time.monotonic_ns())]
            return self._decode(name, version, body, headers), body
        except GeserveError as exc:
            return InferenceRequest(name, version, [], fault=exc), body

    def _decode(self, name: str, version: str, body: bytes, headers: dict[bytes, bytes]) -> InferenceRequest:
        length = _header_length(headers)
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


def _model_routes() -> Iterator[tuple[str, str, Handler, bytes]]:
    """A model's routes, each for its default version and with /versions/{version}; `.../{name}/` is its metadata."""
    own = (
        ("POST", "/infer", HttpFrontend._model_infer, TEXT),
        ("GET", "/ready", HttpFrontend._model_ready, TEXT),
        ("GET", "/config", HttpFrontend._model_config, JSON),
        ("GET", "/stats", HttpFrontend._model_stats, JSON),
        ("GET", "", HttpFrontend._model_metadata, JSON),
        ("GET", "/", HttpFrontend._model_metadata, JSON),
    )
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        for method, tail, handler, not_allowed in own:
            yield method, prefix + tail, handler, not_allowed


def _shm_routes() -> Iterator[tuple[str, str, Handler, bytes]]:
    """Both kinds of shared memory: status and unregister of all regions or one, register of one."""
    front = HttpFrontend
    for kind, status, unregister, register in (
        ("system", front._system_shm_status, front._system_shm_unregister, front._system_shm_register),
        ("cuda", front._cuda_shm_status, front._cuda_shm_unregister, front._cuda_shm_register),
    ):
        for prefix in (f"/v2/{kind}sharedmemory", f"/v2/{kind}sharedmemory/region/{{name}}"):
            yield "GET", f"{prefix}/status", status, JSON
            yield "POST", f"{prefix}/unregister", unregister, JSON
        yield "POST", f"/v2/{kind}sharedmemory/region/{{name}}/register", register, JSON


# Triton's HTTP routes: (method, path pattern, handler, content type of the 405 for another method). Where two patterns
# fit a path the first listed wins (/v2/models/stats before the metadata of a model named "stats").
_ROUTES: list[tuple[str, str, Handler, bytes]] = [
    ("GET", "/v2", HttpFrontend._server_metadata, JSON),
    ("GET", "/v2/models", HttpFrontend._model_list, JSON),
    ("GET", "/v2/models/stats", HttpFrontend._server_stats, JSON),
    *_model_routes(),
    ("GET", "/v2/models/{name}/trace/setting", HttpFrontend._get_trace_setting, JSON),
    ("POST", "/v2/models/{name}/trace/setting", HttpFrontend._set_trace_setting, JSON),
    ("GET", "/v2/health/live", HttpFrontend._live, TEXT),
    ("GET", "/v2/health/ready", HttpFrontend._ready, TEXT),
    ("POST", "/v2/repository/index", HttpFrontend._repository_index, JSON),
    ("POST", "/v2/repository/models/{name}/load", HttpFrontend._load, JSON),
    ("POST", "/v2/repository/models/{name}/unload", HttpFrontend._unload, JSON),
    *_shm_routes(),
    ("GET", "/v2/logging", HttpFrontend._get_log_settings, JSON),
    ("POST", "/v2/logging", HttpFrontend._set_log_settings, JSON),
    ("GET", "/v2/trace/setting", HttpFrontend._get_trace_setting, JSON),
    ("POST", "/v2/trace/setting", HttpFrontend._set_trace_setting, JSON),
    ("GET", "/v1/models", HttpFrontend._openai_models, JSON),
    ("GET", "/v1/models/{name}", HttpFrontend._openai_model, JSON),
    ("POST", "/v1/embeddings", HttpFrontend._openai_embeddings, JSON),
]
_ROUTER = _Router(_ROUTES)


def _model(call: _Call) -> tuple[str, str]:
    """A model route's name and version ("" for the default)."""
    args = call.args
    return args[0], args[1] if len(args) > 1 else ""


def _region(call: _Call) -> str:
    """A shared memory route's region name: "" for all regions."""
    return call.args[0] if call.args else ""


def _health(ok: bool) -> Response:
    return (200, b"", TEXT, []) if ok else (400, b"", TEXT, [])


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


def infer_target(path: str) -> tuple[str, str] | None:
    """(model, version) of /v2/models/{name}[/versions/{digits}]/infer; None for any other path."""
    parts = path.split("/")
    if len(parts) == 5 and parts[:3] == ["", "v2", "models"] and parts[3] and parts[4] == "infer":
        return parts[3], ""
    if len(parts) == 7 and parts[:3] == ["", "v2", "models"] and parts[3] and parts[4] == "versions" \
            and parts[5].isdigit() and parts[6] == "infer":
        return parts[3], parts[5]
    return None


def _answer(
    response: InferenceResponse, request: InferenceRequest, headers: dict[bytes, bytes], body: bytes
) -> Response:
    """A served inference's answer; a request the service prepared in full has its header remembered with what the
    prepare step made of it (codec.remember_prepared), so the next with the same header skips both."""
    answer = infer_response(response, request, headers)
    if request.checked_by is not None:
        length = headers.get(b"inference-header-content-length")
        if length is not None and length.isdigit():
            remember_prepared(body[: int(length)], request)
    return answer


def _failed(exc: Exception, request: InferenceRequest, path: str) -> Response:
    """A failed inference's answer; a body left unread past the size limit cannot be skipped: close."""
    if isinstance(exc, UnknownModelError):
        extra = [(b"connection", b"close")] if isinstance(request.fault, BodyTooLarge) else []
        return 404, error_body(exc.message), TEXT, extra
    return error_response(exc, "POST", path)


def _delivered(
    deliver: Callable[[Answer], None], path: str, request: InferenceRequest, headers: dict[bytes, bytes],
    body: bytes, context: CallContext, outcome: InferenceResponse | Exception,
) -> None:
    """The answer to a request `begin` started, once the service answers it."""
    if isinstance(outcome, InferenceResponse):
        try:
            deliver((*_answer(outcome, request, headers, body), context.trace))
            return
        except Exception as exc:  # an output the encoder refuses
            outcome = exc
    deliver((*_failed(outcome, request, path), context.trace))


def _context(
    client: tuple[str, int] | None, headers: dict[bytes, bytes], extensions: dict[str, Any] | None
) -> CallContext:
    context = CallContext(Transport.HTTP, f"{client[0]}:{client[1]}" if client else "", _HeaderView(headers))
    deadline = headers.get(HTTP_DEADLINE_HEADER)
    if deadline is not None:  # a gateway's deadline for the answer (service/deadlines.py)
        context.deadline = http_deadline(deadline, time.monotonic())
    if extensions is not None and "tls" in extensions:  # HTTPS; under mutual TLS, the verified client certificate
        context.peer_certificate_subject = extensions["tls"].get("client_cert_name")
    return context


def _header_length(headers: dict[bytes, bytes]) -> int | None:
    """`Inference-Header-Content-Length`: the JSON header's size when binary tensor data follows it (the codec
    checks it against the body)."""
    raw = headers.get(b"inference-header-content-length")
    if raw is None:
        return None
    try:
        length = int(raw)
    except ValueError:
        raise RequestParseError(
            f"Inference-Header-Content-Length must be an integer, got {raw.decode(errors='replace')}"
        ) from None
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
