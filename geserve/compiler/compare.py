"""Accuracy comparison of two arrays (golden vs output), shared by `geserve compile --check` and `geserve compare`.

Metrics, computed in float64:
  cosine    cosine similarity of the flattened arrays (1.0 when both are all zeros)
  max_abs   max |output - golden|
  max_rel   max |output - golden| / max |golden|: the worst error relative to the golden's magnitude
            (per-element relative error explodes where the golden is near zero)
  top1      for classifier-shaped outputs ([N, C] floats with C >= 2): the fraction of rows whose argmax agrees
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from geserve.compiler.errors import CompilerError

EXIT_OK, EXIT_OVER, EXIT_ERROR = 0, 1, 2
# Where a layer's error counts as jumping (`compile --check --layers`): an INT8 step is 1/255 of a tensor's range, and
# ResNet-50's first INT8 layers measure 0.02 (FP16 layers below 0.001); 5% marks a layer that loses clearly more.
LAYERS_THRESHOLD = 0.05


@dataclass(frozen=True, slots=True)
class Comparison:
    cosine: float
    max_abs: float
    max_rel: float
    top1: float | None
    rows: int

    def within(self, threshold: float) -> bool:
        return bool(self.max_rel <= threshold)  # False for NaN

    def describe(self, name: str) -> str:
        text = f"{name}: cosine {self.cosine:.6f}, max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g}"
        if self.top1 is not None:
            agree = round(self.top1 * self.rows)
            text += f", top-1 agreement {agree}/{self.rows} ({self.top1:.1%})"
        return text


def compare(golden: np.ndarray, output: np.ndarray) -> Comparison:
    golden, output = np.asarray(golden), np.asarray(output)
    if golden.shape != output.shape:
        raise CompilerError(f"shapes differ: golden {list(golden.shape)}, output {list(output.shape)}")
    cosine, max_abs, max_rel = _errors(golden.astype(np.float64).ravel(), output.astype(np.float64).ravel())
    return Comparison(cosine, max_abs, max_rel, _top1(golden, output), golden.shape[0] if golden.ndim else 1)


def _errors(g: np.ndarray, o: np.ndarray) -> tuple[float, float, float]:
    """Cosine, max abs and max rel error of two flat float64 arrays; all NaN where any difference is."""
    diff = np.abs(o - g)
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = float(np.abs(g).max()) if g.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    norms = float(np.linalg.norm(g) * np.linalg.norm(o))
    cosine = float(np.dot(g, o) / norms) if norms > 0 else (1.0 if max_abs == 0 else 0.0)
    if np.isnan(diff).any():
        return float("nan"), float("nan"), float("nan")
    return cosine, max_abs, max_rel


def _top1(golden: np.ndarray, output: np.ndarray) -> float | None:
    """Argmax agreement of classifier-shaped outputs; None for any other shape."""
    if golden.ndim == 2 and golden.shape[1] >= 2 and np.issubdtype(golden.dtype, np.floating):
        return float((golden.argmax(1) == output.argmax(1)).mean())
    return None


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """A `.npy` (one array, named after the file) or a `.npz` (its arrays by name)."""
    try:
        if path.suffix == ".npz":
            with np.load(path) as archive:
                return {name: archive[name] for name in archive.files}
        return {path.stem: np.load(path)}
    except (OSError, ValueError) as exc:
        raise CompilerError(f"cannot read {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """`geserve compare golden output --threshold T` (Ascend's npu_compare): exit 1 when max rel error > T."""
    try:
        golden, output = load_arrays(args.golden), load_arrays(args.output)
        if len(golden) == 1 and len(output) == 1:
            pairs = [(args.output.name, next(iter(golden.values())), next(iter(output.values())))]
        else:
            common = sorted(golden.keys() & output.keys())
            if not common:
                raise CompilerError(f"no array names in common: {sorted(golden)} vs {sorted(output)}")
            pairs = [(name, golden[name], output[name]) for name in common]
        results = [(name, compare(g, o)) for name, g, o in pairs]
    except CompilerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    failed = False
    for name, result in results:
        verdict = "ok" if result.within(args.threshold) else f"OVER threshold {args.threshold:g}"
        failed |= not result.within(args.threshold)
        print(f"{result.describe(name)}: {verdict}")
    return EXIT_OVER if failed else EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("golden", type=Path,
                        help="reference array (.npy, or .npz of named arrays), or a dump folder (dump_data, "
                             "compile --check --layers --dump-dir)")
    parser.add_argument("output", type=Path,
                        help="array to check (.npy, or .npz with the same names), or a dump folder to compare with "
                             "GOLDEN layer by layer: the first layer above the threshold is marked")
    parser.add_argument("--threshold", type=float, default=1e-3,
                        help="largest accepted max relative error (max |output - golden| / max |golden|); "
                             "exit 1 above it (for dump folders: when a final output of the golden graph is), "
                             "2 on unreadable or mismatched inputs")
    parser.add_argument("--layers-csv", type=Path, metavar="PATH", help="dump folders: write the table as CSV")
