"""Whether another request can still arrive in this process: lets a dynamic batcher send a batch before its queue
delay when no client could add to it, instead of waiting out a delay that can only add latency.

An HTTP/1.1 connection carries one request at a time: while every client connection waits on an answer and nothing
executes, no request can arrive but on a new connection. The HTTP server reports its connections here; every other
source (gRPC connections, which open streams at will, or a host that reports nothing) holds the process open-ended,
and then a batcher keeps Triton's delay to the letter.
"""

from __future__ import annotations

import time


class Arrivals:
    """Counts kept by the sources of requests and the pools that run them; one per process (`ARRIVALS`)."""

    __slots__ = ("_bounded", "executing", "idle_clients", "in_transit", "newest_client_ns", "open_ended")

    def __init__(self) -> None:
        self.idle_clients = 0
        """Client connections that may send a request now (connected, and not waiting on an answer)."""
        self.in_transit = 0
        """Requests received whose handling has not started yet (they are about to reach their scheduler)."""
        self.open_ended = 1
        """Sources that can send at any time; 1 until a server says its frontends all report (`bounded`)."""
        self.executing = 0
        """Executions under way in any instance pool (a model may send requests of its own: ensembles, BLS)."""
        self.newest_client_ns = 0
        """When the newest client connected (time.monotonic_ns): its peers may still be connecting."""
        self._bounded = False

    def bounded(self) -> None:
        """Every request source of this process reports here (the native HTTP server alone, or with others that
        count themselves in `open_ended`). Once per process, however many servers it starts."""
        if not self._bounded:
            self._bounded = True
            self.open_ended -= 1

    def connected(self) -> None:
        self.idle_clients += 1
        self.newest_client_ns = time.monotonic_ns()

    def closed(self) -> bool:
        """No request can arrive on the connections open now (`quiet` without the settling time): the event loop has
        nothing to read until an answer goes out, so a batch may as well run on it (scheduling/pool.py)."""
        return not (self.idle_clients or self.in_transit or self.open_ended or self.executing)

    def quiet(self, settled_ns: int) -> bool:
        """No request can arrive on the connections open now, and none was opened in the last `settled_ns`.

        The settling time keeps the delay's meaning for clients that connect together to send a batch's worth (a
        new connection's peers may still be on their way); once connections persist, the delay only waits for
        requests that cannot come."""
        return self.closed() and time.monotonic_ns() - self.newest_client_ns >= settled_ns


ARRIVALS = Arrivals()
