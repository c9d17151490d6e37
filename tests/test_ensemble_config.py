"""Ensemble configuration checks, each rule with its message (Triton's wording where it has one); no server."""

from __future__ import annotations

import pytest

from geserve.config import ModelConfig, fill_defaults, parse_config_text, validate
from geserve.config.ensemble import validate_ensemble_steps
from geserve.errors import InvalidArgumentError
from geserve.scheduling.ensemble_plan import EnsemblePlan
from tests.support.ensembles import AB, INT16, Ensemble, Step, add_sub_step, chain

OUT = [("SUM", *INT16), ("DIFF", *INT16)]


def _config(ensemble: Ensemble | str) -> ModelConfig:
    text = ensemble if isinstance(ensemble, str) else ensemble.config()
    config = parse_config_text(text, "test")
    fill_defaults(config, 0, "")
    return config


def _check(ensemble: Ensemble | str) -> None:
    config = _config(ensemble)
    validate(config, config.name)


def _step_model(name: str = "add_sub", max_batch_size: int = 8, extra: str = "", dims: str = "16",
                data_type: str = "TYPE_INT32") -> ModelConfig:
    def io(names: tuple[str, str]) -> str:
        return ", ".join(f'{{ name: "{n}" data_type: {data_type} dims: [ {dims} ] }}' for n in names)

    text = f"""name: "{name}" backend: "onnxruntime" max_batch_size: {max_batch_size}
input [ {io(("INPUT0", "INPUT1"))} ]
output [ {io(("OUTPUT0", "OUTPUT1"))} ]
{extra}"""
    return parse_config_text(text, "step")


def test_a_good_ensemble_passes_and_keeps_tritons_defaults() -> None:
    config = _config(chain("pipe", "add_sub"))
    validate(config, "pipe")
    validate_ensemble_steps(config, {"add_sub": _step_model()})
    assert not config.instance_group and not config.HasField("optimization")
    assert config.HasField("model_transaction_policy") and not config.model_transaction_policy.decoupled
    assert config.version_policy.latest.num_versions == 1 and config.backend == ""


GRAPH_FAULTS = [
    ("not-an-ensemble", chain("e", "m").config().replace('platform: "ensemble"', 'backend: "onnxruntime"'),
     "ensemble scheduling cannot be set for model 'e' whose platform is not ensemble"),
    ("no-scheduling", chain("e", "m").config().split("ensemble_scheduling")[0],
     "ensemble scheduling must be set for ensemble e whose platform is ensemble"),
    ("instance-group", Ensemble("e", AB, OUT, chain("e", "m").steps, extra="instance_group [ { count: 1 } ]"),
     "instance group should not be specified for ensemble 'e'"),
    ("optimization", Ensemble("e", AB, OUT, chain("e", "m").steps, extra="optimization { priority: PRIORITY_MAX }"),
     "optimization should not be specified for ensemble 'e'"),
    ("warmup", Ensemble("e", AB, OUT, chain("e", "m").steps, extra='model_warmup [ { name: "w" batch_size: 1 } ]'),
     "model_warmup can not be specified for ensemble 'e'"),
    ("no-steps", chain("e", "m").config().split("ensemble_scheduling")[0] + "ensemble_scheduling { }",
     "must specify 'step' for ensemble 'e'"),
    ("no-model-name", Ensemble("e", AB, OUT, [add_sub_step("", "A", "B", "SUM", "DIFF")]),
     "must specify 'model_name' in step 0 of ensemble 'e'"),
    ("no-input-map", Ensemble("e", AB, OUT, [Step("m", {}, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"})]),
     "must specify 'input_map' in step 0 of ensemble 'e'"),
    ("no-output-map", Ensemble("e", AB, OUT, [Step("m", {"INPUT0": "A", "INPUT1": "B"}, {})]),
     "must specify 'output_map' in step 0 of ensemble 'e'"),
    ("written-twice", Ensemble("e", AB, OUT, [add_sub_step("m", "A", "B", "SUM", "d"),
                                              add_sub_step("m", "A", "d", "SUM", "DIFF")]),
     "ensemble tensor 'SUM' can appear in an output map only once for ensemble 'e' step 1"),
    ("input-overwritten", Ensemble("e", AB, OUT, [add_sub_step("m", "A", "B", "SUM", "DIFF"),
                                                  add_sub_step("m", "SUM", "DIFF", "A", "x")]),
     "ensemble tensor 'A' of ensemble 'e' is an ensemble input and also written by step 1 (model 'm')"),
    ("unknown-tensor", Ensemble("e", AB, OUT, [add_sub_step("m", "A", "C", "SUM", "DIFF")]),
     "in ensemble 'e', step 0 (model 'm') reads ensemble tensor 'C', which is neither an ensemble input nor an "
     "output of any step"),
    ("cycle", Ensemble("e", AB, OUT, [add_sub_step("m", "A", "y", "x", "DIFF"), add_sub_step("n", "x", "B", "y", "z"),
                                      add_sub_step("m", "z", "B", "SUM", "w")]),
     "ensemble 'e' has a cycle: step 0 (m) -> step 1 (n) -> step 0 (m) (each needs an output of the next)"),
    ("self-cycle", Ensemble("e", AB, OUT, [add_sub_step("m", "A", "x", "x", "DIFF"),
                                           add_sub_step("m", "B", "x", "SUM", "w")]),
     "ensemble 'e' has a cycle: step 0 (m) -> step 0 (m) (each needs an output of the next)"),
    ("unused-input", Ensemble("e", [*AB, ("C", *INT16)], OUT, [add_sub_step("m", "A", "B", "SUM", "DIFF")]),
     "ensemble input 'C' for ensemble 'e' is not used"),
    ("output-not-written", Ensemble("e", AB, [*OUT, ("X", *INT16)], [add_sub_step("m", "A", "B", "SUM", "DIFF")]),
     "output 'X' for ensemble 'e' is not written"),
    ("unused-tensor", Ensemble("e", AB, OUT, [add_sub_step("m", "A", "B", "SUM", "DIFF"),
                                              add_sub_step("m", "A", "B", "x", "y")]),
     "ensemble tensor 'x' is unused in ensemble 'e'"),
]


@pytest.mark.parametrize(("config", "message"), [(c, m) for _, c, m in GRAPH_FAULTS],
                         ids=[i for i, _, _ in GRAPH_FAULTS])
def test_graph_faults(config: Ensemble | str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        _check(config)
    assert caught.value.message == message


STEP_FAULTS = [
    ("batch-size", chain("e", "add_sub"), {"add_sub": _step_model(max_batch_size=4)},
     "ensemble e allows maximum batch size 8, but it contains model add_sub which only allows maximum batch size "
     "to be 4"),
    ("no-such-input", Ensemble("e", AB, OUT, [Step("add_sub", {"INPUT0": "A", "INPUTX": "B"},
                                                   {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"})]), {},
     "in ensemble e, ensemble tensor B is mapping to non-existing input INPUTX in model add_sub"),
    ("input-not-mapped", Ensemble("e", [AB[0]], OUT, [Step("add_sub", {"INPUT0": "A"},
                                                           {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"})]), {},
     "in ensemble e, input INPUT1 in model add_sub is not mapped to any ensemble tensors"),
    ("no-such-output", Ensemble("e", AB, OUT, [Step("add_sub", {"INPUT0": "A", "INPUT1": "B"},
                                                    {"OUTPUT0": "SUM", "OUTPUTX": "DIFF"})]), {},
     "in ensemble e, ensemble tensor DIFF is mapped from non-existing output OUTPUTX in model add_sub"),
    ("data-type", Ensemble("e", [("A", "TYPE_FP32", (16,)), AB[1]], OUT,
                           [add_sub_step("add_sub", "A", "B", "SUM", "DIFF")]), {},
     "in ensemble e, ensemble tensor A: inconsistent data type: TYPE_FP32 is inferred from model e while TYPE_INT32 "
     "is inferred from model add_sub"),
    ("shape", Ensemble("e", AB, [("SUM", "TYPE_INT32", (8,)), OUT[1]],
                       [add_sub_step("add_sub", "A", "B", "SUM", "DIFF")]), {},
     "in ensemble e, ensemble tensor SUM: inconsistent shape: [-1,8] is inferred from model e while [-1,16] is "
     "inferred from model add_sub"),
    ("between-steps", Ensemble("e", AB, OUT, [add_sub_step("add_sub", "A", "B", "s", "d"),
                                              add_sub_step("wide", "s", "d", "SUM", "DIFF")]),
     {"wide": _step_model("wide", dims="32")},
     "in ensemble e, ensemble tensor s: inconsistent shape: [-1,16] is inferred from model add_sub while [-1,32] is "
     "inferred from model wide"),
]


@pytest.mark.parametrize(("ensemble", "steps", "message"), [(e, s, m) for _, e, s, m in STEP_FAULTS],
                         ids=[i for i, *_ in STEP_FAULTS])
def test_step_faults(ensemble: Ensemble, steps: dict[str, ModelConfig], message: str) -> None:
    config = _config(ensemble)
    validate(config, "e")  # the graph itself is fine
    with pytest.raises(InvalidArgumentError) as caught:
        validate_ensemble_steps(config, {"add_sub": _step_model(), **steps})
    assert caught.value.message == message


def test_compatible_steps_pass() -> None:
    # A non-batching step whose dims spell out the batch ([-1, 16]) meets a batching one's [16]: full shapes agree.
    flat = _step_model("flat", max_batch_size=0, dims="-1, 16")
    ensemble = Ensemble("e", AB, OUT, [add_sub_step("add_sub", "A", "B", "s", "d"),
                                       add_sub_step("flat", "s", "d", "SUM", "DIFF")])
    validate_ensemble_steps(_config(ensemble), {"add_sub": _step_model(), "flat": flat})
    # Variable dims match anything; an unmapped optional input is allowed.
    loose = _step_model("loose", dims="-1")
    loose.input[1].optional = True
    single = Ensemble("e", [AB[0]], OUT, [Step("loose", {"INPUT0": "A"}, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"})])
    validate_ensemble_steps(_config(single), {"loose": loose})


def test_plan_prunes_the_steps_requested_outputs_do_not_need() -> None:
    ensemble = Ensemble("e", AB, [("SUM", *INT16), ("DIFF", *INT16), ("X", *INT16)], [
        add_sub_step("add_sub", "A", "B", "s", "d"),      # 0
        add_sub_step("add_sub", "s", "d", "SUM", "t"),    # 1
        add_sub_step("add_sub", "A", "t", "DIFF", "u"),   # 2
        add_sub_step("add_sub", "B", "B", "X", "v"),      # 3
    ])
    config = _config(ensemble)
    plan = EnsemblePlan.build(config, {"add_sub": _step_model()})
    assert plan.route(frozenset({"SUM", "DIFF", "X"})).steps == {0, 1, 2, 3}
    assert plan.route(frozenset({"SUM"})).steps == {0, 1}
    assert plan.route(frozenset({"DIFF"})).steps == {0, 1, 2}
    assert plan.route(frozenset({"X"})).steps == {3}
    assert plan.consumers["A"] == (0, 2) and plan.producer["t"] == 1


def test_route_asks_steps_only_for_read_outputs_and_counts_readers_of_intermediates() -> None:
    ensemble = Ensemble("e", AB, [("SUM", *INT16), ("DIFF", *INT16)], [
        add_sub_step("add_sub", "A", "B", "s", "d"),      # 0
        add_sub_step("add_sub", "s", "s", "SUM", "t"),    # 1: t is read by nobody
        add_sub_step("add_sub", "s", "d", "u", "DIFF"),   # 2: u is read by nobody
    ])
    plan = EnsemblePlan.build(_config(ensemble), {"add_sub": _step_model()})
    both = plan.route(frozenset({"SUM", "DIFF"}))
    assert both.step_outputs == {0: ("OUTPUT0", "OUTPUT1"), 1: ("OUTPUT0",), 2: ("OUTPUT1",)}
    assert both.releasable == {"A": 1, "B": 1, "s": 2, "d": 1}
    only_sum = plan.route(frozenset({"SUM"}))
    assert only_sum.steps == {0, 1} and only_sum.step_outputs[0] == ("OUTPUT0",)
    assert only_sum.releasable == {"A": 1, "B": 1, "s": 1}
    assert plan.route(frozenset({"SUM"})) is only_sum  # built once per set of outputs


def test_plan_runs_each_step_after_the_innermost_decoupled_step_it_depends_on() -> None:
    decoupled = _step_model("split", extra="model_transaction_policy { decoupled: true }")
    ensemble = Ensemble("e", AB, [("SUM", *INT16), ("DIFF", *INT16)], [
        add_sub_step("add_sub", "A", "B", "s", "d"),      # 0: once per request
        add_sub_step("split", "s", "d", "s1", "d1"),      # 1: decoupled, once per request
        add_sub_step("split", "s1", "A", "s2", "d2"),     # 2: decoupled, once per response of 1
        add_sub_step("add_sub", "s2", "d", "SUM", "x"),   # 3: once per response of 2
        add_sub_step("add_sub", "d1", "B", "y", "DIFF"),  # 4: once per response of 1
    ])
    plan = EnsemblePlan.build(_config(ensemble), {"add_sub": _step_model(), "split": decoupled})
    assert plan.decoupled
    assert [step.scope for step in plan.steps] == [None, None, 1, 2, 1]
    route = plan.route(frozenset({"SUM", "DIFF"}))
    assert route.emit_scope == 2 and route.scope_steps == {None: (0, 1), 1: (2, 4), 2: (3,)}
    assert plan.route(frozenset({"DIFF"})).emit_scope == 1
    assert not EnsemblePlan.build(_config(chain("c", "add_sub")), {"add_sub": _step_model()}).decoupled


def test_plan_refuses_a_step_reading_two_unrelated_decoupled_steps() -> None:
    decoupled = _step_model("split", extra="model_transaction_policy { decoupled: true }")
    ensemble = Ensemble("e", AB, OUT, [
        add_sub_step("split", "A", "B", "s1", "d1"),
        add_sub_step("split", "B", "A", "s2", "d2"),
        add_sub_step("add_sub", "s1", "s2", "SUM", "DIFF"),
    ])
    with pytest.raises(InvalidArgumentError) as caught:
        EnsemblePlan.build(_config(ensemble), {"add_sub": _step_model(), "split": decoupled})
    assert caught.value.message == (
        "in ensemble 'e', step 2 (add_sub) reads the responses of decoupled steps 0 (split) and 1 (split), neither "
        "of which runs after the other: their responses cannot be paired"
    )
