"""The model manager: lookups for the infer path, the repository index, load and unload. It decides what to load or
unload in what order by asking the dependency graph, then drives each model's versions in that order, one way.

As in Triton: loading an ensemble loads its composing models first (waiting for loads already under way), a missing
or failed composing model leaves the ensemble UNAVAILABLE with a reason naming it, unloading a composing model
unloads the ensembles that use it, and loading it again brings them back.

A load request carrying the model's files (Triton's model file override) loads it from a private folder holding
them (ModelStore.write_override); the model loads from there until it is unloaded or loaded again without files.
Such a folder is deleted once nothing can read it: it is not the model's folder any more, no version serves from
it, and no load is reading it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from geserve.backends.registry import BackendRegistry
from geserve.config import ModelConfig
from geserve.config.ensemble import is_ensemble, step_model_names, validate_ensemble_steps
from geserve.errors import GeserveError, InternalError, InvalidArgumentError, NotFoundError, UnavailableError
from geserve.repository import memory
from geserve.repository.builder import LifecycleOptions, ModelBuilder, PreparedModel
from geserve.repository.dependencies import DependencyGraph, LoadPlan
from geserve.repository.model import LoadedModel, ModelState
from geserve.repository.store import ModelStore
from geserve.repository.versions import ModelRecord, VersionLifecycle

__all__ = ["LifecycleOptions", "ModelManager", "ModelRecord"]

logger = logging.getLogger(__name__)


class ModelManager:
    """What the server asks of the repository. Deciding lives here, doing in `VersionLifecycle` (one model's
    versions under its lock) and `ModelBuilder` (a config into a servable model); neither calls back."""

    def __init__(self, store: ModelStore, registry: BackendRegistry, options: LifecycleOptions) -> None:
        self._store = store
        self._builder = ModelBuilder(registry, options)
        self._versions = VersionLifecycle(self._builder, options.measure_memory)
        self._graph = DependencyGraph()
        self._records: dict[str, ModelRecord] = {}
        # model -> one event per load of it under way: a load that needs the model waits for them instead of
        # starting another.
        self._flights: dict[str, list[asyncio.Event]] = {}
        # model -> the private folders load requests wrote for it that may still be read; and the folders loads
        # under way are reading (a count per folder), which are not deleted under them.
        self._written: dict[str, set[Path]] = {}
        self._reading: Counter[Path] = Counter()

    # ---- the infer path -------------------------------------------------------------------------

    def get(self, name: str, version: str = "") -> LoadedModel:
        record = self._records.get(name)
        if record is None:
            raise NotFoundError(f"Request for unknown model: '{name}' is not found")
        if not version:
            if record.latest is None:
                raise NotFoundError(f"Request for unknown model: '{name}' has no available versions")
            return record.latest
        try:
            number = int(version)
        except ValueError:
            raise InvalidArgumentError(f"failed to parse model version '{version}' for model '{name}'") from None
        status = record.versions.get(number)
        if status is None:
            raise NotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        if status.state is not ModelState.READY or status.model is None:
            raise UnavailableError(
                f"Request for unknown model: '{name}' version {version} is not at ready state"
            )
        return status.model

    # ---- repository operations --------------------------------------------------------------------

    def known_names(self) -> list[str]:
        names = set(self._records)
        with contextlib.suppress(GeserveError):
            names.update(self._store.scan())
        return sorted(names)

    def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """One entry per model version (name, version, state, reason), as Triton's repository index; a version that
        serves under a memory budget also says what it costs (`memory`, bytes: repository/memory.py)."""
        entries: list[dict[str, Any]] = []
        for name in self.known_names():
            record = self._records.get(name)
            if record is not None and record.versions:
                entries.extend(_version_entries(name, record, ready_only))
            elif not ready_only:
                entries.append(self._unversioned_entry(name, record))
        return entries

    def _unversioned_entry(self, name: str, record: ModelRecord | None) -> dict[str, str]:
        """The index entry of a model with no version to list: never loaded, loading, or failed before any version
        was tried."""
        if record is None:
            return {"name": name}
        state = ModelState.LOADING if name in self._flights else ModelState.UNAVAILABLE
        entry = {"name": name, "state": state.value}
        if record.error:
            entry["reason"] = record.error
        return entry

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except GeserveError:
            return False
        return True

    def all_ready(self) -> bool:
        """Strict readiness: every model the server was asked to serve, and not since to unload, has a ready version."""
        return all(r.latest is not None for r in self._records.values() if r.wanted and (r.versions or r.error))

    def models(self) -> list[LoadedModel]:
        loaded = []
        for record in self._records.values():
            for status in record.versions.values():
                if status.model is not None and status.state is ModelState.READY:
                    loaded.append(status.model)
        return loaded

    def record(self, name: str) -> ModelRecord | None:
        return self._records.get(name)

    async def load(
        self, name: str, config_json: str | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        """Load (or reload) a model's versions under its policy, after the models it runs on; then load again the
        ensembles that run on what came up. Raise naming the reason if any version failed.

        With `files` (path inside the model's folder -> content, checked by the service; `config_json` given too),
        the model loads from a new private folder holding them and `config_json` as its config.pbtxt, and keeps
        loading from there; without, from its repository again (Triton: the files override the repository's model
        until it is unloaded)."""
        folder = None
        if files is not None:
            folder = await asyncio.to_thread(self._store.write_override, name, files, config_json)
            self._written.setdefault(name, set()).add(folder)
        try:
            self._store.set_override(name, folder)  # the last load request says where the model's files are
            loaded, error = await self._load_with_composing(name, config_json)
            await self._reload_dependents(loaded, {name})
        finally:
            self._release_unused(name)
        if error is not None:
            raise error

    async def unload(self, name: str) -> None:
        """Unload `name` (and the ensembles that run on it), then give the memory it held back to the system."""
        self._store.set_override(name, None)  # the files of a load request serve until the model is unloaded
        try:
            await self._unload(name)
        finally:
            self._release_unused(name)
        await memory.give_back()

    # ---- what the memory budget asks (repository/budget.py decides, repository/holder.py answers) -----------

    def folder(self, name: str) -> Path | None:
        """Where a load of `name` would read its files (a repository's folder, or a load request's); None: nowhere."""
        return self._store.find(name)

    def loads_from_request(self, name: str) -> bool:
        """`name` serves from the files a load request gave (Triton's model file override)."""
        return self._store.override(name) is not None

    async def ensure(self, name: str) -> None:
        """Load `name` unless a version of it serves (a request needs it: load on demand)."""
        if not self._is_up(name):
            await self.load(name)

    def busy(self, name: str) -> bool:
        """A request of `name`, or of a serving ensemble that runs on it, is under way (queued or executing): unloading
        it now would unload a model under a request."""
        serving = {n for n, r in self._records.items() if r.latest is not None}
        return any(self._has_requests(m) for m in (name, *self._graph.unload_order(name, serving)))

    def _has_requests(self, name: str) -> bool:
        record = self._records.get(name)
        if record is None:
            return False
        return any(m.users or m.scheduler.inflight_count for m in record.serving())

    def hold(self, names: Iterable[str]) -> None:
        """No new request reaches `names` (nor the ensembles that run on them) from now on: their versions leave the
        infer path's lookups as UNLOADING, until released or unloaded."""
        for name in self._with_dependents(names):
            record = self._records[name]
            for status in record.versions.values():
                if status.state is ModelState.READY:
                    status.state = ModelState.UNLOADING
            record.refresh_latest()

    def release(self, names: Iterable[str]) -> None:
        """Held models serve again."""
        for name in self._with_dependents(names):
            record = self._records[name]
            for status in record.versions.values():
                if status.state is ModelState.UNLOADING and status.model is not None:
                    status.state = ModelState.READY
            record.refresh_latest()

    def _with_dependents(self, names: Iterable[str]) -> list[str]:
        serving = {n for n, r in self._records.items() if r.serving()}
        found = dict.fromkeys(n for n in names if n in self._records)
        for name in list(found):
            found.update(dict.fromkeys(self._graph.unload_order(name, serving)))
        return list(found)

    def take_measured(self) -> dict[str, dict[int, tuple[int, int]]]:
        """What the versions built since the last call measured (with LifecycleOptions.measure_memory): bytes made
        resident, and bytes mapped not yet resident (repository/memory.py)."""
        measured, self._versions.measured = self._versions.measured, {}
        return measured

    async def runs_on(self, name: str) -> set[str]:
        """`name` and every model its ensembles' steps run on, directly or not, as the configs on disk say."""
        if not self._settled(name):
            model_dir = self._store.find(name)
            if model_dir is not None:
                self._graph.set_composing(name, await asyncio.to_thread(self._builder.composing_names, model_dir))
        await self._discover(name)
        found, pending = {name}, [name]
        while pending:
            for composing in self._graph.composing(pending.pop()):
                if composing not in found:
                    found.add(composing)
                    pending.append(composing)
        return found

    def is_up(self, name: str) -> bool:
        """A version of `name` serves."""
        return self._is_up(name)

    async def _unload(self, name: str) -> None:
        record = self._records.get(name)
        if record is None:
            return  # as in Triton, unloading what is not loaded succeeds
        self._graph.unblock(name)  # unloaded on purpose: a composing model's return does not bring it back
        serving = {n for n, r in self._records.items() if r.latest is not None}
        for ensemble in self._graph.unload_order(name, serving):
            logger.info("unloading ensemble '%s': its composing model '%s' is unloading", ensemble, name)
            self._records[ensemble].wanted = False
            await self._versions.unload(self._records[ensemble])
            self._graph.block(ensemble)
        record.wanted = False
        await self._versions.unload(record)

    async def shutdown(self) -> None:
        for record in list(self._records.values()):
            await self._versions.unload(record)
        self._written.clear()
        await asyncio.to_thread(self._store.remove_overrides)

    # ---- loading, in the graph's order ------------------------------------------------------------

    async def _load_with_composing(
        self, name: str, config_json: str | None
    ) -> tuple[set[str], GeserveError | None]:
        """Load `name`, bringing up first the models it runs on that are not up; the models that came up."""
        model_dir = self._store.find(name)
        if model_dir is None:
            return set(), InternalError(f"failed to load '{name}', failed to poll from model repository")
        loaded: set[str] = set()
        with self._in_flight(name), self._reading_from(name, model_dir):
            record = self._records.setdefault(name, ModelRecord(name))
            record.wanted = True
            started = time.monotonic()
            try:
                prepared = await self._prepare(name, model_dir, config_json)
                if prepared.is_ensemble:
                    self._check_present(name, prepared.composing)
                    await self._bring_up_composing(name, loaded)
            except GeserveError as exc:
                await self._versions.fail(record, exc.message, started)
                self._sync_composing(record, self._graph.composing(name))
                return loaded, _load_failed(name, [exc.message])
            error = await self._finish(record, prepared, started)
        if error is None:
            loaded.add(name)
        return loaded, error

    async def _bring_up_composing(self, ensemble: str, loaded: set[str]) -> None:
        """Bring up the models `ensemble` runs on, one level of the graph's plan at a time, adding to `loaded` those
        this loaded. The plan is made again before each level: a load that was under way when the last one was
        made has told the graph its own composing models since."""
        tried: set[str] = set()
        while True:
            await self._discover(ensemble)
            # From here to the loads' flights being marked nothing awaits, so the plan is current when acted on
            # (the helpers below are plain calls, and `_load_level` marks them before its first await).
            plan = self._graph.load_plan(ensemble)
            batch = _next_batch(ensemble, plan, tried)
            if not batch:
                return
            waits = [m for m in batch if m in self._flights]
            loaded.update(await self._load_level(plan, self._to_load(batch), waits))

    def _to_load(self, batch: list[str]) -> dict[str, Path]:
        """The folders of the models of `batch` that need a load of their own, by name."""
        # A missing one is named by the ensemble that needs it; one that serves stays as it is.
        dirs = {m: self._store.find(m) for m in batch if m not in self._flights and not self._is_up(m)}
        return {m: d for m, d in dirs.items() if d is not None}

    async def _load_level(self, plan: LoadPlan, loads: dict[str, Path], waits: list[str]) -> list[str]:
        """Load `loads` and wait for the loads of `waits` under way, together; those of `loads` that came up."""
        # Marked here, before anything awaits; each load unmarks its own as it ends, for whoever waits on it.
        # Their folders are marked read as well, until the loads end.
        flights = {m: self._mark_in_flight(m) for m in loads}
        for model_dir in loads.values():
            self._reading[model_dir] += 1
        try:
            came_up = await asyncio.gather(
                *(self._load_alone(m, d, plan, flights[m]) for m, d in loads.items()),
                *(self._wait_for(m) for m in waits),
            )
        finally:
            for model, done in flights.items():
                self._unmark_in_flight(model, done)  # those a cancellation kept from starting
            for model, model_dir in loads.items():
                self._done_reading(model, model_dir)
        return [m for m, up in zip(loads, came_up[: len(loads)], strict=True) if up]

    async def _load_alone(self, name: str, model_dir: Path, plan: LoadPlan, flight: asyncio.Event) -> bool:
        """Load `name`, whose composing models are as up as they will get; whether it came up."""
        try:
            record = self._records.setdefault(name, ModelRecord(name))
            record.wanted = True
            started = time.monotonic()
            try:
                cycle = plan.cycle_error(name)
                if cycle is not None:
                    raise cycle
                prepared = await self._prepare(name, model_dir, None)
            except GeserveError as exc:
                await self._versions.fail(record, exc.message, started)
                return False
            return await self._finish(record, prepared, started) is None
        finally:
            self._unmark_in_flight(name, flight)

    async def _wait_for(self, name: str) -> None:
        """Wait for the loads of `name` under way (how they went shows in its record, which the ensemble reads)."""
        for done in list(self._flights.get(name, ())):
            await done.wait()

    async def _reload_dependents(self, loaded: set[str], skip: set[str]) -> None:
        """Load again the ensembles that run on `loaded` and serve or wait for them (blocked), each after those it
        runs on; an ensemble that comes back brings back in turn those that run on it."""
        reached, tried = set(loaded), loaded | skip
        while True:
            ensemble = next(
                (e for e in self._graph.reload_order(reached) if e not in tried and self._graph.composing(e) & reached),
                None,
            )
            if ensemble is None:
                return
            tried.add(ensemble)
            record = self._records.get(ensemble)
            if ensemble in self._flights or record is None:
                continue
            if record.latest is not None or self._graph.is_blocked(ensemble):
                came_up, _ = await self._load_with_composing(ensemble, None)
                reached |= came_up

    async def _prepare(self, name: str, model_dir: Path, config_json: str | None) -> PreparedModel:
        prepared = await asyncio.to_thread(self._builder.prepare, name, model_dir, config_json)
        self._graph.set_composing(name, prepared.composing)
        return prepared

    async def _discover(self, name: str) -> None:
        """Tell the graph what the models `name` runs on run on, reading the configs of those neither up nor
        loading (a load under way tells the graph itself, and may carry a config of its own)."""
        seen = {name}
        pending = list(self._graph.composing(name))
        while pending:
            model = pending.pop()
            if model in seen:
                continue
            seen.add(model)
            if not self._settled(model):
                model_dir = self._store.find(model)
                names = await asyncio.to_thread(self._builder.composing_names, model_dir) if model_dir else []
                if not self._settled(model):
                    self._graph.set_composing(model, names)
            pending.extend(self._graph.composing(model))

    def _settled(self, name: str) -> bool:
        """Whether the graph already knows `name`'s composing models: it serves, or a load of it is under way."""
        return name in self._flights or self._is_up(name)

    def _is_up(self, name: str) -> bool:
        record = self._records.get(name)
        return record is not None and record.latest is not None

    async def _finish(self, record: ModelRecord, prepared: PreparedModel, started: float) -> GeserveError | None:
        """`record`'s own load, its composing models (if any) being as up as they will get."""
        try:
            steps = self._resolve_steps(record.name, prepared.config) if prepared.is_ensemble else {}
        except GeserveError as exc:
            await self._versions.fail(record, exc.message, started)
            self._sync_composing(record, prepared.composing)
            return _load_failed(record.name, [exc.message])
        failures = await self._versions.load(record, prepared, steps, started)
        self._sync_composing(record, prepared.composing)
        return _load_failed(record.name, failures) if failures else None

    def _sync_composing(self, record: ModelRecord, attempted: Iterable[str]) -> None:
        """The graph follows the configs that serve (older ones, after a failed reload), else the one attempted."""
        serving = record.serving()
        if serving:
            attempted = {n for m in serving if is_ensemble(m.config) for n in step_model_names(m.config)}
        self._graph.set_composing(record.name, attempted)

    def _check_present(self, ensemble: str, composing: list[str]) -> None:
        missing = [n for n in composing if self._store.find(n) is None]
        if missing:
            self._graph.block(ensemble)
            raise InvalidArgumentError(
                f"ensemble {ensemble} contains models that are not available or ambiguous: {', '.join(missing)}"
            )

    def _resolve_steps(self, ensemble: str, config: ModelConfig) -> dict[str, ModelConfig]:
        """The configs of the composing models the steps run on, by name, checked against the steps."""
        self._check_present(ensemble, step_model_names(config))
        configs: dict[str, ModelConfig] = {}
        for step in config.ensemble_scheduling.step:
            version = "" if step.model_version < 0 else str(step.model_version)
            try:
                configs[step.model_name] = self.get(step.model_name, version).config
            except GeserveError as exc:
                self._graph.block(ensemble)
                raise InvalidArgumentError(
                    f"ensemble '{ensemble}' depends on '{step.model_name}' which is not valid. Model "
                    f"'{step.model_name}' failed with error: {self._reason(step.model_name, exc)}"
                ) from None
        validate_ensemble_steps(config, configs)  # a mismatch stays blocked: a fixed composing model may cure it
        if any(c.model_transaction_policy.decoupled for c in configs.values()):
            config.model_transaction_policy.decoupled = True  # as Triton marks it: it answers with a stream
        self._graph.unblock(ensemble)
        return configs

    def _reason(self, name: str, error: GeserveError) -> str:
        record = self._records.get(name)
        if record is None:
            return error.message
        if record.error:
            return record.error
        reasons = [f"version {v}: {s.reason}" for v, s in sorted(record.versions.items()) if s.reason]
        return "; ".join(reasons) or error.message

    # ---- the private folders of load requests with files ---------------------------------------------

    @contextlib.contextmanager
    def _reading_from(self, name: str, model_dir: Path) -> Iterator[None]:
        """A load of `name` reads `model_dir` meanwhile: the folder is not deleted under it."""
        self._reading[model_dir] += 1
        try:
            yield
        finally:
            self._done_reading(name, model_dir)

    def _done_reading(self, name: str, model_dir: Path) -> None:
        self._reading[model_dir] -= 1
        if self._reading[model_dir] <= 0:
            del self._reading[model_dir]
        self._release_unused(name)

    def _release_unused(self, name: str) -> None:
        """Delete the private folders written for `name` that nothing can read any more: not its folder now, no
        version serving from it, no load reading it. On a worker thread, not awaited: the folder is already out of
        every path a load could take, and the server's stop removes what is left."""
        written = self._written.get(name)
        if not written:
            return
        record = self._records.get(name)
        in_use = {self._store.override(name), *self._reading}
        if record is not None:
            in_use.update(model.model_dir for model in record.serving())
        unused = written - in_use
        if not unused:
            return
        written -= unused
        if not written:
            del self._written[name]
        loop = asyncio.get_running_loop()
        for folder in unused:
            logger.info("deleting the model files a load request gave for '%s': nothing serves from them", name)
            loop.run_in_executor(None, self._store.remove_override, folder)

    @contextlib.contextmanager
    def _in_flight(self, name: str) -> Iterator[None]:
        done = self._mark_in_flight(name)
        try:
            yield
        finally:
            self._unmark_in_flight(name, done)

    def _mark_in_flight(self, name: str) -> asyncio.Event:
        """A load of `name` is under way: loads that need `name` wait for it instead of starting another."""
        done = asyncio.Event()
        self._flights.setdefault(name, []).append(done)
        return done

    def _unmark_in_flight(self, name: str, done: asyncio.Event) -> None:
        if done.is_set():
            return
        done.set()
        flights = self._flights[name]
        flights.remove(done)
        if not flights:
            del self._flights[name]


def _load_failed(name: str, failures: list[str]) -> InvalidArgumentError:
    return InvalidArgumentError(f"load failed for model '{name}': {'; '.join(failures)}")


def _next_batch(ensemble: str, plan: LoadPlan, tried: set[str]) -> list[str]:
    """The models of the plan's first level not yet tried, added to `tried`; none when every level was tried. A
    cycle through `ensemble` is refused first."""
    cycle = plan.cycle_error(ensemble)
    if cycle is not None:
        raise cycle
    level = next((lv for lv in plan.levels if not tried.issuperset(lv)), ())
    batch = [m for m in level if m not in tried]
    tried.update(batch)
    return batch


def group_index(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Index entries (one per model version) as one entry per model: name, state (READY when a version is, else the
    first version's), and its versions with their states and reasons."""
    models: dict[str, dict[str, Any]] = {}
    for entry in entries:
        model = models.setdefault(entry["name"], {"name": entry["name"], "state": "", "versions": []})
        if "version" in entry:
            model["versions"].append({key: value for key, value in entry.items() if key != "name"})
        elif "reason" in entry:
            model["reason"] = entry["reason"]
        if entry.get("state") == ModelState.READY.value or not model["state"]:
            model["state"] = entry.get("state", "")
    return list(models.values())


def _version_entries(name: str, record: ModelRecord, ready_only: bool) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for version, status in sorted(record.versions.items()):
        if ready_only and status.state is not ModelState.READY:
            continue
        entry: dict[str, Any] = {"name": name, "version": str(version), "state": status.state.value}
        if status.reason:
            entry["reason"] = status.reason
        if status.model is not None and status.model.memory:
            entry["memory"] = status.model.memory
        entries.append(entry)
    return entries
