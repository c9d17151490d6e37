"""CANN execution provider (onnxruntime-cann, Ascend NPUs) options from the GE dialects' keys, and batch gears from
Graph Engine's dynamic-dims options.

GE key                                   CANN provider option / geserve
session.ge.exec.precision_mode_v2        precision_mode (v2 names mapped onto the v1 names the provider takes)
session.ge.exec.precision_mode           precision_mode (v1 names, as they are)
session.ge.graphMemoryMaxSize            npu_mem_limit (bytes)
npu_mem_limit                            npu_mem_limit
enable_cann_graph                        enable_cann_graph
session.ge.op_select_implmode            op_select_impl_mode
session.ge.optypelist_for_implmode       optypelist_for_implmode
dump_graph                               dump_graphs and dump_om_model
graph.ge.inputShape + graph.ge.dynamicDims   the batch gears the dynamic batcher pads to
device_ids / DEVICE_ID                   device_id (the placement)
dump_data, profiling                     not offered by the provider: the .om engine (pyACL) takes them
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from geserve.errors import InvalidArgumentError

# precision_mode_v2 (CANN 8) -> the precision_mode (v1) value of the same behaviour, which the provider takes.
_PRECISION_V2 = {
    "fp16": "force_fp16",
    "origin": "must_keep_origin_dtype",
    "cube_fp16in_fp32out": "force_fp32",
    "mixed_float16": "allow_mix_precision_fp16",
    "mixed_bfloat16": "allow_mix_precision_bf16",
    "mixed_hif8": "allow_mix_precision",
}
_PRECISION_V1 = {"force_fp32", "force_fp16", "allow_fp32_to_fp16", "must_keep_origin_dtype", "allow_mix_precision",
                 "allow_mix_precision_fp16", "allow_mix_precision_bf16", "allow_fp32_to_bf16"}
_IMPL_MODES = {"high_precision", "high_performance", "high_precision_for_all", "high_performance_for_all"}
CANN_PARAMETERS = frozenset({"npu_mem_limit", "enable_cann_graph"})


def cann_options(
    ge_options: Mapping[str, str], parameters: Mapping[str, str], dump_graph: bool = False
) -> dict[str, str]:
    """CANNExecutionProvider options (device_id excepted) from `session.ge.*` options and model parameters."""
    options: dict[str, str] = {}
    for read in (_precision_option, _memory_limit_option, _cann_graph_option, _impl_mode_options):
        options.update(read(ge_options, parameters))
    if dump_graph:
        options.update(dump_graphs="1", dump_om_model="1")
    return options


def _one_of(key: str, value: str, allowed: Collection[str]) -> str:
    if value not in allowed:
        raise InvalidArgumentError(f"'{key}' is '{value}'; expected one of " + ", ".join(sorted(allowed)))
    return value


def _precision_option(ge_options: Mapping[str, str], parameters: Mapping[str, str]) -> dict[str, str]:
    v2 = ge_options.get("session.ge.exec.precision_mode_v2", "").strip()
    v1 = ge_options.get("session.ge.exec.precision_mode", "").strip()
    if v2 and v1:
        raise InvalidArgumentError("set one of 'session.ge.exec.precision_mode_v2' and "
                                   "'session.ge.exec.precision_mode', not both (Graph Engine refuses both)")
    if v2:
        return {"precision_mode": _PRECISION_V2[_one_of("session.ge.exec.precision_mode_v2", v2, _PRECISION_V2)]}
    if v1:
        return {"precision_mode": _one_of("session.ge.exec.precision_mode", v1, _PRECISION_V1)}
    return {}


def _memory_limit_option(ge_options: Mapping[str, str], parameters: Mapping[str, str]) -> dict[str, str]:
    limit = parameters.get("npu_mem_limit", ge_options.get("session.ge.graphMemoryMaxSize", "")).strip()
    if not limit:
        return {}
    if not limit.isdigit():
        raise InvalidArgumentError(f"the NPU memory limit expects a byte count, got '{limit}'")
    return {"npu_mem_limit": limit}


def _cann_graph_option(ge_options: Mapping[str, str], parameters: Mapping[str, str]) -> dict[str, str]:
    if "enable_cann_graph" not in parameters:
        return {}
    value = parameters["enable_cann_graph"].strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise InvalidArgumentError(f"parameter 'enable_cann_graph' expects true/false or 1/0, got '{value}'")
    return {"enable_cann_graph": "1" if value in ("1", "true") else "0"}


def _impl_mode_options(ge_options: Mapping[str, str], parameters: Mapping[str, str]) -> dict[str, str]:
    options: dict[str, str] = {}
    mode = ge_options.get("session.ge.op_select_implmode", "").strip()
    if mode:
        options["op_select_impl_mode"] = _one_of("session.ge.op_select_implmode", mode, _IMPL_MODES)
    op_types = ge_options.get("session.ge.optypelist_for_implmode", "").strip()
    if op_types:
        options["optypelist_for_implmode"] = op_types
    return options


def gears_from_ge(ge_options: Mapping[str, str]) -> list[int]:
    """Batch gears from `graph.ge.inputShape` ("x:-1,3,224,224;y:-1,8") and `graph.ge.dynamicDims` ("1,1;4,4;8,8":
    one value per -1, in input order): the gears when every -1 is a leading (batch) dimension and each gear gives
    all of them one value; [] when the options are absent."""
    shape_text = ge_options.get("graph.ge.inputShape", "").strip()
    dims_text = ge_options.get("graph.ge.dynamicDims", "").strip()
    if not dims_text:
        return []
    if not shape_text:
        raise InvalidArgumentError("'graph.ge.dynamicDims' needs 'graph.ge.inputShape' to say which dims are dynamic")
    dynamic = _dynamic_dims(shape_text)
    gears = [_batch_gear(gear, dynamic) for gear in filter(None, (g.strip() for g in dims_text.split(";")))]
    return sorted(set(gears))


def _dynamic_dims(shape_text: str) -> list[bool]:
    """Per -1 of `graph.ge.inputShape`, in order: whether it is a batch (leading) dimension."""
    dynamic: list[bool] = []
    for part in filter(None, (p.strip() for p in shape_text.split(";"))):
        _, _, dims = part.rpartition(":")
        try:
            values = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise InvalidArgumentError(f"'graph.ge.inputShape' entry '{part}' is not name:d0,d1,...") from None
        dynamic += [index == 0 for index, d in enumerate(values) if d == -1]
    return dynamic


def _batch_gear(gear: str, dynamic: list[bool]) -> int:
    """The batch size one `graph.ge.dynamicDims` gear gives every dynamic dim."""
    try:
        values = [int(v) for v in gear.split(",")]
    except ValueError:
        raise InvalidArgumentError(f"'graph.ge.dynamicDims' gear '{gear}' is not a list of integers") from None
    if len(values) != len(dynamic):
        raise InvalidArgumentError(
            f"'graph.ge.dynamicDims' gear '{gear}' has {len(values)} value(s) for {len(dynamic)} dynamic dim(s)"
        )
    if not all(dynamic) or len(set(values)) != 1 or values[0] < 1:
        raise InvalidArgumentError(
            "'graph.ge.dynamicDims' serves as batch gears when every dynamic dim is the batch (first) dim and "
            f"each gear gives them one positive value; gear '{gear}' does not"
        )
    return values[0]
