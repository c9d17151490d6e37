"""Builds the throughput-only examples: `resnet50` (ResNet-50 v1.5) and `mlp` (256-1024-1024-10), random weights.

Seeded, so every build gives the same files; the answers mean nothing, only the cost of computing them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _build_common import export_onnx, is_built, run_onnx, source_digest, write_model

SEED = 0
RESNET_CONFIG = """\
name: "resnet50"
platform: "graph_executor"
max_batch_size: 32
input [
  { name: "input", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] }
]
output [
  { name: "logits", data_type: TYPE_FP32, dims: [ 1000 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "EXECUTOR_TYPE", value: { string_value: "GE" } }
"""
MLP_CONFIG = """\
name: "mlp"
platform: "graph_executor"
max_batch_size: 256
input [
  { name: "input", data_type: TYPE_FP32, dims: [ 256 ] }
]
output [
  { name: "logits", data_type: TYPE_FP32, dims: [ 10 ] }
]
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "EXECUTOR_TYPE", value: { string_value: "GE" } }
"""


def _resnet50() -> Any:
    """torchvision's layout: Bottleneck blocks [3, 4, 6, 3], stride on the 3x3 conv (v1.5)."""
    from torch import nn

    def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)]

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                *conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                *conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
                *conv_bn(width, cout, 1),
            )  # fmt: skip
            self.shortcut = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + (x if self.shortcut is None else self.shortcut(x)))

    layers: list[nn.Module] = [*conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for index in range(blocks):
            layers.append(Bottleneck(cin, width, stride if index == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    model = nn.Sequential(*layers)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return model


def _export_checked(model: Any, example: Any, onnx_path: Path, tolerance: float) -> Any:
    """Export with a dynamic batch axis (input -> logits) and check ONNX Runtime agrees with torch."""
    import numpy as np
    import torch

    export_onnx(model, (example,), onnx_path, ["input"], ["logits"], {"input": {0: "batch"}, "logits": {0: "batch"}})
    with torch.no_grad():
        expected = model(example).numpy()
    (logits,) = run_onnx(onnx_path, {"input": example.numpy()})
    difference = np.abs(logits - expected).max()
    assert np.allclose(logits, expected, rtol=tolerance, atol=tolerance), f"ONNX differs by {difference}"
    return logits


def build(repository: Path, data_dir: Path) -> Path:
    model_dir = repository / "resnet50"
    digest = source_digest(__file__)
    if is_built(model_dir, digest):
        return model_dir

    import torch

    torch.manual_seed(SEED)
    model = _resnet50()
    # Calibrate the BatchNorm statistics on random images so activations stay O(1) (no overflow, no denormals).
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(8, 3, 224, 224))
    model.eval()

    onnx_path = model_dir / "1" / "model.onnx"
    logits = _export_checked(model, torch.randn(2, 3, 224, 224), onnx_path, tolerance=1e-3)
    write_model(model_dir, RESNET_CONFIG, digest)
    print(f"resnet50: exported {onnx_path.stat().st_size / 1e6:.1f} MB; logits std {logits.std():.3f}")
    return model_dir


def build_mlp(repository: Path, data_dir: Path) -> Path:
    model_dir = repository / "mlp"
    digest = source_digest(__file__)
    if is_built(model_dir, digest):
        return model_dir

    import torch
    from torch import nn

    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    onnx_path = model_dir / "1" / "model.onnx"
    _export_checked(model, torch.randn(4, 256), onnx_path, tolerance=1e-5)
    write_model(model_dir, MLP_CONFIG, digest)
    print(f"mlp: exported {onnx_path.stat().st_size / 1e6:.1f} MB")
    return model_dir
