"""The compiler on the real example models: EfficientNet-Lite0 FP16/INT8 keep FP32's top-1 on the bundled photos,
MiniLM compiles with a dynamic sequence and FP16 keeps its embeddings. Each test compiles a real model (slow_*)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from geserve.cli import main as cli_main
from geserve.compiler import read_package
from geserve.compiler.compare import compare
from tests.support import models
from tests.test_compiler import _session

PHOTOS = ("chelsea", "coffee", "astronaut")
CALIBRATION_PHOTOS = ("rocket", "camera", "immunohistochemistry", "colorwheel")  # not the photos checked


def _photos(names: tuple[str, ...]) -> np.ndarray:
    skimage_data = pytest.importorskip("skimage.data")
    sys.path.insert(0, str(models.EXAMPLES))
    from build_efficientnet import preprocess

    return np.stack([preprocess(getattr(skimage_data, name)()) for name in names])


@pytest.mark.parametrize("variant", ["fp16", "int8"])
def test_slow_efficientnet_keeps_fp32_top1_on_photos(efficientnet: Path, tmp_path: Path, variant: str) -> None:
    from build_efficientnet import imagenet_labels

    images = _photos(PHOTOS)
    out = tmp_path / f"effnet_{variant}.gem"
    args = ["compile", "--quiet", "--model", str(efficientnet), "--output", str(out),
            "--input-shape", "input:-1,3,224,224"]
    if variant == "fp16":
        args += ["--precision-mode", "allow_fp32_to_fp16"]
    else:
        calibration = tmp_path / "calib"
        calibration.mkdir()
        np.save(calibration / "photos.npy", _photos(CALIBRATION_PHOTOS))
        args += ["--quantize", "int8", "--calibration-data", str(calibration)]
    assert cli_main(args) == 0
    expected = _session(efficientnet).run(None, {"input": images})[0]
    got = _session(read_package(out)[1]).run(None, {"input": images})[0]
    labels = imagenet_labels()
    print(f"{variant}: fp32 {[labels[i] for i in expected.argmax(1)]}, {variant} {[labels[i] for i in got.argmax(1)]}")
    result = compare(expected, got)
    print(result.describe(f"{variant} vs fp32 logits"))
    assert "cat" in labels[expected[0].argmax()] or "tabby" in labels[expected[0].argmax()]  # chelsea is a cat
    assert result.top1 == 1.0


def test_slow_minilm_dynamic_sequence_fp16_keeps_embeddings(minilm: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(models.EXAMPLES))
    from build_minilm import SENTENCES, tokenize

    out = tmp_path / "minilm16.gem"
    assert cli_main(["compile", "--quiet", "--model", str(minilm), "--output", str(out),
                     "--input-shape", "input_ids:-1,-1;attention_mask:-1,-1", "--dynamic-batch-size", "1,2,4,8",
                     "--precision-mode", "allow_fp32_to_fp16"]) == 0
    manifest, onnx_bytes = read_package(out)
    assert manifest.inputs["input_ids"]["shape"] == [-1, -1] and manifest.batch_gears == [1, 2, 4, 8]
    fp32, fp16 = _session(minilm), _session(onnx_bytes)
    lengths = set()
    for texts in (SENTENCES, SENTENCES[:1], ["a much longer sentence " * 12]):  # three sequence lengths
        ids, mask = tokenize(texts)
        lengths.add(ids.shape[1])
        feed = {"input_ids": ids, "attention_mask": mask}
        expected, got = fp32.run(None, feed)[0], fp16.run(None, feed)[0]
        for row in range(len(texts)):
            assert compare(expected[row], got[row]).cosine > 0.99
        print(compare(expected, got).describe(f"minilm fp16 vs fp32, sequence {ids.shape[1]}"))
    assert len(lengths) == 3
