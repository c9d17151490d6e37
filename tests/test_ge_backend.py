"""The GE backend on real ONNX Runtime sessions: auto-complete, parameters, layouts, execution (no server)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from geserve.backends.base import BackendSettings, ModelSource
from geserve.backends.ge import GeBackend
from geserve.backends.ge.dump import DataDumper, make_instance
from geserve.backends.ge.instance import GeInstance
from geserve.backends.ge.parameters import parse_ge_options
from geserve.config import ModelConfig, fill_defaults, parse_config_text, validate
from geserve.devices import KIND_CPU, threads_per_instance
from geserve.errors import InternalError, InvalidArgumentError
from geserve.scheduling.base import create_scheduler
from geserve.scheduling.pool import InstancePool
from geserve.statistics import ModelStatistics
from geserve.types import InferenceRequest, InferenceResponse, InputTensor
from tests.support import models


def _complete(model_dir: Path, text: str = "", max_batch: int = 4) -> ModelConfig:
    config = parse_config_text(text, "test") if text else ModelConfig()
    config.name = config.name or model_dir.name
    config.backend = config.backend or "ge"
    backend = GeBackend(BackendSettings({"default-max-batch-size": str(max_batch)}))
    backend.auto_complete_config(config, ModelSource(model_dir, 1))
    fill_defaults(config, KIND_CPU, backend.default_model_filename)
    validate(config, model_dir.name)
    return config


def test_auto_complete_fills_signature_and_batching(tmp_path: Path) -> None:
    model_dir = models.autocomplete(tmp_path)
    config = _complete(model_dir, max_batch=16)
    assert config.max_batch_size == 16
    assert [(t.name, list(t.dims)) for t in config.input] == [("x", [4])]
    assert [(t.name, list(t.dims)) for t in config.output] == [("y", [4])]


def test_auto_complete_keeps_full_rank_dims_without_batching(tmp_path: Path) -> None:
    model_dir = models.nobatch(tmp_path)
    config = _complete(model_dir, (model_dir / "config.pbtxt").read_text().replace('backend: "npu_ge"', ""))
    assert config.max_batch_size == 0
    assert list(config.input[0].dims) == [2, 3]


def test_auto_complete_scalar_output_gets_reshape(tmp_path: Path) -> None:
    models.digits(tmp_path)
    config = _complete(tmp_path / "digits", 'name: "digits" platform: "graph_executor" max_batch_size: 8')
    label = next(t for t in config.output if t.name == "label")
    assert list(label.dims) == [1] and label.HasField("reshape") and list(label.reshape.shape) == []


def test_config_that_disagrees_with_graph_is_rejected(tmp_path: Path) -> None:
    model_dir = models.simple(tmp_path)
    text = (model_dir / "config.pbtxt").read_text()
    text = text.replace('{ name: "INPUT0" data_type: TYPE_INT32', '{ name: "INPUT0" data_type: TYPE_FP32')
    config = _complete(model_dir, text)
    with pytest.raises(InvalidArgumentError, match="unexpected datatype TYPE_FP32 for input 'INPUT0'"):
        GeBackend().create_instances(config, ModelSource(model_dir, 1))


def test_instances_execute_single_and_batched_requests(tmp_path: Path) -> None:
    model_dir = models.simple(tmp_path)
    config = _complete(model_dir, (model_dir / "config.pbtxt").read_text())
    config.instance_group[0].count = 2
    instances = GeBackend().create_instances(config, ModelSource(model_dir, 1))
    assert len(instances) == 2 and instances[0].name == "simple_0_0"

    def request(rows: int, offset: int) -> InferenceRequest:
        a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16) + offset
        b = np.ones((rows, 16), dtype=np.int32)
        tensors = [InputTensor("INPUT0", "INT32", a.shape, a), InputTensor("INPUT1", "INT32", b.shape, b)]
        req = InferenceRequest("simple", "", tensors)
        req.batch_size = rows
        return req

    (single,) = instances[0].execute([request(1, 0)]).results
    assert single.outputs[0].data.tolist() == (np.arange(16) + 1).reshape(1, 16).tolist()
    first, second = instances[1].execute([request(2, 0), request(1, 100)]).results
    assert first.outputs[0].shape == (2, 16) and second.outputs[0].shape == (1, 16)
    assert second.outputs[1].data.tolist() == (np.arange(16) + 99).reshape(1, 16).tolist()


@pytest.mark.parametrize(("device", "dumps", "inline"), [
    ("cpu", False, True),  # compute on the calling thread: may run on the event loop when short
    ("cuda:0", False, False),  # waits for the GPU, which the pool's CPU-time measure does not see
    ("cpu", True, False),  # writes every batch's tensors to disk
])
def test_only_a_plain_cpu_instance_opts_in_to_the_event_loop(
    tmp_path: Path, device: str, dumps: bool, inline: bool
) -> None:
    model_dir = models.simple(tmp_path)
    config = _complete(model_dir, (model_dir / "config.pbtxt").read_text())
    loaded = GeBackend().create_instances(config, ModelSource(model_dir, 1))[0]
    assert loaded.inline_allowed
    dumper = DataDumper("simple", tmp_path / "dump", [], 1) if dumps else None
    instance = make_instance("simple_0", loaded._session, loaded._layout, device, dumper)
    assert instance.inline_allowed is inline


def _optional_inputs_model(tmp_path: Path) -> tuple[ModelConfig, list[GeInstance]]:
    model_dir = models.optional_inputs(tmp_path)
    config = _complete(model_dir, (model_dir / "config.pbtxt").read_text())
    return config, GeBackend().create_instances(config, ModelSource(model_dir, 1))


def _fed(rid: str, **inputs: float) -> InferenceRequest:
    """One row of `optional_inputs`, with the named inputs (in the order given) each filled with its value."""
    tensors = [InputTensor(n, "FP32", (1, 4), np.full((1, 4), v, np.float32)) for n, v in inputs.items()]
    return InferenceRequest("optional_inputs", "", tensors, id=rid)


def _y(result: InferenceResponse | Exception) -> list[float]:
    assert isinstance(result, InferenceResponse), result
    return [float(v) for v in result.outputs[0].data[0]]


def test_optional_inputs_are_overridable_initializers_fed_or_left_to_their_default(tmp_path: Path) -> None:
    config, (instance,) = _optional_inputs_model(tmp_path)
    assert [t.name for t in config.input] == ["X", "A", "B"]  # auto-complete adds no initializer as an input
    for inputs, expected in (({"X": 1}, 1.0), ({"X": 1, "A": 2}, 3.0), ({"X": 1, "B": 2}, 21.0)):
        (result,) = instance.execute([_fed("r", **inputs)]).results
        assert _y(result) == [expected] * 4


def test_a_batch_joins_each_input_by_its_name(tmp_path: Path) -> None:
    _, (instance,) = _optional_inputs_model(tmp_path)
    first, second = instance.execute([_fed("r1", X=1, B=2), _fed("r2", B=3, X=5)]).results
    assert _y(first) == [21.0] * 4 and _y(second) == [35.0] * 4


def test_a_batch_whose_requests_carry_different_inputs_fails_rather_than_mixing_them(tmp_path: Path) -> None:
    _, (instance,) = _optional_inputs_model(tmp_path)
    results = instance.execute([_fed("r1", X=1, A=1), _fed("r2", X=1, B=1)]).results
    assert all(isinstance(r, InternalError) and "carry different inputs" in r.message for r in results), results


def test_requests_carrying_different_optional_inputs_are_not_batched_together(tmp_path: Path) -> None:
    """Through the dynamic batcher: same shapes, different optional inputs; each must get its own answer."""
    config, instances = _optional_inputs_model(tmp_path)

    async def main() -> tuple[InferenceResponse, ...]:
        scheduler = create_scheduler(config, InstancePool(config.name, instances, ModelStatistics()))
        try:
            requests = [_fed("a", X=1, A=1), _fed("b", X=1, B=1), _fed("a2", X=2, A=2)]
            return tuple(await asyncio.gather(*(scheduler.enqueue(r) for r in requests)))
        finally:
            await scheduler.stop()

    with_a, with_b, with_a2 = asyncio.run(main())
    assert _y(with_a) == [2.0] * 4 and _y(with_b) == [11.0] * 4 and _y(with_a2) == [4.0] * 4


def test_both_parameter_dialects_are_read_and_unknown_rejected() -> None:
    config = parse_config_text(
        """
        name: "m"
        parameters { key: "DEVICE_ID" value: { string_value: "1" } }
        parameters { key: "EXECUTOR_TYPE" value: { string_value: "ge" } }
        parameters { key: "instance_exec_blocks" value: { string_value: "2" } }
        parameters { key: "session.ge.exec.precision_mode" value: { string_value: "allow_fp32_to_fp16" } }
        parameters { key: "ort.session.intra_op.allow_spinning" value: { string_value: "0" } }
        parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
        """,
        "test",
    )
    options = parse_ge_options(config)
    assert options.device_ids == [1] and options.executor_type == "GE" and options.instance_exec_blocks == 2
    assert options.ge_options == {"session.ge.exec.precision_mode": "allow_fp32_to_fp16"}
    assert options.ort_config_entries == {"session.intra_op.allow_spinning": "0"}
    assert options.intra_op_threads == 1
    config.parameters["typo_option"].string_value = "1"
    with pytest.raises(InvalidArgumentError, match="unknown parameter 'typo_option'"):
        parse_ge_options(config)


@pytest.mark.parametrize(
    ("count", "parameters", "expected"),
    [(2, {}, 2), (2, {"instance_exec_blocks": "3"}, 6), (2, {"device_exec_blocks": "3"}, 3),
     (3, {"device_exec_blocks": "1"}, 1)],
)
def test_exec_blocks_size_the_instance_pool(tmp_path: Path, count: int, parameters: dict, expected: int) -> None:
    model_dir = models.simple(tmp_path)
    config = _complete(model_dir, (model_dir / "config.pbtxt").read_text())
    config.instance_group[0].count = count
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    instances = GeBackend().create_instances(config, ModelSource(model_dir, 1))
    assert len(instances) == expected
    assert len({i.name for i in instances}) == expected


def test_threads_are_shared_between_instances() -> None:
    assert threads_per_instance(1) >= threads_per_instance(2) >= 1
    assert threads_per_instance(1000) == 1
