"""The memory budget of a server of several workers: its models across all the workers, as the supervisor's decider
(repository/budget.py's `ModelLoads`) sees them. Every worker holds every model, so every step runs on all of them:
a model serves where any worker serves it, is busy where a request of it is under way in any worker, and is held
(then unloaded) only if it is idle in every one of them; otherwise the workers that held it serve it again.

A load's charge is what it added to the PSS of all the workers together (the supervisor reads /proc for each), so
weights the workers map from one file count once; each version gets its share of that in proportion to what each
worker measured of its own build, and every worker is told the server-wide charges for its index and statistics.

The calls a worker answers for these (`BUDGET_CALLS`) are handled by its link with the worker's own holder
(repository/holder.py); `demand_load` and `budget_evict` change what the server serves and are replayed to a worker
that joins later, as loads and unloads are.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from geserve.ipc.peer import PeerGone
from geserve.repository import memory
from geserve.repository.budget import Charges, Held, ModelLoads, Plan, parse_size
from geserve.repository.holder import LocalHolder
from geserve.settings import ServerSettings

logger = logging.getLogger(__name__)

Measured = dict[str, dict[int, tuple[int, int]]]  # a worker's own: model -> version -> (resident, mapped not yet)
DEMAND_LOAD, EVICT = "demand_load", "budget_evict"


# What the supervisor asks each worker, and the worker's holder method that answers.
_ANSWERS: dict[str, Callable[..., Awaitable[Any]]] = {
    "budget_usage": LocalHolder.held,
    "budget_plan": LocalHolder.plan,
    "budget_hold": LocalHolder.hold,
    "budget_release": LocalHolder.release,
    EVICT: LocalHolder.evict,
    DEMAND_LOAD: LocalHolder.load_missing,
    "budget_settle": LocalHolder.settle,
    "budget_measured": LocalHolder.measured,
    "budget_charges": LocalHolder.set_charges,
}
BUDGET_CALLS = frozenset(_ANSWERS)


class Workers(Protocol):
    """What the budget needs of the supervisor."""

    def pids(self) -> list[int]:
        """The processes of the workers that serve now."""
        ...

    async def everywhere(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """A control call on every joined worker (numbered, and replayed to later ones where it changes what they
        serve): each worker's result, exceptions included."""
        ...

    async def ask_each(self, method: str, args: tuple[Any, ...]) -> list[Any]:
        """A question to every joined worker (not numbered, not replayed): their answers."""
        ...


class WorkersHolder:
    """`ModelHolder` over every worker of the server."""

    def __init__(self, workers: Workers) -> None:
        self._workers = workers

    async def held(self) -> dict[str, Held]:
        merged: dict[str, Held] = {}
        for answer in await self._workers.ask_each("budget_usage", ()):
            for name, held in answer.items():
                seen = merged.get(name)
                merged[name] = (
                    held
                    if seen is None
                    else Held(max(seen.last_used, held.last_used), seen.busy or held.busy, seen.pinned or held.pinned)
                )
        return merged

    async def plan(self, name: str, known: Mapping[str, int]) -> Plan:
        plans = await self._workers.ask_each("budget_plan", (name, dict(known)))
        return max(plans, key=lambda plan: plan.need) if plans else Plan(0, frozenset({name}))

    async def hold(self, names: list[str]) -> bool:
        held = await self._workers.everywhere("budget_hold", (names,))
        if all(result is True for result in held if not isinstance(result, PeerGone)):
            return True
        await self.release(names)  # a worker found one busy: the others serve it again
        return False

    async def release(self, names: list[str]) -> None:
        _first_error(await self._workers.everywhere("budget_release", (names,)))

    async def evict(self, names: list[str]) -> None:
        _first_error(await self._workers.everywhere(EVICT, (names,)))

    async def ensure(self, name: str) -> Charges:
        return await self.measure(self._load_everywhere(name))

    async def _load_everywhere(self, name: str) -> None:
        _first_error(await self._workers.everywhere(DEMAND_LOAD, (name,)))

    async def measure(self, load: Awaitable[object]) -> Charges:
        await self._workers.ask_each("budget_settle", ())
        before = memory.total_pss(self._workers.pids())
        try:
            await load
        finally:
            own: list[Measured] = await self._workers.ask_each("budget_measured", ())
            grown = memory.total_pss(self._workers.pids()) - before
            charges = charged(own, grown)
            logger.debug("a load added %d bytes to the workers' PSS; each measured its own: %s", grown, own)
            if charges:
                await self._workers.ask_each("budget_charges", (charges,))
        return charges


def charged(own: list[Measured], total: int) -> Charges:
    """The server-wide charges of the versions a load built: `total` bytes (what all the workers grew by, shared
    pages once) shared out in proportion to what each worker measured resident of its own builds, plus what the
    version mapped that is not resident yet in any worker (the same files in every worker: their pages resident in
    one are resident, and counted, already)."""
    resident: Charges = {}
    lazy: Charges = {}
    for measured in own:
        for name, versions in measured.items():
            for version, (made, mapped) in versions.items():
                resident.setdefault(name, {})[version] = resident.get(name, {}).get(version, 0) + made
                known = lazy.setdefault(name, {}).get(version)
                lazy[name][version] = mapped if known is None else min(known, mapped)
    count = sum(len(versions) for versions in resident.values())
    grand = sum(sum(versions.values()) for versions in resident.values())
    total = max(total, 0)
    return {
        name: {
            v: (total * made // grand if grand > 0 else total // count) + lazy[name][v] for v, made in versions.items()
        }
        for name, versions in resident.items()
    }


def _first_error(results: list[Any]) -> None:
    """Raise the first worker's failure (a worker that exited meanwhile is restarted with the call replayed)."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, PeerGone):
            raise result


async def answer(holder: LocalHolder, method: str, args: tuple[Any, ...]) -> Any:
    """A worker's answer to one of BUDGET_CALLS, from its own holder."""
    return await _ANSWERS[method](holder, *args)


def server_loads(settings: ServerSettings, workers: Workers) -> ModelLoads | None:
    """The supervisor's decider of loads with a memory budget or load on demand; None with neither, or with a budget
    the workers will refuse to start with (each says why, as one process would)."""
    if not settings.model_memory_budget and not settings.load_on_demand:
        return None
    try:
        limit = parse_size(settings.model_memory_budget) if settings.model_memory_budget else None
    except ValueError:
        return None
    return ModelLoads(WorkersHolder(workers), limit)
