"""The blocking call lane (geserve/ipc/lane.py) on its own, over a real socket pair with a serving thread: calls and
their errors cross; a call the other side never saw (it was gone before the call could be sent) says so, apart from
one it may have seen; closing the lane under a waiting caller wakes it, and the descriptor stays open until the
caller left (so a number reused meanwhile never gets the caller's bytes)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from geserve.errors import InvalidArgumentError
from geserve.ipc import lane as lanes
from geserve.ipc.arena import SharedArrayCodec
from geserve.ipc.lane import Lane, NotSent
from geserve.ipc.peer import PeerGone

CODEC = SharedArrayCodec(None, None)


def served(handler) -> tuple[Lane, socket.socket, threading.Thread]:
    """A lane whose other end a thread serves with `handler` until the lane closes."""
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=lanes.serve, args=(theirs, CODEC, handler), daemon=True)
    thread.start()
    return Lane(ours, CODEC), theirs, thread


def test_calls_and_their_errors_cross() -> None:
    def handler(method: str, value: int) -> int:
        if value < 0:
            raise InvalidArgumentError("negative")
        return value * 2

    lane, _, thread = served(handler)
    assert lane.call("double", 21) == 42
    with pytest.raises(InvalidArgumentError, match="negative"):
        lane.call("double", -1)
    lane.close()
    thread.join(5)
    assert not thread.is_alive()


def test_a_call_to_a_side_already_gone_was_not_sent() -> None:
    ours, theirs = socket.socketpair()
    theirs.close()
    with pytest.raises(NotSent):
        Lane(ours, CODEC).call("execute", [])


def test_a_call_the_other_side_took_and_never_answered_is_gone_not_unsent() -> None:
    """The other side read the call, then went away: it may have run it, so it is PeerGone and not NotSent."""
    ours, theirs = socket.socketpair()

    def take_then_leave() -> None:
        theirs.recv(1 << 16)
        theirs.close()

    threading.Thread(target=take_then_leave, daemon=True).start()
    with pytest.raises(PeerGone) as raised:
        Lane(ours, CODEC).call("execute", [])
    assert not isinstance(raised.value, NotSent)


def test_closing_wakes_a_waiting_caller_and_closes_only_once_it_left() -> None:
    release = threading.Event()

    def handler(method: str) -> None:
        release.wait(10)  # never answers before the lane closes

    lane, _, _ = served(handler)
    outcome: list[BaseException] = []
    caller = threading.Thread(target=lambda: _call(lane, outcome), daemon=True)
    caller.start()
    time.sleep(0.1)  # the caller waits for the answer
    descriptor = lane._sock.fileno()
    lane.close()
    caller.join(5)
    assert [type(error) for error in outcome] == [PeerGone]
    with pytest.raises(OSError):
        os.fstat(descriptor)  # closed, now that the caller has left
    release.set()


def _call(lane: Lane, outcome: list[BaseException]) -> None:
    try:
        lane.call("wait")
    except PeerGone as exc:
        outcome.append(exc)
