"""Either end of the connection between the server and a Python model's own process: a Peer (ipc/peer.py) over a
socket pair, whose large arrays cross through two shared memory segments (ipc/arena.py), one per direction. (The
batches to execute take a lane of their own, ipc/lane.py, with the same codec.)

Blocks the other side let go of come back as one `release` notice per loop turn, whichever threads dropped them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from geserve.ipc.arena import ArenaReader, ArenaWriter, Segment, SharedArrayCodec
from geserve.ipc.peer import Peer

RELEASE = "release"
Handler = Callable[[str, tuple[Any, ...]], Awaitable[Any]]


class Channel:
    """One end: `call` / `notify` on the loop, `call_threadsafe` / `notify_threadsafe` from any other thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, out_fd: int, in_fd: int, name: str) -> None:
        self.loop = loop
        self._name = name
        self._writer = ArenaWriter(Segment(out_fd))
        self.codec = SharedArrayCodec(self._writer, ArenaReader(Segment(in_fd), self._released))
        self._to_release: list[int] = []
        # Re-entrant: a finalizer may run on a thread that holds it (a collection while it swaps the list).
        self._release_lock = threading.RLock()
        self._peer: Peer | None = None

    async def open(self, sock: socket.socket, handler: Handler) -> None:
        async def handle(method: str, args: tuple[Any, ...]) -> Any:
            if method == RELEASE:
                self._writer.free(args[0])
                return None
            return await handler(method, args)

        reader, writer = await asyncio.open_unix_connection(sock=sock)
        self._peer = Peer(reader, writer, handle, self.codec, name=self._name)
        self._peer.start()

    @property
    def peer(self) -> Peer:
        assert self._peer is not None, "the channel is not open"
        return self._peer

    @property
    def closed(self) -> asyncio.Event:
        return self.peer.closed

    @property
    def shared_bytes(self) -> int:
        """Bytes of this side's segment the other side still holds."""
        return self._writer.used_bytes

    async def call(self, method: str, *args: Any) -> Any:
        return await self.peer.call(method, *args)

    def notify(self, method: str, *args: Any) -> None:
        self.peer.notify(method, *args)

    def call_threadsafe(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        return self.peer.call_threadsafe(self.loop, method, *args)

    def notify_threadsafe(self, method: str, *args: Any) -> None:
        self.peer.notify_threadsafe(self.loop, method, *args)

    def notify_written(self, method: str, *args: Any) -> None:
        """A notice that must reach the other side even if this process dies right after (a response, a log)."""
        self.peer.notify_written(self.loop, method, *args)

    def _released(self, offset: int) -> None:
        """A finalizer, on any thread: the first block of a turn schedules the notice that carries them all."""
        with self._release_lock:
            first = not self._to_release
            self._to_release.append(offset)
        if first:
            # RuntimeError: the loop is closed; the process is ending, and its segments with it
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._send_released)

    def _send_released(self) -> None:
        with self._release_lock:
            offsets, self._to_release = self._to_release, []
        if self._peer is not None and offsets:
            self._peer.notify(RELEASE, offsets)

    async def close(self) -> None:
        if self._peer is not None:
            await self._peer.close()
