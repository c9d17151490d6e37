"""Ensembles and the models they use: composing models load first, and dependents follow their loads and unloads.

As in Triton: loading an ensemble loads its composing models (waiting for loads already under way), a missing
or failed composing model leaves the ensemble UNAVAILABLE with a reason naming it, unloading a composing model
unloads the ensembles that use it, and loading it again brings them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from geserve.config import ModelConfig
from geserve.config.ensemble import step_model_names, validate_ensemble_steps
from geserve.errors import GeserveError, InvalidArgumentError
from geserve.repository.store import ModelStore

if TYPE_CHECKING:
    from geserve.repository.lifecycle import ModelManager

logger = logging.getLogger(__name__)


class Dependencies:
    def __init__(self, manager: ModelManager, store: ModelStore) -> None:
        self._manager = manager
        self._store = store
        self._loading: dict[str, asyncio.Task] = {}  # model -> its load under way
        self._waits: dict[str, set[str]] = {}  # loading ensemble -> composing models it waits for
        self._composing: dict[str, frozenset[str]] = {}  # ensemble -> its step models, from its last config
        self._blocked: set[str] = set()  # ensembles to load again once a composing model is back

    async def track(self, name: str, load: Coroutine[Any, Any, None]) -> None:
        """Run `load`, visible to ensembles that need `name` meanwhile (they wait instead of loading it twice)."""
        task = asyncio.ensure_future(load)
        self._loading[name] = task
        try:
            await task
        finally:
            if self._loading.get(name) is task:
                del self._loading[name]

    async def resolve(self, ensemble: str, config: ModelConfig) -> dict[str, ModelConfig]:
        """Load the composing models of `ensemble` and check its steps against them; their configs by name."""
        names = step_model_names(config)
        self._composing[ensemble] = frozenset(names)
        missing = [n for n in names if self._store.find(n) is None]
        if missing:
            self._blocked.add(ensemble)
            raise InvalidArgumentError(
                f"ensemble {ensemble} contains models that are not available or ambiguous: {', '.join(missing)}"
            )
        await asyncio.gather(*(self._ensure(ensemble, n) for n in names))
        configs: dict[str, ModelConfig] = {}
        for step in config.ensemble_scheduling.step:
            version = "" if step.model_version < 0 else str(step.model_version)
            try:
                configs[step.model_name] = self._manager.get(step.model_name, version).config
            except GeserveError as exc:
                self._blocked.add(ensemble)
                raise InvalidArgumentError(
                    f"ensemble '{ensemble}' depends on '{step.model_name}' which is not valid. Model "
                    f"'{step.model_name}' failed with error: {self._reason(step.model_name, exc)}"
                ) from None
        validate_ensemble_steps(config, configs)  # a mismatch stays blocked: a fixed composing model may cure it
        if any(c.model_transaction_policy.decoupled for c in configs.values()):
            config.model_transaction_policy.decoupled = True  # as Triton marks it: it answers with a stream
        self._blocked.discard(ensemble)
        return configs

    async def _ensure(self, ensemble: str, name: str) -> None:
        """`name` loaded (or its load failed): waits for a load under way, else starts one if none is ready."""
        cycle = self._path(name, ensemble)
        if cycle is not None:
            raise InvalidArgumentError(f"circular dependency between ensembles: {' -> '.join([ensemble, *cycle])}")
        task = self._loading.get(name)
        record = self._manager.record(name)
        if task is None and record is not None and record.latest is not None:
            return
        waits = self._waits.setdefault(ensemble, set())
        waits.add(name)
        try:
            if task is not None:
                await asyncio.wait([task])  # its failure is reported from its record, and our cancel is not its
            else:
                with contextlib.suppress(GeserveError):
                    await self._manager.load(name)
        finally:
            waits.discard(name)
            if not waits:
                self._waits.pop(ensemble, None)

    def _path(self, start: str, goal: str) -> list[str] | None:
        """The chain of waiting loads from `start` to `goal` (both included), if `start` already waits on `goal`."""
        if start == goal:
            return [start]
        for after in self._waits.get(start, ()):
            rest = self._path(after, goal)
            if rest is not None:
                return [start, *rest]
        return None

    def _reason(self, name: str, error: GeserveError) -> str:
        record = self._manager.record(name)
        if record is None:
            return error.message
        if record.error:
            return record.error
        reasons = [f"version {v}: {s.reason}" for v, s in sorted(record.versions.items()) if s.reason]
        return "; ".join(reasons) or error.message

    async def after_load(self, name: str) -> None:
        """`name` loaded: load again the ensembles that use it (serving ones re-check their steps)."""
        for ensemble, composing in list(self._composing.items()):
            if name not in composing or ensemble in self._loading:
                continue
            record = self._manager.record(ensemble)
            if record is not None and (record.latest is not None or ensemble in self._blocked):
                with contextlib.suppress(GeserveError):
                    await self._manager.load(ensemble)

    async def before_unload(self, name: str) -> None:
        """`name` is about to unload: the ensembles serving with it unload first, and come back with it."""
        self._blocked.discard(name)  # unloaded on purpose: a composing model's return does not bring it back
        for ensemble, composing in list(self._composing.items()):
            record = self._manager.record(ensemble)
            if name in composing and record is not None and record.latest is not None:
                logger.info("unloading ensemble '%s': its composing model '%s' is unloading", ensemble, name)
                await self._manager.unload(ensemble)
                self._blocked.add(ensemble)
