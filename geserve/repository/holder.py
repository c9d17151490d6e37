"""This process's models as the memory budget sees them (repository/budget.py's `ModelHolder`): what serves, how
recently used and whether busy or pinned, what a load would add, and holding, evicting and loading on demand through
the model manager. With `--workers N` each worker answers these for the supervisor, which decides for all."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from pathlib import Path

from geserve.repository import memory
from geserve.repository.budget import PIN_PARAMETER, Charges, Held, Plan
from geserve.repository.lifecycle import ModelManager
from geserve.repository.model import LoadedModel


class LocalHolder:
    """The models of one process (its ModelManager)."""

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    async def held(self) -> dict[str, Held]:
        return self.usage()

    def usage(self) -> dict[str, Held]:
        manager = self._manager
        found: dict[str, Held] = {}
        for model in manager.models():
            if model.name in found:
                continue
            record = manager.record(model.name)
            serving = record.serving() if record is not None else [model]
            found[model.name] = Held(
                last_used=max(m.statistics.last_inference_ms for m in serving) / 1000,
                busy=manager.busy(model.name),
                # A model loaded from a load request's files would come back from the repository, or not at all.
                pinned=any(_pinned(m) for m in serving) or manager.loads_from_request(model.name),
            )
        return found

    async def plan(self, name: str, known: Mapping[str, int]) -> Plan:
        manager = self._manager
        uses = await manager.runs_on(name)
        need = 0
        for model in uses:
            if manager.is_up(model):
                continue
            size = known.get(model)
            if size is None:
                folder = manager.folder(model)
                size = await asyncio.to_thread(_files_size, folder) if folder is not None else 0
            need += size
        return Plan(need, frozenset(uses))

    async def hold(self, names: list[str]) -> bool:
        if any(self._manager.busy(name) for name in names):
            return False
        self._manager.hold(names)
        return True

    async def release(self, names: list[str]) -> None:
        self._manager.release(names)

    async def evict(self, names: list[str]) -> None:
        for name in names:
            await self._manager.unload(name)

    async def ensure(self, name: str) -> Charges:
        return await self.measure(self.load_missing(name))

    async def measure(self, load: Awaitable[object]) -> Charges:
        """Run `load` (a load through the manager); the charges of the versions it built."""
        self.take_measured()  # anything built outside a decision is not this one's
        await load
        return {
            name: {v: sum(parts) for v, parts in versions.items()} for name, versions in self.take_measured().items()
        }

    async def load_missing(self, name: str) -> None:
        """Load `name` unless a version of it serves."""
        await self._manager.ensure(name)

    def models(self) -> list[LoadedModel]:
        """The versions that serve."""
        return self._manager.models()

    async def settle(self) -> None:
        """A measurement starts: not with what was built before, nor with garbage or free heap."""
        self.take_measured()
        await memory.settled_pss()

    async def measured(self) -> dict[str, dict[int, tuple[int, int]]]:
        return self.take_measured()

    async def set_charges(self, charges: Charges) -> None:
        """What the versions that serve cost the whole server (a supervisor measured them over every worker): for the
        index and the statistics."""
        for model in self._manager.models():
            model.memory = charges.get(model.name, {}).get(model.version, model.memory)

    def take_measured(self) -> dict[str, dict[int, tuple[int, int]]]:
        """What the versions built since the last call measured: bytes made resident, bytes mapped not yet resident."""
        return self._manager.take_measured()


def _pinned(model: LoadedModel) -> bool:
    parameter = model.config.parameters.get(PIN_PARAMETER)
    return parameter is not None and parameter.string_value.strip().lower() in ("true", "1", "yes", "on")


def _files_size(folder: Path) -> int:
    """The bytes of a model folder's files: the first estimate of what loading it takes (weights dominate)."""
    total = 0
    for path in folder.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:
            continue
    return total
