"""A blocking call path between two threads of two processes: one caller thread sends a frame and waits on the same
socket for the answer, one serving thread receives, runs it and answers. No event loop on either side.

Why beside the Peer (peer.py): an isolated Python model's execute went caller thread -> server loop -> socket ->
the model process' loop -> its model thread and all the way back, seven wake-ups; p50 of a tiny model over HTTP
rose from ~250 µs in-process to ~850 µs (perf_analyzer, c=1, this 2-core VM). Here it is two: the serving thread
wakes on the frame, the caller on the answer. Calls are one at a time (an instance runs one batch at a time); a
lock keeps two callers from interleaving anyway. Frames use the same Codec as the Peer beside it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from geserve.ipc.peer import Codec, PeerGone, error_state, rebuild_error

_HEADER = struct.Struct("!I")


class NotSent(PeerGone):
    """The other process was gone before the call could be sent: it never saw the call."""


_ANSWER, _FAILED = 0, 1


def _receive(sock: socket.socket) -> bytes | None:
    """One frame, or None once the other side closed its end (it exited)."""
    header = _exactly(sock, _HEADER.size)
    if header is None:
        return None
    return _exactly(sock, _HEADER.unpack(header)[0])


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        count = sock.recv_into(view[got:])
        if count == 0:
            return None
        got += count
    return bytes(buffer)


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


class Lane:
    """The caller's end."""

    def __init__(self, sock: socket.socket, codec: Codec) -> None:
        self._sock = sock
        self._codec = codec
        self._lock = threading.Lock()

    def call(self, *message: Any) -> Any:
        """Send `message`, wait for the answer; the serving side's error is raised, PeerGone if it is gone (NotSent
        if it was gone before `message` could be sent: it never saw it)."""
        frame = self._codec.dumps(message)
        with self._lock:
            try:
                _send(self._sock, frame)
            except OSError:
                raise NotSent("the other process had exited before the call was sent") from None
            try:
                reply = _receive(self._sock)
            except OSError:
                reply = None
        if reply is None:
            raise PeerGone("the other process exited before answering")
        kind, value = self._codec.loads(reply)
        if kind == _FAILED:
            raise rebuild_error(value)
        return value

    def close(self) -> None:
        """End the lane, from any thread: a call under way is woken (PeerGone), and the descriptor is closed only once
        it has left. Closed under a caller's feet, its number could be reused (by a client's connection) before the
        caller's next send or receive, which would then go there: a gRPC client once read an execute call's bytes as
        an HTTP/2 frame."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # a caller blocked in recv wakes up
        with self._lock:
            self._sock.close()


def serve(sock: socket.socket, codec: Codec, handler: Callable[..., Any]) -> None:
    """Answer each call with `handler(*message)` until the caller's end closes (on this, the serving thread)."""
    while (frame := _receive(sock)) is not None:
        try:
            answer = (_ANSWER, handler(*codec.loads(frame)))
        except Exception as exc:
            answer = (_FAILED, error_state(exc))
        try:
            _send(sock, codec.dumps(answer))
        except OSError:
            return
