"""AIPP-style preprocessing folded into the graph (`--insert-op-conf aipp.json`), so clients send raw pixels.

The graph input (NCHW float) is replaced by a `uint8` NHWC image input of the same name; the inserted ops
compute, in ATC's order, crop -> channel swap -> padding -> (pixel - mean - min) * var_reci -> NCHW float.

JSON schema (every key optional except where noted; per-channel lists are in the model's channel order):

    {
      "input": "input",                    graph input to replace (default: the only image input)
      "input_format": "RGB888_U8",         RGB888_U8 | BGR888_U8 (packed HWC uint8; the format clients send)
      "model_format": "RGB",               RGB | BGR: channel order the model expects (swap when they differ)
      "src_image_size": [H, W],            size of the image clients send (default: the model's H, W
                                           plus padding, or dynamic when cropping)
      "crop": {"top": 0, "left": 0, "height": 224, "width": 224},
      "padding": {"top": 0, "bottom": 0, "left": 0, "right": 0, "value": 0},
      "mean": [123.675, 116.28, 103.53],   mean_chn_i of ATC
      "min": [0, 0, 0],                    min_chn_i of ATC
      "var_reci": [0.0171, 0.0175, 0.0174] var_reci_chn_i of ATC (or "std": [...] for 1/std)
    }
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from geserve.compiler.errors import CompilerError
from geserve.compiler.shapes import dims_of, graph_inputs

_FORMATS = {"RGB888_U8": "RGB", "BGR888_U8": "BGR"}
_KEYS = {"input", "input_format", "model_format", "src_image_size", "crop", "padding", "mean", "min", "var_reci",
         "std"}


def load_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CompilerError(f"--insert-op-conf {path}: {exc}") from None
    if not isinstance(config, dict):
        raise CompilerError(f"--insert-op-conf {path}: expected a JSON object")
    unknown = set(config) - _KEYS
    if unknown:
        raise CompilerError(f"--insert-op-conf {path}: unknown key(s) {sorted(unknown)}; accepted: {sorted(_KEYS)}")
    return config


def _channels(config: dict[str, Any], key: str, channels: int, default: float) -> np.ndarray:
    values = config.get(key)
    if values is None:
        return np.full(channels, default, np.float32)
    if len(values) != channels:
        raise CompilerError(f"--insert-op-conf: '{key}' needs {channels} values, got {len(values)}")
    return np.asarray(values, np.float32)


def insert_preprocessing(model: onnx.ModelProto, config: dict[str, Any]) -> onnx.ModelProto:
    name, value = _image_input(model, config)
    channels, height, width = dims_of(value)[1:]
    source_format = _FORMATS.get(config.get("input_format", "RGB888_U8"))
    if source_format is None:
        raise CompilerError(f"--insert-op-conf: input_format must be one of {sorted(_FORMATS)}")
    crop = config.get("crop")
    pad = {"top": 0, "bottom": 0, "left": 0, "right": 0, "value": 0, **config.get("padding", {})}
    src = config.get("src_image_size")
    if src is None:
        src = _default_source_size(crop, pad, height, width)

    chain = _Chain(name)
    if crop:
        _crop(chain, crop)
    if source_format != config.get("model_format", "RGB") and channels >= 3:
        order = [2, 1, 0, *range(3, channels)]
        chain.step("Gather", [chain.const("swap", np.array(order, np.int64))], "swap", axis=3)
    if any(pad[k] for k in ("top", "bottom", "left", "right")):
        pads = np.array([0, pad["top"], pad["left"], 0, 0, pad["bottom"], pad["right"], 0], np.int64)
        chain.step("Pad", [chain.const("pads", pads), chain.const("pad_value", np.array(pad["value"], np.float32))],
                   "pad")
    _normalize(chain, config, channels)
    chain.step("Transpose", [], "nchw", perm=[0, 3, 1, 2])
    _replace_input(model, value, chain, src, channels)
    return model


def _image_input(model: onnx.ModelProto, config: dict[str, Any]) -> tuple[str, onnx.ValueInfoProto]:
    """The graph input that takes the preprocessing (named, or the only one): FP32 NCHW with 1, 3 or 4 channels."""
    inputs = {value.name: value for value in graph_inputs(model)}
    name = config.get("input") or (next(iter(inputs)) if len(inputs) == 1 else None)
    if name not in inputs:
        raise CompilerError(f"--insert-op-conf: give \"input\", one of {sorted(inputs)}")
    value = inputs[name]
    if value.type.tensor_type.elem_type != TensorProto.FLOAT:
        raise CompilerError(f"--insert-op-conf: input '{name}' must be FP32 NCHW to take preprocessing")
    dims = dims_of(value)
    if len(dims) != 4 or dims[1] not in (1, 3, 4):
        raise CompilerError(f"--insert-op-conf: input '{name}' must be NCHW with 1, 3 or 4 channels, got {dims}")
    return name, value


def _default_source_size(crop: Any, pad: dict[str, Any], height: int, width: int) -> list[int]:
    """The image size clients send when the config names none: dynamic when cropping, else the model's size less
    the padding (dynamic where the model's is)."""
    if crop:
        return [-1, -1]
    return [height - pad["top"] - pad["bottom"] if height > 0 else -1,
            width - pad["left"] - pad["right"] if width > 0 else -1]


class _Chain:
    """The inserted ops, one after another from the new uint8 input: their nodes, their constants, the last output."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.current = f"{name}__aipp_cast"
        self.nodes.append(helper.make_node("Cast", [name], [self.current], to=TensorProto.FLOAT, name="aipp_cast"))

    def const(self, label: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(array, f"aipp_{label}"))
        return f"aipp_{label}"

    def step(self, op: str, extra_inputs: list[str], label: str, **attrs: Any) -> None:
        output = f"{self.name}__aipp_{label}"
        self.nodes.append(helper.make_node(op, [self.current, *extra_inputs], [output], name=f"aipp_{label}", **attrs))
        self.current = output


def _crop(chain: _Chain, crop: dict[str, Any]) -> None:
    top, left = int(crop.get("top", 0)), int(crop.get("left", 0))
    starts = chain.const("crop_starts", np.array([top, left], np.int64))
    ends = chain.const("crop_ends", np.array([top + int(crop["height"]), left + int(crop["width"])], np.int64))
    chain.step("Slice", [starts, ends, chain.const("crop_axes", np.array([1, 2], np.int64))], "crop")


def _normalize(chain: _Chain, config: dict[str, Any], channels: int) -> None:
    """(pixel - mean - min) * var_reci, each op only where it changes something."""
    offset = _channels(config, "mean", channels, 0.0) + _channels(config, "min", channels, 0.0)
    if "std" in config:
        scale = 1.0 / _channels(config, "std", channels, 1.0)
    else:
        scale = _channels(config, "var_reci", channels, 1.0)
    if offset.any():
        chain.step("Sub", [chain.const("offset", offset)], "sub")
    if (scale != 1.0).any():
        chain.step("Mul", [chain.const("scale", scale)], "mul")


def _replace_input(model: onnx.ModelProto, value: onnx.ValueInfoProto, chain: _Chain, src: list[int],
                   channels: int) -> None:
    """The graph reads the chain's output where it read the input, and takes a uint8 NHWC image in its place."""
    name, graph = chain.name, model.graph
    for node in graph.node:
        node.input[:] = [chain.current if i == name else i for i in node.input]
    for output in graph.output:
        if output.name == name:
            raise CompilerError(f"--insert-op-conf: input '{name}' is also a graph output")
    batch = value.type.tensor_type.shape.dim[0]
    spatial = [f"{name}_{axis}" if size == -1 else size for axis, size in zip("hw", src, strict=True)]
    new_input = helper.make_tensor_value_info(name, TensorProto.UINT8, [None, *spatial, channels])
    new_input.type.tensor_type.shape.dim[0].CopyFrom(batch)
    position = list(graph.input).index(value)
    graph.input.remove(value)
    graph.input.insert(position, new_input)
    old_nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(chain.nodes + old_nodes)
    graph.initializer.extend(chain.inits)
