"""Reads a model's `parameters` in both GE dialects (Ascend's names and Triton ONNX Runtime's) into GeOptions.

Nothing is dropped silently: known keys become options and `ort.*` keys ONNX Runtime session config entries. Anything
else is rejected with the list of accepted names in the GE dialects (`platform: "graph_executor"`, `backend: "ge"` /
`"npu_ge"`), whose users write geserve's names; a model of Triton's own ONNX Runtime platform loads with it ignored
and named in `GeOptions.ignored` (the backend warns once per model), as Triton's onnxruntime backend ignores the
parameters it does not know: a plain Triton repository must load unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from geserve.config import ModelConfig
from geserve.devices.cann import CANN_PARAMETERS
from geserve.devices.cuda import CUDA_PARAMETERS
from geserve.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

# GE's session and graph options only mean something to Graph Engine itself (the CANN provider).
_GE_PREFIXES = ("session.ge.", "graph.ge.")
_ORT_PREFIX = "ort."
_EXECUTOR_TYPES = {"GE", "ORT", "ONNXRUNTIME"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(slots=True)
class GeOptions:
    executor_type: str = "GE"
    accelerator: str | None = None  # "cuda", "npu", ... ; None follows the instance group kind
    device_ids: list[int] = field(default_factory=list)
    instance_exec_blocks: int = 1  # execution contexts per instance
    device_exec_blocks: int = 0  # execution contexts per device for the whole group; 0: count x instance blocks
    static_model: bool = False
    dump_graph: bool = False
    dump_data: bool = False  # every tensor of the first dump_data_batches batches as .npy (dump.py)
    dump_data_batches: int = 16
    dump_path: str = ""  # where dump_graph, dump_data and profiling write; "": <temp dir>/geserve_dump
    profiling: bool = False
    intra_op_threads: int = 0  # 0: share the cores among the instances
    inter_op_threads: int = 0
    sequential_execution: bool = True
    enable_mem_arena: bool = True
    enable_mem_pattern: bool = True
    ge_options: dict[str, str] = field(default_factory=dict)
    ort_config_entries: dict[str, str] = field(default_factory=dict)
    custom_ops: list[str] = field(default_factory=list)  # custom-op libraries (.so), relative to the model dir
    share_weights: bool = True  # CPU sessions map one file of prepacked weights (shared_weights.py)
    # Execution-provider parameters (CUDA's in Triton's names, CANN's), read by geserve.devices for their targets.
    device_parameters: dict[str, str] = field(default_factory=dict)
    # Unknown parameters of a Triton ONNX Runtime model, left out as Triton does (the GE dialects refuse them).
    ignored: list[str] = field(default_factory=list)


def _as_bool(key: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise InvalidArgumentError(f"parameter '{key}' expects true/false or 1/0, got '{value}'")


def _as_int(key: str, value: str, minimum: int = 0) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise InvalidArgumentError(f"parameter '{key}' expects an integer, got '{value}'") from None
    if number < minimum:
        raise InvalidArgumentError(f"parameter '{key}' must be >= {minimum}, got {number}")
    return number


def custom_op_libraries(value: str) -> list[str]:
    """The `custom_ops` parameter's comma-separated libraries, relative to the model folder (serving and compiling on
    first load read it alike)."""
    return [library.strip() for library in value.split(",") if library.strip()]


def _as_int_list(key: str, value: str) -> list[int]:
    return [_as_int(key, part) for part in value.replace(";", ",").split(",") if part.strip()]


def _set_executor_type(options: GeOptions, key: str, value: str) -> None:
    executor = value.strip().upper()
    if executor not in _EXECUTOR_TYPES:
        raise InvalidArgumentError(
            f"parameter '{key}' is '{value}'; this build executes graphs with: {', '.join(sorted(_EXECUTOR_TYPES))}"
        )
    options.executor_type = executor


def _set_execution_mode(options: GeOptions, key: str, value: str) -> None:
    mode = value.strip().lower()
    if mode not in ("0", "1", "sequential", "parallel"):
        raise InvalidArgumentError(f"parameter '{key}' expects 0 (sequential) or 1 (parallel), got '{value}'")
    options.sequential_execution = mode in ("0", "sequential")


_SETTERS: dict[str, Callable[[GeOptions, str, str], None]] = {
    "EXECUTOR_TYPE": _set_executor_type,
    "DEVICE_ID": lambda o, k, v: o.device_ids.__setitem__(slice(None), [_as_int(k, v)]),
    "device_ids": lambda o, k, v: o.device_ids.__setitem__(slice(None), _as_int_list(k, v)),
    "execution_accelerator": lambda o, k, v: setattr(o, "accelerator", v.strip().lower() or None),
    "instance_exec_blocks": lambda o, k, v: setattr(o, "instance_exec_blocks", _as_int(k, v, 1)),
    "device_exec_blocks": lambda o, k, v: setattr(o, "device_exec_blocks", _as_int(k, v, 1)),
    "static_model": lambda o, k, v: setattr(o, "static_model", _as_bool(k, v)),
    "dump_graph": lambda o, k, v: setattr(o, "dump_graph", _as_bool(k, v)),
    "dump_data": lambda o, k, v: setattr(o, "dump_data", _as_bool(k, v)),
    "dump_data_batches": lambda o, k, v: setattr(o, "dump_data_batches", _as_int(k, v, 1)),
    "dump_path": lambda o, k, v: setattr(o, "dump_path", v.strip()),
    "profiling": lambda o, k, v: setattr(o, "profiling", _as_bool(k, v)),
    # Triton's onnxruntime backend spells these; a plain Triton ONNX repository keeps working.
    "intra_op_thread_count": lambda o, k, v: setattr(o, "intra_op_threads", _as_int(k, v)),
    "inter_op_thread_count": lambda o, k, v: setattr(o, "inter_op_threads", _as_int(k, v)),
    "execution_mode": _set_execution_mode,
    "enable_mem_arena": lambda o, k, v: setattr(o, "enable_mem_arena", _as_bool(k, v)),
    "enable_mem_pattern": lambda o, k, v: setattr(o, "enable_mem_pattern", _as_bool(k, v)),
    "share_weights": lambda o, k, v: setattr(o, "share_weights", _as_bool(k, v)),
    "custom_ops": lambda o, k, v: o.custom_ops.__setitem__(slice(None), custom_op_libraries(v)),
}

# Read by other layers (the scheduler, the compiler); accepted here so they are not rejected as unknown.
_HANDLED_ELSEWHERE = {
    "batch_gears", "adaptive_batching_target_p99_ms", "early_batch_dispatch",  # the scheduler's
    "overload_control", "overload_queue_budget_ms",  # admission control's (scheduling/admission.py)
    "pinned",  # the memory budget's (repository/budget.py)
    "compile_precision_mode", "compile_dynamic_batch_size", "compile_quantize", "compile_calibration_data",
    "compile_input_shape", "compile_out_nodes", "compile_insert_op_conf", "compile_target",
    "compile_keep_fp32",  # the compiler's
    "TF_SIGNATURE_DEF",  # Triton's tensorflow backend: the SavedModel signature the compiler converts
    "openai.embeddings",  # the OpenAI embeddings API's (config/embeddings.py, service/embeddings.py)
}


_DEVICE_PARAMETERS = CUDA_PARAMETERS | CANN_PARAMETERS

# One line for every parameter accepted above (and each prefix): the site's reference/parameters.md is generated from
# it (docs/hooks/reference_parameters.py), and tests/test_docs.py fails on a name without one.
PARAMETER_DESCRIPTIONS = {
    "EXECUTOR_TYPE": "GE dialect: GE, ORT or ONNXRUNTIME; checked, and every value runs the graph on ONNX Runtime.",
    "DEVICE_ID": "GE dialect: the one device the model's instances run on.",
    "device_ids": "Ascend's name: comma-separated devices the model's instances are placed on.",
    "execution_accelerator": "The device family for this model (cpu, cuda, tensorrt, npu); default: the instance "
                             "group's kind, then --backend-config=ge,execution_accelerators.",
    "instance_exec_blocks": "Execution contexts per instance (default 1): instance_group count x this run in parallel.",
    "device_exec_blocks": "Execution contexts per device for the whole instance group, whatever its count says.",
    "static_model": "Ascend's name, accepted (true/false) for its configs; no effect here.",
    "dump_graph": "Write the optimized graph (optimized.onnx; on Ascend, GE's graph dumps) under dump_path.",
    "dump_data": "Write every tensor of the first dump_data_batches batches as .npy files under dump_path.",
    "dump_data_batches": "How many executed batches dump_data writes (default 16).",
    "dump_path": "Where dump_graph, dump_data and profiling write (default <temp dir>/geserve_dump).",
    "profiling": "ONNX Runtime's profiler (pyACL's on .om models), its files under dump_path.",
    "intra_op_thread_count": "Triton onnxruntime's name: threads within an operator (0: the cores shared among "
                             "the instances).",
    "inter_op_thread_count": "Triton onnxruntime's name: threads across operators in parallel execution mode.",
    "execution_mode": "Triton onnxruntime's name: 0 (sequential, default) or 1 (parallel).",
    "enable_mem_arena": "Triton onnxruntime's name: ONNX Runtime's CPU memory arena (default true).",
    "enable_mem_pattern": "Triton onnxruntime's name: ONNX Runtime's memory pattern optimization (default true).",
    "share_weights": "CPU sessions map one file of prepacked weights shared by every worker and instance "
                     "(default true).",
    "custom_ops": "Comma-separated custom-op libraries (.so), relative to the model folder, registered with the "
                  "session.",
    "batch_gears": "Scheduler: the batch sizes a static-shape graph accepts (\"1,2,4,8\"); batches are padded up to "
                   "one.",
    "adaptive_batching_target_p99_ms": "Scheduler: let the dynamic batcher tune its batch limit and queue delay "
                                       "toward this p99 latency.",
    "early_batch_dispatch": "Scheduler: send a batch before the queue delay when no request can join it "
                            "(default true).",
    "overload_control": "Admission control for this model (on/off), overriding --overload-control: the adaptive "
                        "concurrency limit, priorities shed lowest first, the deadline budget.",
    "overload_queue_budget_ms": "Admission control: the longest a request without a deadline may expect to queue; "
                                "one expected to wait longer is refused (503 + Retry-After).",
    "pinned": "Memory budget: true keeps this model loaded, never unloaded to make room for another "
              "(--model-memory-budget).",
    "compile_precision_mode": "Compile on first load: --precision-mode (force_fp32, force_fp16, ...).",
    "compile_dynamic_batch_size": "Compile on first load: --dynamic-batch-size, the batch gears.",
    "compile_quantize": "Compile on first load: --quantize (none, int8).",
    "compile_calibration_data": "Compile on first load: --calibration-data for INT8, relative to the model folder.",
    "compile_input_shape": "Compile on first load: --input-shape (\"name:d0,d1;...\").",
    "compile_out_nodes": "Compile on first load: --out-nodes, the tensors to cut the graph at.",
    "compile_insert_op_conf": "Compile on first load: --insert-op-conf, AIPP-style preprocessing JSON (relative to "
                              "the model folder) folded into the graph.",
    "compile_target": "Compile on first load: --target (cpu, cuda, npu).",
    "compile_keep_fp32": "Compile on first load: --keep-fp32, node names or op types kept in FP32 (or @file).",
    "TF_SIGNATURE_DEF": "Triton tensorflow's name: the SavedModel signature converted on first load.",
    "openai.embeddings": "Serve this model on OpenAI's /v1/embeddings: a JSON object naming its text input, vector "
                         "output and tokenizer.json (guide: OpenAI embeddings).",
    "cudnn_conv_algo_search": "CUDA: cuDNN convolution algorithm search, 0 exhaustive, 1 heuristic, 2 default.",
    "gpu_mem_limit": "CUDA: the provider's memory arena limit, in bytes.",
    "arena_extend_strategy": "CUDA: 0 next power of two, 1 same as requested.",
    "do_copy_in_default_stream": "CUDA: copies in the default stream (true/false).",
    "cudnn_conv_use_max_workspace": "CUDA: let cuDNN use its largest workspace (true/false).",
    "enable_cuda_graph": "CUDA: capture and replay CUDA graphs (true/false).",
    "tunable_op_enable": "CUDA: ONNX Runtime's tunable operators (true/false).",
    "use_tf32": "CUDA: TF32 math on Ampere and later (true/false).",
    "npu_mem_limit": "CANN: the provider's memory limit, in bytes (or session.ge.graphMemoryMaxSize).",
    "enable_cann_graph": "CANN: run the model as one Graph Engine graph (true/false).",
    f"{_GE_PREFIXES[0]}*": "Graph Engine session options, passed to the CANN provider on Ascend targets.",
    f"{_GE_PREFIXES[1]}*": "Graph Engine graph options (graph.ge.inputShape with graph.ge.dynamicDims: batch gears).",
    f"{_ORT_PREFIX}*": "ort.<key>: any ONNX Runtime session config entry <key>.",
}

# A config naming the GE dialects is written for geserve: an unknown parameter in it is a mistake. One naming only
# Triton's ONNX Runtime platform or backend was written for Triton, whose backend ignores what it does not know.
_GE_PLATFORMS = {"graph_executor"}
_GE_BACKENDS = {"ge", "npu_ge"}
_TRITON_PLATFORMS = {"onnxruntime_onnx", "tensorflow_savedmodel", "tensorflow_graphdef"}
_TRITON_BACKENDS = {"onnxruntime", "tensorflow"}


def ignores_unknown_parameters(config: ModelConfig) -> bool:
    """Whether `config` is a Triton ONNX Runtime model (and no GE one): unknown parameters are ignored, not refused."""
    if config.platform in _GE_PLATFORMS or config.backend in _GE_BACKENDS:
        return False
    return config.platform in _TRITON_PLATFORMS or config.backend in _TRITON_BACKENDS


def parse_ge_options(config: ModelConfig) -> GeOptions:
    options = GeOptions()
    strict = not ignores_unknown_parameters(config)
    for key, parameter in sorted(config.parameters.items()):
        value = parameter.string_value
        setter = _SETTERS.get(key)
        if setter is not None:
            setter(options, key, value)
        elif key in _DEVICE_PARAMETERS:
            options.device_parameters[key] = value
        elif key.startswith(_GE_PREFIXES):
            options.ge_options[key] = value
        elif key.startswith(_ORT_PREFIX):
            options.ort_config_entries[key[len(_ORT_PREFIX):]] = value
        elif key in _HANDLED_ELSEWHERE:
            continue
        elif not strict:
            options.ignored.append(key)
        else:
            accepted = ", ".join(sorted([*_SETTERS, *_DEVICE_PARAMETERS]))
            raise InvalidArgumentError(
                f"unknown parameter '{key}' for model '{config.name}'. The GE backend accepts: {accepted}, "
                f"'session.ge.*' / 'graph.ge.*' (Graph Engine options) and 'ort.<key>' "
                f"(ONNX Runtime session config entries)"
            )
    if options.ge_options and options.accelerator not in ("npu", "cann"):
        logger.info(
            "model '%s': Graph Engine options %s apply on Ascend (CANN) targets only; not used on this target",
            config.name,
            sorted(options.ge_options),
        )
    return options
