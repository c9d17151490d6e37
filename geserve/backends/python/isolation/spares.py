"""Processes that ran an isolated model's auto_complete_config, kept a while for the model's first instance: loading
the model then starts one process, not two (measured: 2.6 s -> ~1.3 s here, the start of a fresh interpreter that
imports numpy and the backend). The instance imports its model file afresh in it, as an in-process instance
imports it afresh in the server after the server's own auto-complete import."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from geserve.backends.python.isolation.process import ModelProcess
from geserve.backends.python.isolation.session import Session
from geserve.errors import UnavailableError

logger = logging.getLogger(__name__)

KEEP_FOR_S = 60.0  # a spare no instance took by then is ended (its load failed after auto-complete, say)


@dataclass
class Started:
    """A process that answers, and the server's side of its calls."""

    process: ModelProcess
    session: Session

    async def stop(self) -> None:
        await self.process.stop()
        self.session.end(UnavailableError(f"the process of Python model '{self.process.name}' ended"))


class Spares:
    """Kept processes by model file; used on the loop only."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[Started, asyncio.TimerHandle]] = {}
        self._ending: set[asyncio.Task[None]] = set()

    def keep(self, path: str, started: Started) -> None:
        loop = asyncio.get_running_loop()
        self._end(path)
        self._kept[path] = (started, loop.call_later(KEEP_FOR_S, self._end, path))

    def take(self, path: str, name: str) -> Started | None:
        """The spare for `path`, renamed for the instance `name`; None when there is none alive."""
        kept = self._kept.pop(path, None)
        if kept is None:
            return None
        started, timer = kept
        timer.cancel()
        if started.process.ended.is_set():
            return None
        started.process.name = started.session.instance_name = name
        return started

    def _end(self, path: str) -> None:
        kept = self._kept.pop(path, None)
        if kept is not None:
            kept[1].cancel()
            task = asyncio.ensure_future(kept[0].stop())
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
