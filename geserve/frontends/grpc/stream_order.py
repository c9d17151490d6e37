"""The order of a gRPC stream's responses: as Triton's stream_infer_handler.cc does, a non-decoupled model's responses
are written in the order their requests were read, whatever order they complete in; a decoupled model's go out as
its model sends them (its caller does not pass them through here).

Each such request takes a turn when the stream reads it; its responses are released on its turn. In the common case
(responses complete in request order) that is one counter compared and bumped; only a response that completes ahead
of its turn waits, in a small dict keyed by turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class InOrder:
    """Releases each request's responses to `out` in turn order."""

    __slots__ = ("_early", "_next", "_out", "_taken")

    def __init__(self, out: Callable[[Any], None]) -> None:
        self._out = out
        self._taken = 0  # turns handed out
        self._next = 0  # the turn whose responses go out next
        self._early: dict[int, list[Any]] = {}  # responses of turns that completed before `_next` reached them

    def turn(self) -> int:
        """A place for a request read now whose responses come later (`done`)."""
        turn = self._taken
        self._taken = turn + 1
        return turn

    def now(self, item: Any) -> None:
        """The one response of a request answered as it is read, without a turn of its own: out at once unless a
        request read before it is still running (it then waits its turn, as it would have with one)."""
        if self._taken == self._next:
            self._out(item)
        else:
            self.done(self.turn(), [item])

    def done(self, turn: int, items: list[Any]) -> None:
        """Every response of the request that took `turn` (none: it only gives its turn up), out now if its turn has
        come, with the early ones it was holding back; else kept for its turn. Called once per turn: a turn never
        given up holds every later response back."""
        if turn != self._next:
            self._early[turn] = items
            return
        self._release(items)
        early = self._early
        while early:
            waiting = early.pop(self._next, None)
            if waiting is None:
                return
            self._release(waiting)

    def _release(self, items: list[Any]) -> None:
        out = self._out
        for item in items:
            out(item)
        self._next += 1


class Outstanding:
    """A stream's requests started without a task (InferenceService.submit) whose answers are still to come, by turn:
    the stream ends once they are answered (`wait`), and withdraws them if it ends first (cancelled)."""

    __slots__ = ("_idle", "_withdrawals")

    def __init__(self) -> None:
        self._withdrawals: dict[int, Callable[[], None]] = {}
        self._idle: asyncio.Future[None] | None = None

    def add(self, turn: int, withdraw: Callable[[], None]) -> None:
        self._withdrawals[turn] = withdraw

    def settled(self, turn: int) -> None:
        self._withdrawals.pop(turn, None)
        if not self._withdrawals and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def wait(self) -> None:
        if self._withdrawals:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    def withdraw(self) -> None:
        withdrawals, self._withdrawals = self._withdrawals, {}
        for withdraw in withdrawals.values():
            withdraw()
