"""The ensemble dependency graph, as plain data: which models each ensemble runs on, and from that what to load
or unload, in what order. No I/O and no asyncio: the model manager reads configs, tells the graph, and asks it."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from geserve.errors import InvalidArgumentError


def cycle_message(cycle: Iterable[str]) -> str:
    return f"circular dependency between ensembles: {' -> '.join(cycle)}"


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What loading `target` takes. `levels`: the models it runs on, directly or not, level by level, innermost
    first (a model needs only models of earlier levels); the target is not among them. `circular`: for each
    model of the plan that lies on a dependency cycle, that cycle (it cannot load; nothing past it is planned)."""

    target: str
    levels: tuple[tuple[str, ...], ...] = ()
    circular: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def cycle_error(self, name: str) -> InvalidArgumentError | None:
        """Why `name` cannot load, when it lies on a cycle."""
        cycle = self.circular.get(name)
        return InvalidArgumentError(cycle_message(cycle)) if cycle is not None else None


class DependencyGraph:
    """Ensembles and their composing models, and the ensembles that are down because a composing model is."""

    def __init__(self) -> None:
        self._composing: dict[str, frozenset[str]] = {}  # ensemble -> the models its steps run on
        self._blocked: set[str] = set()  # ensembles to load again once their composing models are back

    # ---- what the manager tells it ----------------------------------------------------------------------

    def set_composing(self, model: str, composing: Iterable[str]) -> None:
        """`model`'s steps run on `composing` (nothing: it is not an ensemble)."""
        names = frozenset(composing)
        if names:
            self._composing[model] = names
        else:
            self._composing.pop(model, None)

    def block(self, ensemble: str) -> None:
        """`ensemble` is down for want of a composing model: load it again when one comes back."""
        self._blocked.add(ensemble)

    def unblock(self, model: str) -> None:
        self._blocked.discard(model)

    # ---- what it answers ---------------------------------------------------------------------------------

    def composing(self, model: str) -> frozenset[str]:
        return self._composing.get(model, frozenset())

    def is_blocked(self, model: str) -> bool:
        return model in self._blocked

    def dependents(self, model: str) -> frozenset[str]:
        """The ensembles with a step on `model`."""
        return frozenset(e for e, composing in self._composing.items() if model in composing)

    def cycle(self, model: str) -> tuple[str, ...] | None:
        """A chain of ensembles from `model` back to itself (`a -> b -> a`), if its composing models lead back."""
        # Depth-first with an explicit stack: each entry is a model and the composing models still to visit.
        path = [model]
        pending = [sorted(self.composing(model))]
        done: set[str] = set()
        while pending:
            if not pending[-1]:
                done.add(path.pop())
                pending.pop()
                continue
            nxt = pending[-1].pop(0)
            if nxt == model:
                return (*path, model)
            if nxt in done or nxt in path:
                continue
            path.append(nxt)
            pending.append(sorted(self.composing(nxt)))
        return None

    def load_plan(self, target: str) -> LoadPlan:
        """The models to bring up before `target`, in an order that brings up each after the models it runs on."""
        circular: dict[str, tuple[str, ...]] = {}
        depth: dict[str, int] = {}
        order: list[str] = []  # every model of the plan, each after all it runs on

        # Post-order walk from the target that stops at models on a cycle: past them nothing is needed.
        stack: list[tuple[str, list[str]]] = []

        def enter(model: str) -> None:
            cycle = self.cycle(model)
            if cycle is not None:
                circular[model] = cycle
                depth[model] = 0
                order.append(model)
            else:
                depth[model] = -1  # entered, not finished
                stack.append((model, sorted(self.composing(model))))

        enter(target)
        while stack:
            model, rest = stack[-1]
            if rest:
                nxt = rest.pop(0)
                if nxt not in depth:
                    enter(nxt)
                continue
            stack.pop()
            # A model off every cycle never meets an unfinished one below it, so every depth here is known.
            depth[model] = 1 + max((depth[c] for c in self.composing(model)), default=-1)
            order.append(model)
        if target in circular:
            return LoadPlan(target, (), circular)
        levels: dict[int, list[str]] = {}
        for model in order:
            if model != target:
                levels.setdefault(depth[model], []).append(model)
        return LoadPlan(target, tuple(tuple(levels[d]) for d in sorted(levels)), circular)

    def reload_order(self, loaded: Collection[str]) -> list[str]:
        """The ensembles that run on any of `loaded`, directly or through other ensembles, each after the ones it
        runs on: the order to load them again in once `loaded` are (back) up. Ensembles on a cycle come last."""
        wanted: set[str] = set()
        frontier = list(loaded)
        while frontier:
            for ensemble in self.dependents(frontier.pop()):
                if ensemble not in wanted:
                    wanted.add(ensemble)
                    frontier.append(ensemble)
        return _topological(wanted - set(loaded), self._composing)

    def unload_order(self, model: str, serving: Collection[str]) -> list[str]:
        """The serving ensembles that must stop before `model` does: those that run on it, directly or through a
        serving ensemble, each before the ones it runs on (`model` itself is not in the list)."""
        doomed = {model}
        frontier = [model]
        while frontier:
            for ensemble in self.dependents(frontier.pop()):
                if ensemble in serving and ensemble not in doomed:
                    doomed.add(ensemble)
                    frontier.append(ensemble)
        doomed.discard(model)
        return list(reversed(_topological(doomed, self._composing)))


def _topological(models: set[str], composing: Mapping[str, frozenset[str]]) -> list[str]:
    """`models`, each after those of them it runs on (Kahn's algorithm, ties by name); members of a cycle last."""
    needs = {m: set(composing.get(m, frozenset())) & models for m in models}
    ordered: list[str] = []
    ready = sorted(m for m, n in needs.items() if not n)
    while ready:
        model = ready.pop(0)
        ordered.append(model)
        for other, other_needs in needs.items():
            if model in other_needs:
                other_needs.discard(model)
                if not other_needs and other not in ordered and other not in ready:
                    ready.append(other)
        ready.sort()
    return ordered + sorted(models - set(ordered))
