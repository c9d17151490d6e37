"""Small real ONNX models for the tests, written with onnx.helper into Triton model repositories."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"

def example_onnx(name: str) -> Path:
    """An example model's ONNX file, built by examples/build.py first if needed (a no-op once built)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from build import main as build_examples

    build_examples(["--only", name])
    return EXAMPLES / "model_repository" / name / "1" / "model.onnx"


_IDENTITY_TYPES = {
    "fp16": (TensorProto.FLOAT16, "TYPE_FP16"),
    "bf16": (TensorProto.BFLOAT16, "TYPE_BF16"),
    "bool": (TensorProto.BOOL, "TYPE_BOOL"),
    "bytes": (TensorProto.STRING, "TYPE_STRING"),
    "int8": (TensorProto.INT8, "TYPE_INT8"),
    "uint64": (TensorProto.UINT64, "TYPE_UINT64"),
    "fp64": (TensorProto.DOUBLE, "TYPE_FP64"),
}


def _save(model_dir: Path, graph: onnx.GraphProto, config: str | None, version: int = 1) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(model_dir / str(version) / "model.onnx"))
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)


def simple(repo: Path, name: str = "simple", max_batch_size: int = 8, extra: str = "") -> Path:
    """Triton's classic `simple`: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, INT32 [16]."""
    dims = ["batch", 16] if max_batch_size else [16]
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, dims),
         helper.make_tensor_value_info("INPUT1", TensorProto.INT32, dims)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, dims),
         helper.make_tensor_value_info("OUTPUT1", TensorProto.INT32, dims)],
    )
    config = f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [
  {{ name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
  {{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
{extra}
"""
    model_dir = repo / name
    _save(model_dir, graph, config)
    return model_dir


def identity(repo: Path, kind: str) -> Path:
    """`identity_<kind>`: OUTPUT0 = INPUT0 for one datatype, batching, variable length."""
    onnx_type, config_type = _IDENTITY_TYPES[kind]
    name = f"identity_{kind}"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        name,
        [helper.make_tensor_value_info("INPUT0", onnx_type, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", onnx_type, ["batch", "n"])],
    )
    config = f"""
name: "{name}"
platform: "graph_executor"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: {config_type} dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {config_type} dims: [ -1 ] }} ]
"""
    model_dir = repo / name
    _save(model_dir, graph, config)
    return model_dir


def nobatch(repo: Path) -> Path:
    """`nobatch`: max_batch_size 0, FP32 [2, 3] -> Relu."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["INPUT0"], ["OUTPUT0"])],
        "nobatch",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [2, 3])],
    )
    config = """
name: "nobatch"
backend: "npu_ge"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
parameters { key: "device_ids" value: { string_value: "0" } }
parameters { key: "instance_exec_blocks" value: { string_value: "1" } }
"""
    model_dir = repo / "nobatch"
    _save(model_dir, graph, config)
    return model_dir


def optional_inputs(repo: Path, name: str = "optional_inputs") -> Path:
    """FP32 [batch, 4]: Y = X + A + 10 * B, where A and B are optional inputs (graph inputs with a zero default
    initializer, which a request may feed or leave out); dynamic batching waits up to 0.3 s for a batch of 2."""
    zeros = [0.0] * 4
    graph = helper.make_graph(
        [helper.make_node("Mul", ["B", "ten"], ["B10"]), helper.make_node("Add", ["X", "A"], ["XA"]),
         helper.make_node("Add", ["XA", "B10"], ["Y"])],
        name,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("X", "A", "B")],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[helper.make_tensor("A", TensorProto.FLOAT, [1, 4], zeros),
                     helper.make_tensor("B", TensorProto.FLOAT, [1, 4], zeros),
                     helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0])],
    )
    config = f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [
  {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "A" data_type: TYPE_FP32 dims: [ 4 ] optional: true }},
  {{ name: "B" data_type: TYPE_FP32 dims: [ 4 ] optional: true }}
]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
dynamic_batching {{ preferred_batch_size: [ 2 ] max_queue_delay_microseconds: 300000 }}
"""
    model_dir = repo / name
    _save(model_dir, graph, config)
    return model_dir


def autocomplete(repo: Path, name: str = "autocomplete") -> Path:
    """A model with no config.pbtxt: FP32 [batch, 4] -> Mul by 2; everything comes from auto-complete."""
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[two],
    )
    model_dir = repo / name
    _save(model_dir, graph, None)
    return model_dir


def digits(repo: Path) -> Path:
    """The example digits classifier, built by examples/build.py (cached there), copied into `repo`."""
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from build_digits import build

    source = build(EXAMPLES / "model_repository", EXAMPLES / ".build")
    target = repo / "digits"
    if not target.exists():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".stamp"))
    return target


def digits_test_set() -> tuple:
    import numpy as np

    data = np.load(EXAMPLES / ".build" / "digits_test.npz")
    return data["pixels"], data["labels"]


def good_repository(repo: Path) -> Path:
    """Every well-formed test model in one repository."""
    repo.mkdir(parents=True, exist_ok=True)
    simple(repo)
    nobatch(repo)
    autocomplete(repo)
    digits(repo)
    for kind in _IDENTITY_TYPES:
        identity(repo, kind)
    return repo


def broken_repository(repo: Path) -> Path:
    """One good model beside models that must become UNAVAILABLE with a reason naming the problem."""
    repo.mkdir(parents=True, exist_ok=True)
    simple(repo)
    bad_config = simple(repo, "bad_config")
    (bad_config / "config.pbtxt").write_text('name: "bad_config"\nmax_batch_size: eight\n')
    bad_onnx = simple(repo, "bad_onnx")
    (bad_onnx / "1" / "model.onnx").write_bytes(b"this is not an onnx file")
    wrong_name = simple(repo, "wrong_name")
    config = (wrong_name / "config.pbtxt").read_text().replace('name: "wrong_name"', 'name: "other"')
    (wrong_name / "config.pbtxt").write_text(config)
    bad_param = simple(repo, "bad_param", extra='parameters { key: "no_such_option" value: { string_value: "1" } }')
    # A GE dialect: a Triton ONNX Runtime model ignores unknown parameters (as Triton does), a GE one refuses them.
    config = (bad_param / "config.pbtxt").read_text().replace('backend: "onnxruntime"', 'platform: "graph_executor"')
    (bad_param / "config.pbtxt").write_text(config)
    assert bad_param.exists()
    return repo


_WARMUP_RECORDER = '''"""Records each instance's executions: a JSON line per execute() in <record_dir>/<instance>.jsonl.

Parameters: record_dir (where), fail ("1": every response is an error). Decoupled when its config says so.
"""

import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        parameters = config.get("parameters", {})
        self.path = os.path.join(parameters["record_dir"]["string_value"], args["model_instance_name"] + ".jsonl")
        self.fail = parameters.get("fail", {}).get("string_value") == "1"
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

    def _record(self, entry):
        with open(self.path, "a") as record:
            record.write(json.dumps(entry) + "\\n")

    def execute(self, requests):
        arrays = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        self._record({"requests": [{"shape": list(a.shape), "values": a.ravel().tolist()} for a in arrays]})
        responses = []
        for array in arrays:
            if self.fail:
                responses.append(pb_utils.InferenceResponse([], error=pb_utils.TritonError("recorder refuses")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", array)]))
        if not self.decoupled:
            return responses
        for request, response in zip(requests, responses):
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self._record({"finalized": True})
'''


def warmup_recorder(
    repo: Path, name: str, record_dir: Path, warmup: str, instances: int = 2, fail: bool = False,
    decoupled: bool = False,
) -> Path:
    """A Python model (FP32 [4] in, the same out, batching up to 4) on `instances` instances, each recording every
    execute() it runs, warmup included, in `record_dir`/<instance name>.jsonl; `warmup` is its model_warmup."""
    record_dir.mkdir(parents=True, exist_ok=True)
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(_WARMUP_RECORDER)
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    (model_dir / "config.pbtxt").write_text(f"""
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
parameters {{ key: "record_dir" value: {{ string_value: "{record_dir}" }} }}
parameters {{ key: "fail" value: {{ string_value: "{1 if fail else 0}" }} }}
{policy}
{warmup}
""")
    return model_dir


def accumulator(
    repo: Path,
    name: str = "accumulator",
    strategy: str = "direct { }",
    idle_us: int = 5_000_000,
    max_batch_size: int = 4,
    initial_value: int | None = None,
    instances: int = 1,
    state_output: bool = False,
) -> Path:
    """A stateful ONNX model for the sequence batcher: OUTPUT = INPUT + STATE_IN and STATE_OUT = OUTPUT (INT32 [1]),
    the state kept by the server between a sequence's requests (implicit state, zero at START, or `initial_value`
    read from initial_state/start.bin). CONTROLS echoes START, END and READY as INT32 [3] (given as int32, fp32 and
    bool controls) and CORRID_OUT the UINT64 correlation id, so a test sees what the batcher fed. `state_output`:
    STATE_OUT is declared an output too (Triton's `*_sequence_int32_output` models), so a client may ask for it."""
    batch = ["batch"] if max_batch_size else []
    one = [*batch, 1]
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT", "STATE_IN"], ["OUTPUT"]),
         helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
         helper.make_node("Cast", ["END"], ["END_I"], to=TensorProto.INT32),
         helper.make_node("Cast", ["READY"], ["READY_I"], to=TensorProto.INT32),
         helper.make_node("Concat", ["START", "END_I", "READY_I"], ["CONTROLS"], axis=len(batch)),
         helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"])],
        name,
        [helper.make_tensor_value_info("INPUT", TensorProto.INT32, one),
         helper.make_tensor_value_info("START", TensorProto.INT32, one),
         helper.make_tensor_value_info("END", TensorProto.FLOAT, one),
         helper.make_tensor_value_info("READY", TensorProto.BOOL, one),
         helper.make_tensor_value_info("CORRID", TensorProto.UINT64, one),
         helper.make_tensor_value_info("STATE_IN", TensorProto.INT32, one)],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.INT32, one),
         helper.make_tensor_value_info("STATE_OUT", TensorProto.INT32, one),
         helper.make_tensor_value_info("CONTROLS", TensorProto.INT32, [*batch, 3]),
         helper.make_tensor_value_info("CORRID_OUT", TensorProto.UINT64, one)],
    )
    initial = 'zero_data: true name: "zero"' if initial_value is None else 'data_file: "start.bin" name: "file"'
    declared_state = ',\n  { name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] }' if state_output else ""
    config = f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "CONTROLS" data_type: TYPE_INT32 dims: [ 3 ] }},
  {{ name: "CORRID_OUT" data_type: TYPE_UINT64 dims: [ 1 ] }}{declared_state}
]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  state [ {{
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] {initial} }}
  }} ]
}}
"""
    model_dir = repo / name
    _save(model_dir, graph, config)
    if initial_value is not None:
        (model_dir / "initial_state").mkdir(exist_ok=True)
        start = int(initial_value).to_bytes(4, "little", signed=True)
        (model_dir / "initial_state" / "start.bin").write_bytes(start)
    return model_dir


_PY_ACCUMULATOR = '''"""A Triton Python sequence model: OUTPUT = INPUT + STATE_IN, its implicit state
STATE_OUT = OUTPUT; FLAGS is request.flags() and CORRID request.correlation_id() as text; a null request (READY 0)
answers zeros."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "STATE_IN").as_numpy()
            ready = pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()
            total = ((x + state) * ready).astype(np.int32)
            flags = np.full(x.shape, request.flags(), dtype=np.int32)
            corrid = np.array([[str(request.correlation_id()).encode()]], dtype=object)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT", total), pb_utils.Tensor("STATE_OUT", total),
                pb_utils.Tensor("FLAGS", flags), pb_utils.Tensor("CORRID", corrid),
            ]))
        return responses
'''


def python_accumulator(repo: Path, name: str = "py_accumulator") -> Path:
    """The Python twin of `accumulator` (max_batch_size 2, direct): it reads the flags and correlation id through
    pb_utils as Triton's Python models do, and keeps its sum as implicit state; string or integer ids."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(_PY_ACCUMULATOR)
    (model_dir / "config.pbtxt").write_text(f"""
name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "FLAGS" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "CORRID" data_type: TYPE_STRING dims: [ 1 ] }}
]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
sequence_batching {{
  control_input [ {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] }} ] }} ]
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
}}
""")
    return model_dir


def silero_vad(repo: Path, name: str = "silero_vad", strategy: str = "oldest { max_candidate_sequences: 4 }") -> Path:
    """Silero VAD as shipped by the `silero-vad` package (`silero_vad_16k_op15.onnx`, unchanged) as a sequence model:
    its recurrent `state` / `stateN` [2, 1, 128] kept by the server between a stream's chunks (implicit state, zero
    at START). Not batching (its state carries the batch on its second axis), so `oldest` interleaves several
    streams on one instance. `sr` is the scalar sample rate, sent as [1] and reshaped."""
    import silero_vad as package

    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(package.__file__).parent / "data" / "silero_vad_16k_op15.onnx", model_dir / "1" / "model.onnx")
    (model_dir / "config.pbtxt").write_text(f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: 0
input [
  {{ name: "input" data_type: TYPE_FP32 dims: [ 1, -1 ] }},
  {{ name: "sr" data_type: TYPE_INT64 dims: [ 1 ] reshape: {{ shape: [ ] }} }}
]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1, 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
sequence_batching {{
  {strategy}
  state [ {{
    input_name: "state" output_name: "stateN" data_type: TYPE_FP32 dims: [ 2, 1, 128 ]
    initial_state {{ data_type: TYPE_FP32 dims: [ 2, 1, 128 ] zero_data: true name: "silence" }}
  }} ]
}}
""")
    return model_dir


SLOW_PYTHON_MODEL = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        seconds = max(float(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().max()) for r in requests)
        time.sleep(seconds)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
'''


def slow_python(repo: Path, name: str, config: str) -> Path:
    """A Python model that sleeps as many seconds as its FP32 input `IN` says (the batch's largest), then answers
    `OUT` = 2 x `IN`: a model to keep an instance busy. `config` is its config.pbtxt."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config)
    (model_dir / "1" / "model.py").write_text(SLOW_PYTHON_MODEL)
    return model_dir


def identity_fp32(repo: Path, name: str, extra: str = "") -> Path:
    """FP32 [batch, n] identity (ONNX Runtime), batching up to 8, variable length; `extra` ends its config."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", "n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (repo / name / "1").mkdir(parents=True)
    onnx.save(model, str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        f'output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]\n{extra}\n'
    )
    return repo / name
