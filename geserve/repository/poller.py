"""Poll mode (`--model-control-mode=poll`): every `--repository-poll-secs` the repositories are scanned and the model
manager follows what changed, as Triton does. A new model loads, a removed one unloads, and a model whose folder
changed (config, model files, version folders added or removed, labels, warmup data) loads again: the manager brings
the new versions up before it stops the old ones, and a reload that fails leaves the serving versions serving.

The scan walks the file system on a worker thread, so the event loop never waits on the disk. One cycle runs at a
time: a slow load delays the next scan instead of overlapping it.

What follows a scan is a `ModelFollower`: in one process the model manager itself; with `--workers N` the
supervisor scans, alone, and its follower broadcasts each load and unload to every worker (geserve/workers/
supervisor.py says why the supervisor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Protocol

from geserve.errors import GeserveError
from geserve.repository.store import ModelFingerprint, ModelStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PollChanges:
    """What one scan found against the one before it, by model name."""

    added: tuple[str, ...] = ()
    modified: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    # The loads of added or modified models that failed, with the reason (the manager also shows it in the index).
    failed: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.added or self.modified or self.removed)


def compare(before: dict[str, ModelFingerprint], after: dict[str, ModelFingerprint]) -> PollChanges:
    return PollChanges(
        added=tuple(sorted(after.keys() - before.keys())),
        modified=tuple(sorted(n for n in after.keys() & before.keys() if after[n] != before[n])),
        removed=tuple(sorted(before.keys() - after.keys())),
    )


class ModelFollower(Protocol):
    """What loads and unloads the models a scan found changed (the model manager has these)."""

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None: ...


class RepositoryPoller:
    """Scans the repositories every `interval_s` seconds and has the manager load and unload what changed.

    `snapshot` records what is on disk before the initial models load, so a change made while they load is seen
    by the first scan; `start` begins the scans (none when `interval_s` is not positive, as Triton polls only with
    a non-zero --repository-poll-secs); `stop` ends them, abandoning a scan under way."""

    def __init__(self, store: ModelStore, manager: ModelFollower, interval_s: float) -> None:
        self._store = store
        self._manager = manager
        self.interval_s = interval_s
        self._seen: dict[str, ModelFingerprint] = {}
        self._task: asyncio.Task[None] | None = None

    async def snapshot(self) -> None:
        """Remember what is on disk now, without loading anything."""
        # A repository that cannot be read is refused by the initial load too, naming it: said once is enough.
        with contextlib.suppress(GeserveError):
            self._seen = await asyncio.to_thread(self._store.snapshot)

    def start(self) -> None:
        if self._task is None and self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="geserve-repository-poller")
            logger.info("polling the model repositories every %g s", self.interval_s)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def poll(self) -> PollChanges:
        """One scan, and the unloads and loads it calls for; what changed."""
        try:
            current = await asyncio.to_thread(self._store.snapshot)
            logger.debug("scanned the model repositories")
        except GeserveError as exc:
            # As in Triton, a repository that cannot be read (two models of one name) changes nothing.
            logger.error("failed to poll the model repositories: %s", exc.message)
            return PollChanges()
        changes = compare(self._seen, current)
        # Recorded before the loads: a load that fails is tried again when its folder changes, not every scan (the
        # reason is in the index meanwhile); a file half written when scanned changes again once it is complete.
        self._seen = current
        if not changes:
            return changes
        logger.info(
            "model repository changes: added %s, modified %s, removed %s",
            list(changes.added), list(changes.modified), list(changes.removed),
        )
        for name in changes.removed:
            await self._manager.unload(name)
        names = [*changes.added, *changes.modified]
        results = await asyncio.gather(*(self._manager.load(n) for n in names), return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, GeserveError):
                changes.failed[name] = result.message
            elif isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                logger.error("loading model '%s' after a repository change failed", name, exc_info=result)
                changes.failed[name] = str(result)
        return changes

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # a bug in one cycle must not end polling for the life of the server
                logger.exception("polling the model repositories failed")
