"""Counts a scheduler's requests in flight, refuses new ones once it stops, and lets `stop()` wait for the rest."""

from __future__ import annotations

import asyncio

from geserve.errors import UnavailableError


class InflightTracker:
    def __init__(self) -> None:
        self.count = 0
        self._stopping = False
        self._drained = asyncio.Event()
        self._drained.set()

    def enter(self, model_name: str) -> None:
        """Admit one request (raise UnavailableError once stopping); pair with `leave` in a `finally`."""
        if self._stopping:
            raise UnavailableError(f"model '{model_name}' is unloading")
        self.count += 1
        self._drained.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._drained.set()

    async def drain(self) -> None:
        """Refuse new requests and wait until those admitted are done."""
        self._stopping = True
        await self._drained.wait()
