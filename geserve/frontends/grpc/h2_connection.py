"""One HTTP/2 connection of the native gRPC server: h2's state machine fed by an asyncio.Protocol, its events handed
to a handler each, which start and feed the calls. Its collaborators: the `Responder` (h2_responder.py), which answers
the calls (unary ones without a task where their Begin can) under the peer's flow control, and the `Keepalive`
(h2_keepalive.py), which pings a quiet client and polices the client's pings."""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

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
from geserve.frontends.grpc.h2_context import CallError, H2Call, parse_timeout
from geserve.frontends.grpc.h2_keepalive import Keepalive
from geserve.frontends.grpc.h2_responder import (
    RESPONSE_HEADERS,
    STATUS_SERVER_STOPPING,
    Begin,
    Header,
    Responder,
    status_headers,
)
from geserve.frontends.grpc.h2_responder import grpc_message as grpc_message  # re-exported, as before the split
from geserve.frontends.grpc.server import GrpcOptions

logger = logging.getLogger(__name__)
# hpack logs every header it decodes at DEBUG, tokens and keys included: never, whatever --log-verbose says.
logging.getLogger("hpack").setLevel(logging.WARNING)

if TYPE_CHECKING:  # generic in the stubs only
    Method: TypeAlias = grpc.RpcMethodHandler[Any, Any]
else:
    Method = grpc.RpcMethodHandler
# What the client may send ahead of our acknowledgements: large, as grpc's BDP probing grows its windows, so that a
# request of a few MB does not wait for round trips of WINDOW_UPDATEs.
STREAM_WINDOW = 4 * 1024 * 1024
CONNECTION_WINDOW = 16 * 1024 * 1024

_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,  # headers stay bytes: nothing is decoded that is not read
    # Our own headers are constant and well formed; incoming ones are read defensively (a missing :path is an
    # unknown method), so h2's per-header validation and normalisation are skipped both ways.
    validate_outbound_headers=False, normalize_outbound_headers=False,
    validate_inbound_headers=False, normalize_inbound_headers=False,
)
_UNSUPPORTED_MEDIA: list[Header] = [(b":status", b"415"), (b"content-type", b"text/plain")]

# The response's own header blocks, HPACK-encoded once: ":status: 200" from the static table, and literals "without
# indexing", which leave both sides' dynamic tables alone, so the same bytes are right at any point of a connection.
_RESPONSE_BLOCK = b"\x88" + b"\x0f\x10" + b"\x10application/grpc"  # content-type: name 31 of the static table
_OK_BLOCK = b"\x00\x0bgrpc-status\x010"
_FRAME_HEAD = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_DATA, _HEADERS = 0x0, 0x1
_END_STREAM, _END_HEADERS = 0x1, 0x4
_RESPONSE_LENGTH_TYPE, _OK_LENGTH_TYPE = len(_RESPONSE_BLOCK) << 8 | _HEADERS, len(_OK_BLOCK) << 8 | _HEADERS


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

    def fast_frames(self, sid: int, headers: bool, message: bytes, trailers: bool) -> bytes | None:
        """A response's frames built here rather than by h2's send_headers / send_data (about 3x cheaper): the
        response headers if `headers`, one DATA frame of `message`, and the OK trailers if `trailers`, with the
        stream's state and both flow-control windows kept as h2 keeps them. None when h2 must do it (the message
        needs more than one frame or than the windows allow, or the stream or the connection is not open for
        sending)."""
        stream = self.streams.get(sid)
        if stream is None or self.state_machine.state is ConnectionState.CLOSED:
            return None
        size = len(message)
        if size > self.max_outbound_frame_size or size > stream.outbound_flow_control_window or (
                size > self.outbound_flow_control_window):
            return None
        machine = stream.state_machine
        try:
            parts = []
            if headers:
                machine.process_input(StreamInputs.SEND_HEADERS)
                parts.append(_FRAME_HEAD.pack(_RESPONSE_LENGTH_TYPE, _END_HEADERS, sid) + _RESPONSE_BLOCK)
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


class State(Enum):
    """Where a connection is in its life (the table in GrpcH2Connection's docstring)."""

    OPEN = "serving: a new stream starts a call"
    DRAINING = "the graceful stop's GOAWAY sent: calls under way go on, new streams are refused"
    ENDING = "a GOAWAY with an error sent: nothing more is read, the socket closes within a second"
    CLOSED = "closing or closed: nothing more is read"


class _Event(Protocol):
    """h2's events of a stream as the connection reads them: h2 sets these fields on every event it received (its
    classes type them optional, for events built empty)."""

    stream_id: int


class _Data(_Event, Protocol):
    data: bytes
    flow_controlled_length: int


class _Request(_Event, Protocol):
    headers: list[Header]  # bytes: header_encoding=None


# Module names for the states, as the read path tests them (`state is OPEN`): a global's load, no attribute lookup.
OPEN, DRAINING, ENDING, CLOSED = State


class GrpcH2Connection(asyncio.Protocol):
    """Bytes in, h2's events out of them, a handler per event (`_ON_EVENT`), calls started and fed by the handlers;
    its `Responder` answers the calls, its `Keepalive` pings the client and polices its pings.

    | state    | a new stream                   | moved on by                                                         |
    |----------|--------------------------------|---------------------------------------------------------------------|
    | OPEN     | a call (or 415, UNIMPLEMENTED) | `go_away` (the server's graceful stop): DRAINING, and CLOSED at once |
    |          |                                | when no call is under way                                           |
    | DRAINING | refused: RST_STREAM            | its last call ending (answered, reset, aborted): CLOSED (`close`)   |
    |          | REFUSED_STREAM                 |                                                                     |
    | ENDING   | -- (nothing is read)           | the socket closing, a second after the GOAWAY at most: CLOSED       |
    | CLOSED   | -- (nothing is read)           | --                                                                  |

    OPEN and DRAINING move to ENDING on bytes h2 refuses (its GOAWAY PROTOCOL_ERROR) or too many client pings (GOAWAY
    ENHANCE_YOUR_CALM too_many_pings), by `_end`, which cancels the calls; to CLOSED on the client's GOAWAY (the calls
    cancelled), `close` (the server stopping, an unexpected error) or the socket lost (`connection_lost`)."""

    def __init__(self, options: GrpcOptions, resolve: Callable[[bytes | None], Method | None],
                 connections: set[GrpcH2Connection],
                 begin: Callable[[bytes | None], Begin | None] = lambda path: None) -> None:
        self.loop = asyncio.get_running_loop()
        self.resolve = resolve
        self.begin = begin
        self.connections = connections
        self.max_receive = options.max_message_size
        self.options = options
        self.h2 = _H2Connection(_CONFIG)
        self.calls: dict[int, H2Call] = {}
        self.peer = ""
        self.transport: asyncio.Transport | None = None
        self.state = OPEN
        self.paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.keepalive = Keepalive(self, options, self.loop)
        self.responder = Responder(self, options.max_message_size)
        self.on_close: Callable[[], None] | None = None  # a connection handed over by the supervisor reports its close
        self.out: list[bytes] = []  # bytes to write at the end of this loop iteration
        self._closer: asyncio.TimerHandle | None = None  # ENDING: the socket's close, a second after the GOAWAY

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
        self.keepalive.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = CLOSED
        self.connections.discard(self)
        ARRIVALS.open_ended -= 1
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        self.keepalive.stop()
        if self._closer is not None:
            self._closer.cancel()
            self._closer = None
        self._cancel_calls()
        self._wake_drain()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain()

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is ENDING or state is CLOSED:
            return
        transport = self.transport
        assert transport is not None
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 queued a GOAWAY with the error
            logger.debug("grpc: closing a connection from %s: %s", self.peer, exc)
            self._end()
            return
        handlers = _ON_EVENT
        try:
            for event in events:
                handler = handlers.get(type(event))
                if handler is not None:
                    handler(self, event)
                if transport.is_closing():
                    return
        except Exception:
            logger.exception("grpc: closing a connection from %s after an unexpected error", self.peer)
            self._cancel_calls()
            transport.abort()
            return
        self.flush()

    # ---- h2's events ----------------------------------------------------------------------------------

    def _on_request(self, event: _Request) -> None:
        sid, headers = event.stream_id, event.headers
        found = dict(headers)  # the last of a repeated header, as grpc reads them (as cheap as a loop over them)
        path = found.get(b":path")
        content_type = found.get(b"content-type")
        state = self.state
        if state is not OPEN:  # ENDING (a stream later in the read that ended it): h2 sends nothing more
            if state is DRAINING:
                self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        if content_type is None or not content_type.startswith(b"application/grpc"):
            self.h2.send_headers(sid, _UNSUPPORTED_MEDIA, end_stream=True)
            return
        method = self.resolve(path)
        if method is None:
            self.h2.send_headers(sid, RESPONSE_HEADERS + status_headers(
                grpc.StatusCode.UNIMPLEMENTED, "Method not found!"), end_stream=True)
            return
        deadline = None
        timeout = found.get(b"grpc-timeout")
        if timeout is not None and (seconds := parse_timeout(timeout)) is not None:
            deadline = time.monotonic() + seconds
        encoding = found.get(b"grpc-encoding")
        call = H2Call(self, sid, method, headers, deadline, None if encoding == b"identity" else encoding)
        self.calls[sid] = call
        call.now = self.begin(path)
        if method.request_streaming:
            call.inbox = collections.deque()
            call.task = self.loop.create_task(self.responder.serve(call, call.requests()))

    def _on_data(self, event: _Data) -> None:
        sid, size = event.stream_id, event.flow_controlled_length
        call = self.calls.get(sid)
        if call is None or call.done:
            if size:
                self.h2.acknowledge_received_data(size, sid)
            return
        try:
            messages = call.take_messages(event.data)
        except CallError as exc:
            self.h2.acknowledge_received_data(size, sid)
            self._fail(call, exc.code, exc.details)
            return
        if call.inbox is not None:
            self._on_streamed(call, messages, size)
            return
        if size:  # a unary request: kept until the stream ends
            self.h2.acknowledge_received_data(size, sid)
        if messages and call.request is None:
            call.request = messages[0]

    def _on_streamed(self, call: H2Call, messages: list[bytes], size: int) -> None:
        """Streamed requests' bytes: acknowledged unless the handler is behind, the messages delivered."""
        if call.backlogged:  # the handler is not reading: the client's window closes until it does
            call.unacked += size
        elif size:
            self.h2.acknowledge_received_data(size, call.stream_id)
        if messages:
            call.deliver(messages, False)

    def _on_end(self, event: _Event) -> None:
        call = self.calls.get(event.stream_id)
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
        responder = self.responder
        if call.now is None or not responder.begin(call, call.now, request):
            call.task = self.loop.create_task(responder.serve(call, request))

    def _on_reset(self, event: _Event) -> None:
        call = self.calls.pop(event.stream_id, None)
        if call is not None:
            call.reset = call.done = True
            call.stop()
        if self.state is DRAINING and not self.calls:
            self.close()

    def _on_window(self, event: _Event) -> None:
        sid = event.stream_id
        if not sid:
            self._wake_writers()
            return
        call = self.calls.get(sid)
        waiter = call.window_waiter if call is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        self._wake_writers()  # a new initial window size changes every stream's window

    def _on_ping(self, event: h2.events.PingReceived) -> None:
        if self.keepalive.on_ping():
            logger.info("grpc: closing the connection from %s: too many pings", self.peer)
            self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"too_many_pings")
            self._end()

    def _on_ping_ack(self, event: h2.events.PingAckReceived) -> None:
        self.keepalive.on_ping_ack()

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        """The client's GOAWAY: h2 sends nothing after it."""
        self._cancel_calls()
        self.close()

    # ---- calls ----------------------------------------------------------------------------------------

    def acknowledge(self, call: H2Call) -> None:
        """A streaming handler caught up: hand the bytes it held back to the client."""
        size, call.unacked = call.unacked, 0
        if size and not call.done:
            try:
                self.h2.acknowledge_received_data(size, call.stream_id)
            except h2.exceptions.ProtocolError:
                return
            self.flush()

    def forget(self, call: H2Call) -> None:
        """The call is over: the connection no longer tracks it (and closes once its last call ends, if draining)."""
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
        if self.state is DRAINING and not self.calls:
            self.close()

    def _fail(self, call: H2Call, code: grpc.StatusCode, details: str) -> None:
        """A transport fault of the call (oversized or undecodable message): its status now, its handler cancelled."""
        self.responder.finish(call, code, details)
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

    # ---- writing --------------------------------------------------------------------------------------

    def _wake_writers(self) -> None:
        for call in list(self.calls.values()):
            waiter = call.window_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def drained(self) -> None:
        if self.drain_waiter is None:
            self.drain_waiter = self.loop.create_future()
        await asyncio.shield(self.drain_waiter)

    def _wake_drain(self) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.send(data)

    def send(self, data: bytes) -> None:
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
        self.state = CLOSED
        self._write_out()
        if self.transport is not None:
            self.transport.close()

    # ---- stopping -------------------------------------------------------------------------------------

    def _end(self) -> None:
        """Closes the connection after the GOAWAY h2 queued (ENDING): the write side first, so that the client reads
        the GOAWAY (closing a socket with unread input resets it, and the reset can overtake the GOAWAY), the socket
        within a second."""
        transport = self.transport
        assert transport is not None
        self.flush()
        self._write_out()
        self._cancel_calls()
        self.state = ENDING
        self.keepalive.stop()
        if self._closer is not None:
            self._closer.cancel()
        if transport.can_write_eof():
            transport.write_eof()
        self._closer = self.loop.call_later(1.0, transport.close)

    def go_away(self) -> None:
        """The graceful stop's GOAWAY (DRAINING): calls under way go on, new ones are refused. Written past h2, whose
        own GOAWAY would close its state machine to the responses still to come."""
        if self.state is not OPEN or self.transport is None:
            return
        self.state = DRAINING
        frame = GoAwayFrame(0)
        frame.last_stream_id = self.h2.highest_inbound_stream_id
        frame.error_code = ErrorCodes.NO_ERROR
        self.flush()
        self.send(frame.serialize())
        if not self.calls:
            self.close()

    def abort_calls(self) -> None:
        """The grace is over: the calls still running are cancelled (UNAVAILABLE to their clients)."""
        for call in list(self.calls.values()):
            if call.task is not None:
                call.task.cancel()
            else:
                call.stop()
                self.responder.finish(call, *STATUS_SERVER_STOPPING)
                self.calls.pop(call.stream_id, None)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        return [call.task for call in self.calls.values() if call.task is not None]


# h2's events a connection acts on, each to its handler (the others, settings acknowledged and the like, only
# advance h2's state machine).
_ON_EVENT: dict[type[h2.events.Event], Callable[[GrpcH2Connection, Any], None]] = {
    h2.events.DataReceived: GrpcH2Connection._on_data,
    h2.events.RequestReceived: GrpcH2Connection._on_request,
    h2.events.StreamEnded: GrpcH2Connection._on_end,
    h2.events.WindowUpdated: GrpcH2Connection._on_window,
    h2.events.StreamReset: GrpcH2Connection._on_reset,
    h2.events.PingReceived: GrpcH2Connection._on_ping,
    h2.events.PingAckReceived: GrpcH2Connection._on_ping_ack,
    h2.events.RemoteSettingsChanged: GrpcH2Connection._on_settings,
    h2.events.ConnectionTerminated: GrpcH2Connection._on_goaway,
}
