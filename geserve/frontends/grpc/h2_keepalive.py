"""The keepalive of one native gRPC connection (h2_connection.GrpcH2Connection): its own pings, sent every
keepalive_time with a call under way and the connection aborted when one goes unanswered for keepalive_timeout, and
grpc core's policing of the client's pings (strikes, past which the connection ends with GOAWAY too_many_pings)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from geserve.frontends.grpc.server import GrpcOptions


class KeptAlive(Protocol):
    """What the keepalive asks of its connection (h2_connection.GrpcH2Connection): a Protocol, so this module does
    not import the connection that imports it."""

    h2: Any
    calls: dict[int, Any]
    peer: str
    transport: asyncio.Transport | None

    def flush(self) -> None: ...

logger = logging.getLogger("geserve.frontends.grpc.h2_connection")  # the connection's log, as before the split

IDLE_PING_INTERVAL_S = 7200.0  # grpc core: with no call under way, a client may ping once every two hours
KEEPALIVE_PING = b"geserve!"


class Keepalive:
    """One timer (the next ping, or its ack's deadline) and the client's ping record.

    `last_ping` is when the client last pinged with no response sent since: the connection's writers set it to None
    whenever data goes out (one store per response); the strikes it counted are forgotten at the next ping then."""

    __slots__ = ("_awaiting_ack", "_connection", "_loop", "_options", "_strikes", "_timer", "last_ping")

    def __init__(self, connection: KeptAlive, options: GrpcOptions, loop: asyncio.AbstractEventLoop) -> None:
        self._connection = connection
        self._options = options
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._awaiting_ack = False
        self._strikes = 0
        self.last_ping: float | None = None

    def start(self) -> None:
        """Schedules the next keepalive ping, if keepalive_time asks for them."""
        period = self._options.keepalive_time_ms
        if 0 < period < 2**31 - 1:
            self._timer = self._loop.call_later(period / 1000, self._ping)

    def stop(self) -> None:
        """No more pings, nor a deadline for the one sent (the connection is ending or gone)."""
        self._awaiting_ack = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ping(self) -> None:
        connection = self._connection
        if not (connection.calls or self._options.keepalive_permit_without_calls) or connection.transport is None:
            self.start()
            return
        connection.h2.ping(KEEPALIVE_PING)
        connection.flush()
        self._awaiting_ack = True
        self._timer = self._loop.call_later(self._options.keepalive_timeout_ms / 1000, self._expired)

    def _expired(self) -> None:
        connection = self._connection
        logger.info("grpc: closing the connection from %s: its keepalive ping went unanswered", connection.peer)
        if connection.transport is not None:
            connection.transport.abort()

    def on_ping_ack(self) -> None:
        if self._awaiting_ack:
            self._awaiting_ack = False
            if self._timer is not None:
                self._timer.cancel()
            self.start()

    def on_ping(self) -> bool:
        """grpc core's policy: a client ping sooner than allowed after the previous one, with no response sent
        between them, is a strike. True: past the strikes allowed, the connection must end (too_many_pings)."""
        now = self._loop.time()
        options = self._options
        allowed = (options.http2_min_recv_ping_interval_without_data_ms / 1000
                   if self._connection.calls or options.keepalive_permit_without_calls else IDLE_PING_INTERVAL_S)
        last, self.last_ping = self.last_ping, now
        if last is None:  # the first ping, or data went out since the last: its strikes are forgiven
            self._strikes = 0
            return False
        if now - last >= allowed:
            return False
        self._strikes += 1
        return bool(options.http2_max_ping_strikes and self._strikes > options.http2_max_ping_strikes)
