"""More models than memory: `--model-memory-budget` and `--load-on-demand` decided in one place.

`ModelLoads` decides; a `ModelHolder` does (Triton's ModelRepositoryManager decides, ModelLifeCycle loads). The holder
is this process's model manager (repository/holder.py), or with `--workers N` every worker at once, driven by the
supervisor: the budget is the server's, so the supervisor decides for all of them.

The rules, each here once:

- Every load that goes through here is measured (repository/memory.py): each model version is charged what the load
  added to the memory of the processes that hold it, and a model's last charge is the estimate of its next load (its
  files' size before it was ever loaded).
- Before a load, room is made for its estimate: the least recently used models that are not busy (nothing executing
  or queued, no ensemble running on them) and not pinned (their config's `pinned` parameter, or a load request's) are
  unloaded until it fits. Chosen models are held first, all of them (no new request starts on them), then unloaded:
  a model is never unloaded under a request. If the idle ones cannot free enough, nothing is unloaded and the load
  is refused (UNAVAILABLE: HTTP 503, gRPC UNAVAILABLE).
- After a load, a model that measured more than its estimate takes room from other idle models; if it still does not
  fit it is unloaded again and refused, its measured size now known.
- Loads through here run one at a time: a load's measurement is its own, and a decision sees the one before it done.
- A request for a model that is not loaded (`demand`) loads it, once for all the requests that wait for it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from geserve.errors import InvalidArgumentError, UnavailableError

if TYPE_CHECKING:
    from geserve.repository.poller import ModelFollower
    from geserve.settings import ServerSettings

logger = logging.getLogger(__name__)

PIN_PARAMETER = "pinned"  # a config's parameter, and a load request's
# ge_model_load_duration_seconds's bounds: an MLP loads in tens of milliseconds, a large graph in tens of seconds.
LOAD_BOUNDS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ON_DEMAND, REQUESTED = "on_demand", "requested"  # why a model loaded: a request for it, or a load request / start
# How often room is chosen again when a chosen model got a request before it could be held.
_HOLD_ATTEMPTS = 3
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 10**3,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")

Charges = dict[str, dict[int, int]]  # model -> version -> bytes


def parse_size(text: str) -> int:
    """`800MiB`, `4GiB`, `1.5G`, `500MB`, `1048576`: bytes. K, M, G, T and KiB, MiB, ... are powers of 1024, KB,
    MB, ... powers of 1000."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 800MiB or 4GiB, got '{text}'")
    return int(float(match.group(1)) * _UNITS[unit])


def pin_parameter(parameters: Mapping[str, Any]) -> bool | None:
    """A load request's `pinned` parameter: True or False, None when not given."""
    value = parameters.get(PIN_PARAMETER)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidArgumentError(f"load parameter '{PIN_PARAMETER}' must be a boolean (true or false), got {value!r}")


class BudgetExceededError(UnavailableError):
    """A load that does not fit, and the models that could make room for it are in use (or pinned)."""


@dataclass(frozen=True, slots=True)
class Held:
    """A model its holder serves, as the budget sees it."""

    last_used: float = 0.0  # time.time() of its last inference, 0 for none
    busy: bool = False  # a request of it, or of an ensemble that runs on it, is executing or queued
    pinned: bool = False  # its config's `pinned` parameter says true


@dataclass(frozen=True, slots=True)
class Plan:
    """What loading a model would take: the bytes it would add, and the models it runs on (it among them), which
    making room for it must not unload."""

    need: int
    uses: frozenset[str]


class ModelHolder(Protocol):
    """What holds the models (one process's manager, or every worker): ModelLoads' hands."""

    async def held(self) -> dict[str, Held]:
        """The models that serve now, by name."""
        ...

    async def plan(self, name: str, known: Mapping[str, int]) -> Plan:
        """What a load of `name` would take, `known` giving the measured size of models loaded before."""
        ...

    async def hold(self, names: list[str]) -> bool:
        """Stop new requests reaching `names`, all of them or, when any is busy now, none (False)."""
        ...

    async def release(self, names: list[str]) -> None:
        """Serve held models again."""
        ...

    async def evict(self, names: list[str]) -> None:
        """Unload held models (and the ensembles that run on them) and give their memory back."""
        ...

    async def ensure(self, name: str) -> Charges:
        """Load `name` where it does not serve; the charges of what came up."""
        ...

    async def measure(self, load: Awaitable[object]) -> Charges:
        """Run `load` (a load request's, a start's, a poll's); the charges of what came up."""
        ...


@dataclass(slots=True)
class LoadHistogram:
    """ge_model_load_duration_seconds, by why the model loaded: counts per bound of LOAD_BOUNDS_S (and +Inf)."""

    buckets: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)

    def observe(self, trigger: str, seconds: float) -> None:
        counts = self.buckets.setdefault(trigger, [0] * (len(LOAD_BOUNDS_S) + 1))
        counts[bisect.bisect_left(LOAD_BOUNDS_S, seconds)] += 1
        self.sums[trigger] = self.sums.get(trigger, 0.0) + seconds


@dataclass(frozen=True, slots=True)
class BudgetSnapshot:
    """What the metrics report: the budget, each model version's charge, the evictions and on-demand loads by
    model, and the load durations."""

    limit: int | None
    charges: Charges
    evictions: dict[str, int]
    on_demand: dict[str, int]
    loads: LoadHistogram


class ModelLoads:
    """Loads and unloads under the memory budget (`limit` bytes, None for none), and loads on demand."""

    def __init__(self, holder: ModelHolder, limit: int | None, clock: Callable[[], float] = time.time) -> None:
        self._holder = holder
        self.limit = limit
        self._clock = clock
        self._lock = asyncio.Lock()
        self._flights: dict[str, asyncio.Future[None]] = {}
        self._charges: Charges = {}  # the models that serve, by version
        self._sizes: dict[str, int] = {}  # each model's last measured size, kept after it goes: its next estimate
        self._pinned: set[str] = set()  # by a load request
        self._loaded_at: dict[str, float] = {}
        self._evictions: Counter[str] = Counter()
        self._on_demand: Counter[str] = Counter()
        self._loads = LoadHistogram()

    # ---- what the server asks ------------------------------------------------------------------------

    async def demand(self, name: str) -> None:
        """A request needs `name`, which is not loaded where it arrived: load it (one load for every request that
        waits for it meanwhile). A waiter that gives up (its deadline) leaves the load to go on."""
        flight = self._flights.get(name)
        if flight is None:
            flight = self._flights[name] = asyncio.ensure_future(self._demand(name))
            flight.add_done_callback(lambda _: self._flights.pop(name, None))
        await asyncio.shield(flight)

    async def load(self, name: str, job: Callable[[], Awaitable[object]], pin: bool | None = None) -> None:
        """A load request (or a start's, or a poll's): make room, then run `job` (the load itself). `pin`: the
        request's `pinned` parameter, if given."""
        async with self._lock:
            if pin is not None:
                (self._pinned.add if pin else self._pinned.discard)(name)
            await self._load(name, lambda: self._holder.measure(job()), REQUESTED)

    async def unload(self, name: str, job: Callable[[], Awaitable[object]]) -> None:
        """An unload request (or a poll's): run `job`; the model is no longer pinned. Not one at a time with the loads:
        the unload waits for the model's requests to end, and one of them may be waiting for a load on demand (a
        Python model's BLS call)."""
        self._pinned.discard(name)
        try:
            await job()
        finally:
            self._forget_gone(await self._holder.held())

    async def serves(self, name: str) -> bool:
        return name in await self._holder.held()

    def charges(self) -> Charges:
        return {name: dict(versions) for name, versions in self._charges.items()}

    def snapshot(self) -> BudgetSnapshot:
        return BudgetSnapshot(self.limit, self.charges(), dict(self._evictions), dict(self._on_demand), self._loads)

    # ---- deciding ------------------------------------------------------------------------------------

    async def _demand(self, name: str) -> None:
        async with self._lock:
            if name in await self._holder.held():  # loaded meanwhile, or missing only where it was asked for
                await self._holder.ensure(name)
                return
            self._on_demand[name] += 1
            await self._load(name, lambda: self._holder.ensure(name), ON_DEMAND)

    async def _load(self, name: str, job: Callable[[], Awaitable[Charges]], trigger: str) -> None:
        plan = Plan(0, frozenset({name})) if self.limit is None else await self._holder.plan(name, self._sizes)
        await self._make_room(name, plan.need, plan.uses)
        started = time.monotonic()
        try:
            self._book(await job())
        finally:
            self._loads.observe(trigger, time.monotonic() - started)
            self._forget_gone(await self._holder.held())
        self._loaded_at[name] = self._clock()
        if self.limit is not None and self.used() > self.limit:
            await self._fit_after_load(name, plan)

    async def _fit_after_load(self, name: str, plan: Plan) -> None:
        """`name` measured more than it was thought to need: other idle models make room, or it goes again."""
        need = sum(sum(self._charges.get(m, {}).values()) for m in plan.uses)
        try:
            await self._make_room(name, need, plan.uses, counted=True)
        except BudgetExceededError:
            logger.warning("model '%s' measured %d bytes, more than the budget has room for: unloading it", name, need)
            if await self._holder.hold([name]):
                await self._holder.evict([name])
            self._forget_gone(await self._holder.held())
            raise

    def used(self) -> int:
        return sum(sum(versions.values()) for versions in self._charges.values())

    async def _make_room(self, name: str, need: int, keep: Collection[str], counted: bool = False) -> None:
        """Unload idle models, least recently used first, until `need` more bytes fit (`counted`: `need` is charged
        already, and it is the total that must fit)."""
        limit = self.limit
        if limit is None:
            return
        if need > limit:
            raise BudgetExceededError(f"model '{name}' needs {need} bytes, more than the whole budget of {limit}")
        for _ in range(_HOLD_ATTEMPTS):
            held = await self._holder.held()
            self._forget_gone(held)
            free = limit - self.used() + (need if counted else 0)
            if need <= free:
                return
            victims = self._choose(held, need - free, keep)
            if victims is None:
                candidates = self._candidates(held, keep)
                locked = self.used() - sum(self._size_of(m) for m in candidates)
                raise BudgetExceededError(
                    f"model '{name}' needs {need} bytes; {locked} of the budget ({limit} bytes) is held by models in "
                    "use"
                )
            if await self._holder.hold(victims):
                await self._evict(victims)
                continue  # measured again: an ensemble unloaded with its steps, a charge that changed
        raise BudgetExceededError(
            f"model '{name}' needs {need} bytes; the models that could make room for it keep receiving requests"
        )

    def _candidates(self, held: Mapping[str, Held], keep: Collection[str]) -> list[str]:
        """The models that may be unloaded, least recently used (or loaded) first."""
        idle = [n for n, h in held.items() if not h.busy and not h.pinned and n not in self._pinned and n not in keep]
        return sorted(idle, key=lambda n: max(held[n].last_used, self._loaded_at.get(n, 0.0)))

    def _choose(self, held: Mapping[str, Held], missing: int, keep: Collection[str]) -> list[str] | None:
        """The least recently used idle models that free `missing` bytes together; None if all of them cannot."""
        victims, freed = [], 0
        for candidate in self._candidates(held, keep):
            if freed >= missing:
                break
            victims.append(candidate)
            freed += self._size_of(candidate)
        return victims if freed >= missing else None

    async def _evict(self, victims: list[str]) -> None:
        for victim in victims:
            logger.info(
                "evicting model '%s' (%d bytes) to make room under the memory budget", victim, self._size_of(victim)
            )
            self._evictions[victim] += 1
        await self._holder.evict(victims)

    # ---- the book ---------------------------------------------------------------------------------------

    def _size_of(self, name: str) -> int:
        return sum(self._charges.get(name, {}).values())

    def _book(self, came_up: Charges) -> None:
        for name, versions in came_up.items():
            if versions:
                self._charges[name] = dict(versions)
                self._sizes[name] = sum(versions.values())

    def _forget_gone(self, held: Mapping[str, Held]) -> None:
        """Models that no longer serve (unloaded, evicted with a composing model, failed) cost nothing."""
        for name in [n for n in self._charges if n not in held]:
            del self._charges[name]
            self._loaded_at.pop(name, None)


class BudgetedFollower:
    """Poll mode under ModelLoads: what a scan found changed loads (and unloads) through the budget; with load on
    demand only a model that serves loads again, the others when a request comes for them."""

    def __init__(self, loads: ModelLoads, target: ModelFollower, on_demand: bool) -> None:
        self._loads = loads
        self._target = target
        self._on_demand = on_demand

    async def load(self, name: str) -> None:
        if self._on_demand and not await self._loads.serves(name):
            return
        await self._loads.load(name, partial(self._target.load, name))

    async def unload(self, name: str) -> None:
        await self._loads.unload(name, partial(self._target.unload, name))


def start_models(settings: ServerSettings, available: Collection[str]) -> list[str]:
    """The models the server loads at start: every one in none and poll modes, --load-model's in explicit mode (every
    one for '*'); none in poll mode with load on demand (each loads when first requested). ValueError for a
    --load-model name in no repository."""
    mode = settings.model_control_mode
    if mode == "poll" and settings.load_on_demand:
        return []
    if mode in ("none", "poll") or "*" in settings.load_models:
        return list(available)
    names = list(dict.fromkeys(settings.load_models))
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"--load-model names models not in any repository: {', '.join(unknown)}")
    return names
