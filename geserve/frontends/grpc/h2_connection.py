"""One HTTP/2 connection of the native gRPC server: h2's state machine fed by an asyncio.Protocol, a task per call
started as its request arrives, responses written under the peer's flow control, keepalive and ping policing."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from h2.connection import ConnectionState
from h2.errors import ErrorCodes
from h2.settings import SettingCodes
from h2.stream import StreamClosedBy, StreamInputs
from hyperframe.frame import Frame, GoAwayFrame, HeadersFrame, RstStreamFrame

from geserve.arrivals import ARRIVALS
from geserve.frontends.grpc.h2_context import PREFIX, CallError, H2Call, parse_timeout
from geserve.frontends.grpc.server import GrpcOptions

logger = logging.getLogger(__name__)
# hpack logs every header it decodes at DEBUG, tokens and keys included: never, whatever --log-verbose says.
logging.getLogger("hpack").setLevel(logging.WARNING)

if TYPE_CHECKING:  # generic in the stubs only
    Method: TypeAlias = grpc.RpcMethodHandler[Any, Any]
else:
    Method = grpc.RpcMethodHandler
# A unary method's handler that may answer without a task: the response message, an error status (code, details),
# or None to be served by the method's own handler as usual.
Begin = Callable[[Any, Any, Callable[[Any], None]], Any]  # (request, the call as its servicer context, deliver)
Header = tuple[bytes, bytes]

# What the client may send ahead of our acknowledgements: large, as grpc's BDP probing grows its windows, so that a
# request of a few MB does not wait for round trips of WINDOW_UPDATEs.
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024
IDLE_PING_INTERVAL_S = 7200.0  # grpc core: with no call under way, a client may ping once every two hours
_STATUS_SERVER_STOPPING = (grpc.StatusCode.UNAVAILABLE, "server shutting down")

_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,  # headers stay bytes: nothing is decoded that is not read
    # Our own headers are constant and well formed; incoming ones are read defensively (a missing :path is an
    # unknown method), so h2's per-header validation and normalisation are skipped both ways.
    validate_outbound_headers=False, normalize_outbound_headers=False,
    validate_inbound_headers=False, normalize_inbound_headers=False,
)
_RESPONSE_HEADERS: list[Header] = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_OK_TRAILERS: list[Header] = [(b"grpc-status", b"0")]
_UNSUPPORTED_MEDIA: list[Header] = [(b":status", b"415"), (b"content-type", b"text/plain")]
_KEEPALIVE_PING = b"geserve!"

# The response's own header blocks, HPACK-encoded once: ":status: 200" from the static table, and literals "without
# indexing", which leave both sides' dynamic tables alone, so the same bytes are right at any point of a connection.
_RESPONSE_BLOCK = b"\x88" + b"\x0f\x10" + b"\x10application/grpc"  # content-type: name 31 of the static table
_OK_BLOCK = b"\x00\x0bgrpc-status\x010"
_FRAME_HEAD = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_DATA, _HEADERS = 0x0, 0x1
_END_STREAM, _END_HEADERS = 0x1, 0x4
_RESPONSE_LENGTH_TYPE, _OK_LENGTH_TYPE = len(_RESPONSE_BLOCK) << 8 | _HEADERS, len(_OK_BLOCK) << 8 | _HEADERS


def grpc_message(details: str) -> bytes:
    """The grpc-message header's value: UTF-8, percent-encoding what is outside printable ASCII and '%' (gRPC spec)."""
    raw = details.encode("utf-8")
    if all(0x20 <= byte <= 0x7E and byte != 0x25 for byte in raw):
        return raw
    return b"".join(bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte for byte in raw)


def status_headers(code: grpc.StatusCode, details: str) -> list[Header]:
    headers = [(b"grpc-status", str(code.value[0]).encode())]
    if details:
        headers.append((b"grpc-message", grpc_message(details)))
    return headers


def _behaviour(first: Any, second: Any) -> Callable[[Any, H2Call], Any]:
    """The handler's coroutine (or async generator) function of its shape; grpc's stubs type them synchronous."""
    return cast("Callable[[Any, H2Call], Any]", first if first is not None else second)  # a string: no alias per call


def format_peer(address: Any) -> str:
    """grpc's peer string: ipv4:127.0.0.1:5555 or ipv6:[::1]:5555."""
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"
    return f"unix:{address}" if address else ""


_STREAM_WALK_EVERY = 48  # streams h2 may hold, closed ones included, before they are counted (and the closed forgotten)

# Bytes that are each a whole indexed header field (0x80 | index, index 1..126): a block of only these only looks up
# the tables. A client repeating a call sends exactly that, once its headers are in the dynamic table.
_ONE_BYTE_INDEXED = bytes(range(0x81, 0xFF))


class HeaderDecoder(hpack.Decoder):
    """hpack's decoder, with a fast path for a block of one-byte indexed fields (a third of a unary call's CPU
    went to hpack decoding nine such bytes one by one); anything else is decoded by hpack."""

    def decode(self, data: bytes, raw: bool = False) -> Any:
        if raw and data and not data.translate(None, _ONE_BYTE_INDEXED):
            table = self.header_table
            try:
                fields = [table.get_by_index(byte & 0x7F) for byte in data]
            except hpack.InvalidTableIndex:
                return super().decode(data, raw)
            if sum(32 + len(name) + len(value) for name, value in fields) > self.max_header_list_size:
                return super().decode(data, raw)  # which raises as it should
            self._assert_valid_table_size()  # a shrunk table's size update must come first: hpack's rule
            return [hpack.HeaderTuple(name, value) for name, value in fields]
        return super().decode(data, raw)


class _H2Connection(h2.connection.H2Connection):
    """h2's connection, except that a stream opened past MAX_CONCURRENT_STREAMS is refused on its own (RST_STREAM
    REFUSED_STREAM, which clients retry) instead of h2 ending the whole connection with a PROTOCOL_ERROR."""

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config)
        decoder = HeaderDecoder()
        decoder.max_header_list_size = self.decoder.max_header_list_size
        decoder.max_allowed_table_size = self.decoder.max_allowed_table_size
        self.decoder = decoder

    @property
    def open_inbound_streams(self) -> int:
        # h2 counts the open streams for every new one, walking them all (and forgetting the closed ones as it
        # goes): a few % of a unary call. Below the limit the number of streams it holds, open or not, is a bound
        # that decides alike; the walk runs once per few dozen calls, and near the limit every time.
        held = len(self.streams)
        if held < _STREAM_WALK_EVERY and held < self.local_settings.max_concurrent_streams:
            return held
        return h2.connection.H2Connection.open_inbound_streams.fget(self)  # type: ignore[attr-defined]

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Frame], list[h2.events.Event]]:
        sid = frame.stream_id
        limit = self.local_settings.max_concurrent_streams
        # len(streams) bounds the open ones from above: the count (a walk of every stream) only near the limit
        if (len(self.streams) >= limit and sid not in self.streams and sid > self.highest_inbound_stream_id
                and sid % 2 and self.open_inbound_streams >= limit):
            h2.connection._decode_headers(self.decoder, frame.data)  # keeps HPACK's table in step with the client's
            self.highest_inbound_stream_id = sid
            self._closed_streams[sid] = StreamClosedBy.SEND_RST_STREAM  # its DATA: acknowledged, answered RST
            refuse = RstStreamFrame(sid)
            refuse.error_code = ErrorCodes.REFUSED_STREAM
            return [refuse], []
        return super()._receive_headers_frame(frame)


    def _receive_frame(self, frame: Frame) -> list[h2.events.Event]:
        # h2's, less its trace log's argument: repr(frame), built for every frame received even when nothing logs
        # (a few % of a unary call). Its exception handling, which answers frames on closed streams, is kept.
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except h2.exceptions.StreamClosedError as exc:
            if not self._stream_is_closed_by_reset(exc.stream_id):
                raise
            reset = RstStreamFrame(exc.stream_id)  # a frame on a stream we reset: a stream error, answered so
            reset.error_code = exc.error_code
            self._prepare_for_sending([reset])
            return exc._events
        except h2.exceptions.StreamIDTooLowError as exc:
            if self._stream_is_closed_by_reset(exc.stream_id):
                reset = RstStreamFrame(exc.stream_id)
                reset.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([reset])
                return []
            if self._stream_is_closed_by_end(exc.stream_id):
                raise h2.exceptions.StreamClosedError(exc.stream_id) from exc
            raise
        self._prepare_for_sending(frames)
        return events

    def _prepare_for_sending(self, frames: list[Frame]) -> None:
        if frames:  # h2's, less an assertion over every frame
            self._data_to_send += b"".join(f.serialize() for f in frames)

    def fast_frames(self, sid: int, headers: bool, message: bytes | None, trailers: bool) -> bytes | None:
        """A response's frames built here rather than by h2's send_headers / send_data (about 3x cheaper): the
        response headers, one DATA frame of `message` and the OK trailers, each optional, with the stream's state and
        both flow-control windows kept as h2 keeps them. None when h2 must do it (the message needs more than one
        frame or than the windows allow, or the stream or the connection is not open for sending)."""
        stream = self.streams.get(sid)
        if stream is None or self.state_machine.state is ConnectionState.CLOSED:
            return None
        size = 0 if message is None else len(message)
        if size and (size > self.max_outbound_frame_size or size > stream.outbound_flow_control_window
                     or size > self.outbound_flow_control_window):
            return None
        machine = stream.state_machine
        try:
            parts = []
            if headers:
                machine.process_input(StreamInputs.SEND_HEADERS)
                parts.append(_FRAME_HEAD.pack(_RESPONSE_LENGTH_TYPE, _END_HEADERS, sid) + _RESPONSE_BLOCK)
            if message is not None:
                machine.process_input(StreamInputs.SEND_DATA)
                parts.append(_FRAME_HEAD.pack(size << 8 | _DATA, 0, sid))
                parts.append(message)
                stream.outbound_flow_control_window -= size
                self.outbound_flow_control_window -= size
            if trailers:
                machine.process_input(StreamInputs.SEND_HEADERS)
                machine.process_input(StreamInputs.SEND_END_STREAM)
                parts.append(_FRAME_HEAD.pack(_OK_LENGTH_TYPE, _END_HEADERS | _END_STREAM, sid) + _OK_BLOCK)
        except h2.exceptions.ProtocolError:  # the stream cannot send now (reset, closed): nothing went out
            return None
        return b"".join(parts)


class GrpcH2Connection(asyncio.Protocol):
    """Reads frames into events, events into calls; each call's task writes its response as it completes."""

    def __init__(self, options: GrpcOptions, resolve: Callable[[bytes | None], Method | None],
                 connections: set[GrpcH2Connection],
                 begin: Callable[[bytes | None], Begin | None] = lambda path: None) -> None:
        self.loop = asyncio.get_running_loop()
        self.resolve = resolve
        self.begin = begin
        self.connections = connections
        self.max_receive = options.max_message_size
        self.max_send = options.max_message_size
        self.options = options
        self.h2 = _H2Connection(_CONFIG)
        self.calls: dict[int, H2Call] = {}
        self.peer = ""
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.closing = False  # GOAWAY sent: no new calls, close once the last one ends
        self.timer: asyncio.TimerHandle | None = None  # the keepalive's one timer: next ping, or its ack's deadline
        self.awaiting_ack = False
        self.last_ping: float | None = None  # when the client last pinged with no response sent since
        self.strikes = 0
        self.on_close: Callable[[], None] | None = None  # a connection handed over by the supervisor reports its close
        self.out: list[bytes] = []  # bytes to write at the end of this loop iteration
        self.ending = False  # a GOAWAY ended it: what still arrives is dropped until it closes

    # ---- asyncio.Protocol -----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.peer = format_peer(transport.get_extra_info("peername"))
        conn = self.h2
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            SettingCodes.MAX_CONCURRENT_STREAMS: self.options.max_concurrent_streams,
            SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        })
        conn.initiate_connection()
        conn.increment_flow_control_window(CONNECTION_WINDOW - 65_535)
        self.transport.write(conn.data_to_send())
        self.connections.add(self)
        ARRIVALS.open_ended += 1  # a client may open a stream at any time: no batch goes early while it is here
        self._schedule_keepalive()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.discard(self)
        ARRIVALS.open_ended -= 1
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._cancel_calls()
        self._wake_drain()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        if self.ending:
            return
        conn = self.h2
        transport = self.transport
        assert transport is not None
        try:
            events = conn.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 queued a GOAWAY with the error
            logger.debug("grpc: closing a connection from %s: %s", self.peer, exc)
            self._end()
            return
        try:
            for event in events:
                kind = type(event)
                if kind is h2.events.DataReceived:
                    self._on_data(cast(h2.events.DataReceived, event))
                elif kind is h2.events.RequestReceived:
                    self._on_request(cast(h2.events.RequestReceived, event))
                elif kind is h2.events.StreamEnded:
                    self._on_end(cast(h2.events.StreamEnded, event).stream_id or 0)
                elif kind is h2.events.WindowUpdated:
                    self._wake_writers(cast(h2.events.WindowUpdated, event).stream_id or 0)
                elif kind is h2.events.StreamReset:
                    self._on_reset(cast(h2.events.StreamReset, event).stream_id or 0)
                elif kind is h2.events.PingReceived:
                    self._on_ping()
                elif kind is h2.events.PingAckReceived:
                    self._on_ping_ack()
                elif kind is h2.events.RemoteSettingsChanged:
                    self._wake_writers(0)  # a new initial window size changes every stream's window
                elif kind is h2.events.ConnectionTerminated:  # the client's GOAWAY: h2 sends nothing after it
                    self._cancel_calls()
                    self.close()
                    return
                if transport.is_closing():
                    return
        except Exception:
            logger.exception("grpc: closing a connection from %s after an unexpected error", self.peer)
            self._cancel_calls()
            transport.abort()
            return
        self._flush()

    # ---- requests -------------------------------------------------------------------------------------

    def _on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id or 0
        headers: list[Header] = event.headers or []  # bytes: header_encoding=None
        path = content_type = timeout = encoding = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
            elif name == b"grpc-encoding":
                encoding = value
        if self.closing:
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        if content_type is None or not content_type.startswith(b"application/grpc"):
            self.h2.send_headers(sid, _UNSUPPORTED_MEDIA, end_stream=True)
            return
        method = self.resolve(path)
        if method is None:
            self.h2.send_headers(sid, _RESPONSE_HEADERS + status_headers(
                grpc.StatusCode.UNIMPLEMENTED, "Method not found!"), end_stream=True)
            return
        deadline = None
        if timeout is not None and (seconds := parse_timeout(timeout)) is not None:
            deadline = time.monotonic() + seconds
        call = H2Call(self, sid, method, headers, deadline, None if encoding == b"identity" else encoding)
        self.calls[sid] = call
        call.now = self.begin(path)
        if method.request_streaming:
            call.inbox = collections.deque()
            call.task = self.loop.create_task(self._serve(call, call.requests()))

    def _on_data(self, event: h2.events.DataReceived) -> None:
        sid = event.stream_id or 0
        size = event.flow_controlled_length or 0
        call = self.calls.get(sid)
        if call is None or call.done:
            if size:
                self.h2.acknowledge_received_data(size, sid)
            return
        try:
            messages = call.take_messages(event.data or b"")
        except CallError as exc:
            self.h2.acknowledge_received_data(size, sid)
            self._fail(call, exc.code, exc.details)
            return
        if call.inbox is None:  # a unary request: kept until the stream ends
            if size:
                self.h2.acknowledge_received_data(size, sid)
            if messages and call.request is None:
                call.request = messages[0]
            return
        if call.backlogged:  # the handler is not reading: the client's window closes until it does
            call.unacked += size
        elif size:
            self.h2.acknowledge_received_data(size, sid)
        if messages:
            call.deliver(messages, False)

    def acknowledge(self, call: H2Call) -> None:
        """A streaming handler caught up: hand the bytes it held back to the client."""
        size, call.unacked = call.unacked, 0
        if size and not call.done:
            try:
                self.h2.acknowledge_received_data(size, call.stream_id)
            except h2.exceptions.ProtocolError:
                return
            self._flush()

    def _on_end(self, sid: int) -> None:
        call = self.calls.get(sid)
        if call is None or call.done:
            return
        call.request_ended = True
        if call.inbox is not None:
            call.deliver([], True)
            return
        message = call.request
        if message is None or call.buffer:
            self._fail(call, grpc.StatusCode.INTERNAL, "Incomplete request message" if call.buffer else
                       "Missing request message")
            return
        parse = call.method.request_deserializer
        request = parse(message) if parse is not None else message
        if call.now is None or not self._begin(call, call.now, request):
            call.task = self.loop.create_task(self._serve(call, request))

    def _begin(self, call: H2Call, begin: Begin, request: Any) -> bool:
        """A unary call its handler starts without a task (Begin): answered here, now or when it delivers (the
        handler returned the call that withdraws it); False: left to `_serve`."""
        answer = begin(request, call, functools.partial(self._answered, call))
        if answer is None:
            return False
        if isinstance(answer, tuple) or not callable(answer):
            self._answered(call, answer)
        else:
            call.withdraw = answer
        return True

    def _answered(self, call: H2Call, answer: Any) -> None:
        """A unary call's response message, or its status (code, details), sent now."""
        if call.done:  # reset by the client, or the server stopped it
            return
        call.withdraw = None
        if isinstance(answer, tuple):
            self._finish(call, *answer)
        else:
            payload = call.method.response_serializer(answer) if call.method.response_serializer else answer
            if not self._respond(call, payload):  # the windows are short: sent in parts, by a task
                call.task = self.loop.create_task(self._serve_answer(call, payload))
                return
        self._forget(call)

    def _on_reset(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is not None:
            call.reset = call.done = True
            call.stop()
        if self.closing and not self.calls:
            self.close()

    # ---- calls ----------------------------------------------------------------------------------------

    async def _serve(self, call: H2Call, request: Any) -> None:
        method = call.method
        try:
            if method.response_streaming:
                result = _behaviour(method.unary_stream, method.stream_stream)(request, call)
                if hasattr(result, "__anext__"):  # an async generator's responses are written as it yields them
                    async for message in result:
                        await call.write(message)
                else:
                    await result
                self._finish(call, call.code, call.details)
            else:
                response = await _behaviour(method.unary_unary, method.stream_unary)(request, call)
                payload = method.response_serializer(response) if method.response_serializer else response
                if not self._respond(call, payload):
                    await self.send_message(call, payload)
                    self._finish(call, grpc.StatusCode.OK, "")
        except asyncio.CancelledError:
            if not call.reset:  # not the client's doing: the server is stopping
                self._finish(call, *_STATUS_SERVER_STOPPING)
            raise
        except grpc.aio.AbortError:
            self._finish(call, call.code, call.details)
        except Exception as exc:
            logger.exception("grpc: unhandled error serving %s", getattr(method, "path", "a call"))
            self._finish(call, grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")
        finally:
            self._forget(call)

    async def _serve_answer(self, call: H2Call, payload: bytes) -> None:
        """A unary answer `_answered` could not send at once: sent as the windows open."""
        try:
            await self.send_message(call, payload)
            self._finish(call, grpc.StatusCode.OK, "")
        except asyncio.CancelledError:
            if not call.reset:
                self._finish(call, *_STATUS_SERVER_STOPPING)
            raise
        finally:
            self._forget(call)

    def _forget(self, call: H2Call) -> None:
        """The call is over: the connection no longer tracks it (and closes once its last call ends, if closing)."""
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
        if self.closing and not self.calls:
            self.close()

    def _respond(self, call: H2Call, payload: bytes) -> bool:
        """A unary response in one write (headers, message, trailers) when the peer's window has room for it;
        False when it must be sent in parts."""
        size = len(payload)
        if size > self.max_send:
            self._finish(call, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"Sent message larger than max ({size} vs. {self.max_send})")
            return True
        if call.done:
            return True
        if self.paused:
            return False
        frames = self.h2.fast_frames(call.stream_id, True, PREFIX.pack(0, size) + payload, True)
        if frames is None:
            return False
        pending = self.h2.data_to_send()
        assert self.transport is not None
        self._send(pending + frames if pending else frames)
        call.done = True
        self.last_ping, self.strikes = None, 0  # data sent: the client's next ping is welcome (grpc core)
        return True

    def send_now(self, call: H2Call, payload: bytes) -> bool:
        """One message in one frame, now, when the windows allow it (the common case); False: nothing was sent."""
        if self.paused or call.done or len(payload) > self.max_send:
            return False
        conn = self.h2
        frames = conn.fast_frames(call.stream_id, not call.headers_sent, PREFIX.pack(0, len(payload)) + payload, False)
        if frames is None:
            return False
        call.headers_sent = True
        self.last_ping, self.strikes = None, 0
        pending = conn.data_to_send()
        self._send(pending + frames if pending else frames)
        return True

    async def send_message(self, call: H2Call, payload: bytes) -> None:
        """One message on the call's stream, split to the peer's frame size and windows, waiting for them to open."""
        size = len(payload)
        if size > self.max_send:
            call.code, call.details = (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"Sent message larger than max ({size} vs. {self.max_send})")
            raise grpc.aio.AbortError()
        if call.done or self.send_now(call, payload):
            return
        conn, sid = self.h2, call.stream_id
        data = PREFIX.pack(0, size) + payload
        if not call.headers_sent:
            call.headers_sent = True
            conn.send_headers(sid, _RESPONSE_HEADERS)
        offset, end = 0, len(data)
        while offset < end:
            if self.paused:
                await self._drained()
            if call.closed:  # reset while it waited
                return
            try:
                window = conn.local_flow_control_window(sid)
            except h2.exceptions.ProtocolError:
                return
            if window <= 0:
                self._flush()
                call.window_waiter = self.loop.create_future()
                try:
                    await call.window_waiter
                finally:
                    call.window_waiter = None
                continue
            chunk = min(window, conn.max_outbound_frame_size, end - offset)
            conn.send_data(sid, data[offset:offset + chunk])
            offset += chunk
            self._flush()
        self.last_ping, self.strikes = None, 0

    def _finish(self, call: H2Call, code: grpc.StatusCode, details: str) -> None:
        """Ends the call with its status: trailers, or a trailers-only response when nothing was sent yet."""
        if call.done:
            return
        call.done = True
        conn, sid = self.h2, call.stream_id
        status = status_headers(code, details)
        try:
            conn.send_headers(sid, status if call.headers_sent else _RESPONSE_HEADERS + status, end_stream=True)
            if not call.request_ended:  # the client is still sending: tell it to stop (RFC 9113 8.1)
                conn.reset_stream(sid, ErrorCodes.NO_ERROR)
        except h2.exceptions.ProtocolError:
            pass
        self._flush()

    def _fail(self, call: H2Call, code: grpc.StatusCode, details: str) -> None:
        """A transport fault of the call (oversized or undecodable message): its status now, its handler cancelled."""
        self._finish(call, code, details)
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
        if call.task is not None:
            call.reset = True  # the status went out already
            call.task.cancel()

    def _cancel_calls(self) -> None:
        calls = list(self.calls.values())
        self.calls.clear()
        for call in calls:
            call.reset = call.done = True
            call.stop()

    # ---- flow control ---------------------------------------------------------------------------------

    def _wake_writers(self, sid: int) -> None:
        if sid:
            call = self.calls.get(sid)
            waiters = [call.window_waiter] if call is not None else []
        else:
            waiters = [call.window_waiter for call in self.calls.values()]
        for waiter in waiters:
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def _drained(self) -> None:
        if self.drain_waiter is None:
            self.drain_waiter = self.loop.create_future()
        await asyncio.shield(self.drain_waiter)

    def _wake_drain(self) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self._send(data)

    def _send(self, data: bytes) -> None:
        """Queues bytes for the socket: what the calls of one loop iteration send goes out in one write (a send
        system call per response was the largest single cost of a streamed inference)."""
        if self.out:
            self.out.append(data)
        else:
            self.out = [data]
            self.loop.call_soon(self._write_out)

    def _write_out(self) -> None:
        out = self.out
        if out:
            self.out = []
            transport = self.transport
            if transport is not None and not transport.is_closing():
                transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        """Closes the connection once what is queued is written."""
        self._write_out()
        if self.transport is not None:
            self.transport.close()

    # ---- keepalive and pings --------------------------------------------------------------------------

    def _schedule_keepalive(self) -> None:
        period = self.options.keepalive_time_ms
        if 0 < period < 2**31 - 1:
            self.timer = self.loop.call_later(period / 1000, self._keepalive)

    def _keepalive(self) -> None:
        if not (self.calls or self.options.keepalive_permit_without_calls) or self.transport is None:
            self._schedule_keepalive()
            return
        self.h2.ping(_KEEPALIVE_PING)
        self._flush()
        self.awaiting_ack = True
        self.timer = self.loop.call_later(self.options.keepalive_timeout_ms / 1000, self._keepalive_expired)

    def _keepalive_expired(self) -> None:
        logger.info("grpc: closing the connection from %s: its keepalive ping went unanswered", self.peer)
        if self.transport is not None:
            self.transport.abort()

    def _on_ping_ack(self) -> None:
        if self.awaiting_ack:
            self.awaiting_ack = False
            if self.timer is not None:
                self.timer.cancel()
            self._schedule_keepalive()

    def _on_ping(self) -> None:
        """grpc core's policy: a client ping sooner than allowed after the previous one, with no response sent
        between them, is a strike; past the strikes allowed the connection ends with GOAWAY too_many_pings."""
        now = self.loop.time()
        options = self.options
        allowed = (options.http2_min_recv_ping_interval_without_data_ms / 1000
                   if self.calls or options.keepalive_permit_without_calls else IDLE_PING_INTERVAL_S)
        last, self.last_ping = self.last_ping, now
        if last is None or now - last >= allowed:
            return
        self.strikes += 1
        if options.http2_max_ping_strikes and self.strikes > options.http2_max_ping_strikes:
            logger.info("grpc: closing the connection from %s: too many pings", self.peer)
            self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"too_many_pings")
            self._end()

    # ---- stopping -------------------------------------------------------------------------------------

    def _end(self) -> None:
        """Closes the connection after the GOAWAY h2 queued: the write side first, so that the client reads the
        GOAWAY (closing a socket with unread input resets it, and the reset can overtake the GOAWAY), the socket
        within a second."""
        transport = self.transport
        assert transport is not None
        self._flush()
        self._write_out()
        self._cancel_calls()
        self.ending = True
        if self.timer is not None:
            self.timer.cancel()
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = self.loop.call_later(1.0, transport.close)

    def go_away(self) -> None:
        """The graceful stop's GOAWAY: calls under way go on, new ones are refused. Written past h2, whose own
        GOAWAY would close its state machine to the responses still to come."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        frame = GoAwayFrame(0)
        frame.last_stream_id = self.h2.highest_inbound_stream_id
        frame.error_code = ErrorCodes.NO_ERROR
        self._flush()
        self._send(frame.serialize())
        if not self.calls:
            self.close()

    def abort_calls(self) -> None:
        """The grace is over: the calls still running are cancelled (UNAVAILABLE to their clients)."""
        for call in list(self.calls.values()):
            if call.task is not None:
                call.task.cancel()
            else:
                call.stop()
                self._finish(call, *_STATUS_SERVER_STOPPING)
                self.calls.pop(call.stream_id, None)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return [call.task for call in self.calls.values() if call.task is not None]
