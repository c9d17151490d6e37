"""The Peer (geserve/ipc/peer.py) under uvloop, the server's loop: calls cross both ways, and the end of the other
process releases this side's socket once, so its descriptor number cannot be closed again after another connection
took it."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvloop

from geserve.ipc.peer import Peer, PeerGone


async def _peer(sock: socket.socket, handler: Any) -> Peer:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    peer = Peer(reader, writer, handler)
    peer.start()
    return peer


def test_calls_cross_and_a_gone_peer_fails_the_waiting() -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair()

        async def double(method: str, args: tuple[Any, ...]) -> Any:
            return (method, args[0] * 2)

        async def never(method: str, args: tuple[Any, ...]) -> Any:
            await asyncio.Event().wait()

        here, there = await _peer(ours, never), await _peer(theirs, double)
        assert await here.call("double", 21) == ("double", 42)
        waiting = asyncio.ensure_future(there.call("hang"))
        await asyncio.sleep(0.01)
        await here.close()
        with pytest.raises(PeerGone):
            await waiting
        await there.close()

    uvloop.run(main())


def test_the_end_of_the_other_side_releases_this_sides_socket() -> None:
    """Once the other side is gone, the transport is closed and the socket it was opened on let go of its descriptor
    (detached): left open until the collector took it, uvloop closed the descriptor, then the socket object closed the
    same number again, by then perhaps another connection's (isolated Python models' crash tests: a client read an
    execute call's bytes)."""

    async def main() -> None:
        ours, theirs = socket.socketpair()

        async def nothing(method: str, args: tuple[Any, ...]) -> Any:
            return None

        peer = await _peer(ours, nothing)
        theirs.close()  # the other process exited
        await asyncio.wait_for(peer.closed.wait(), 5)
        for _ in range(3):
            await asyncio.sleep(0)
        assert ours.fileno() == -1

    uvloop.run(main())
