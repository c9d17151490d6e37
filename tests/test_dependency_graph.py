"""The ensemble dependency graph as plain data: load plans, cycles, reload and unload orders, blocked ensembles."""

from __future__ import annotations

from geserve.repository.dependencies import DependencyGraph, LoadPlan, cycle_message


def graph(edges: dict[str, list[str]]) -> DependencyGraph:
    built = DependencyGraph()
    for ensemble, composing in edges.items():
        built.set_composing(ensemble, composing)
    return built


# nested -> chain -> add_sub; diamond -> double, plus, minus; plus, minus -> double (as ensembles here)
PIPELINES = {
    "chain": ["add_sub"],
    "nested": ["chain"],
    "diamond": ["join", "plus", "minus", "double"],
    "plus": ["double"],
    "minus": ["double"],
}


def test_a_plain_model_needs_nothing() -> None:
    assert graph(PIPELINES).load_plan("add_sub") == LoadPlan("add_sub")


def test_composing_models_come_level_by_level_innermost_first() -> None:
    g = graph(PIPELINES)
    assert g.load_plan("chain").levels == (("add_sub",),)
    assert g.load_plan("nested").levels == (("add_sub",), ("chain",))
    # Each level needs only the levels before it, so the models of one level can load side by side.
    assert g.load_plan("diamond").levels == (("double", "join"), ("minus", "plus"))


def test_composing_models_replace_on_each_config() -> None:
    g = graph(PIPELINES)
    g.set_composing("chain", ["other"])
    assert g.composing("chain") == {"other"}
    assert g.dependents("add_sub") == frozenset()
    g.set_composing("chain", [])  # no longer an ensemble
    assert g.composing("chain") == frozenset() and g.dependents("other") == frozenset()


def test_a_cycle_is_named_from_the_model_asked_about() -> None:
    g = graph({"loop_a": ["loop_b"], "loop_b": ["loop_a"], "self": ["self"]})
    assert g.cycle("loop_a") == ("loop_a", "loop_b", "loop_a")
    assert g.cycle("loop_b") == ("loop_b", "loop_a", "loop_b")
    assert g.cycle("self") == ("self", "self")
    plan = g.load_plan("loop_a")
    assert plan.levels == ()  # nothing is loaded for a model that cannot load
    error = plan.cycle_error("loop_a")
    assert error is not None
    assert error.message == "circular dependency between ensembles: loop_a -> loop_b -> loop_a"
    assert cycle_message(["a", "b", "a"]) == "circular dependency between ensembles: a -> b -> a"


def test_a_cycle_below_the_target_is_planned_as_such_and_not_walked_past() -> None:
    # top -> middle -> loop_a <-> loop_b; loop_a also runs on deep, which nothing else needs
    g = graph({"top": ["middle"], "middle": ["loop_a"], "loop_a": ["loop_b", "deep"], "loop_b": ["loop_a"]})
    plan = g.load_plan("top")
    assert plan.cycle_error("top") is None
    assert plan.levels == (("loop_a",), ("middle",))  # middle loads, and fails naming loop_a
    assert dict(plan.circular) == {"loop_a": ("loop_a", "loop_b", "loop_a")}
    assert g.cycle("top") is None and g.cycle("deep") is None


def test_a_shared_composing_model_is_planned_once() -> None:
    g = graph({"outer": ["left", "right"], "left": ["base"], "right": ["base"]})
    assert g.load_plan("outer").levels == (("base",), ("left", "right"))


def test_reload_order_follows_dependents_outward() -> None:
    g = graph(PIPELINES)
    assert g.dependents("add_sub") == {"chain"}
    assert g.reload_order({"add_sub"}) == ["chain", "nested"]
    assert g.reload_order({"double"}) == ["minus", "plus", "diamond"]
    assert g.reload_order({"double", "minus"}) == ["plus", "diamond"]  # what came up is not loaded again
    assert g.reload_order({"nested"}) == []


def test_reload_order_puts_ensembles_on_a_cycle_last() -> None:
    g = graph({"loop_a": ["loop_b", "base"], "loop_b": ["loop_a"], "plain": ["base"]})
    assert g.reload_order({"base"}) == ["plain", "loop_a", "loop_b"]


def test_unload_order_stops_outermost_first_and_only_what_serves() -> None:
    g = graph(PIPELINES)
    everything = {"add_sub", "chain", "nested", "diamond", "plus", "minus", "double", "join"}
    assert g.unload_order("add_sub", everything) == ["nested", "chain"]
    assert g.unload_order("double", everything) == ["diamond", "plus", "minus"]
    assert g.unload_order("join", everything) == ["diamond"]
    # An ensemble that does not serve stops nothing: what runs on it went down with it already.
    assert g.unload_order("add_sub", everything - {"chain"}) == []
    assert g.unload_order("double", everything - {"plus"}) == ["diamond", "minus"]


def test_blocked_ensembles_are_remembered_until_unblocked() -> None:
    g = graph(PIPELINES)
    assert not g.is_blocked("chain")
    g.block("chain")
    assert g.is_blocked("chain")
    g.unblock("chain")
    g.unblock("never_blocked")
    assert not g.is_blocked("chain")
