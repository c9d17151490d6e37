"""Dump folders (the GE backend's `dump_data`, `compile --check --layers --dump-dir`): per batch one `.npy` per tensor
and an `index.json`; `geserve compare` over two of them, layer by layer."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from geserve.compiler import compare
from geserve.compiler.errors import CompilerError
from geserve.compiler.layers import LayerReport, LayerTensor, match

INDEX = "index.json"
BATCH_PREFIX = "batch_"
FORMAT = 1


def batch_name(number: int) -> str:
    return f"{BATCH_PREFIX}{number:06d}"


def write_batch(folder: Path, tensors: list[LayerTensor], values: Mapping[str, np.ndarray]) -> int:
    """Write the numeric tensors of `values` in `tensors`' order as `<order>_<sanitized name>.npy`, then `index.json`
    ({"format": 1, "tensors": [LayerTensor.to_dict() + {"file"}, ...]}): a folder without it is incomplete and is
    not read. A dump root holds `batch_000001/`, `batch_000002/`, ...; returns how many tensors were written."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for number, tensor in enumerate(tensors):
        value = values.get(tensor.name)
        if not isinstance(value, np.ndarray) or value.dtype == object:  # strings would need pickling
            continue
        file = f"{number:04d}_{_sanitized(tensor.name)}.npy"
        np.save(folder / file, value)
        entries.append({"file": file, **tensor.to_dict()})
    (folder / INDEX).write_text(json.dumps({"format": FORMAT, "tensors": entries}, indent=1))
    return len(entries)


def _sanitized(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")[:120] or "tensor"


def read_index(folder: Path) -> list[tuple[LayerTensor, Path]]:
    try:
        data = json.loads((folder / INDEX).read_text())
        return [(LayerTensor.from_dict(entry), folder / entry["file"]) for entry in data["tensors"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CompilerError(f"cannot read the dump index {folder / INDEX}: {exc}") from None


def batch_folders(root: Path) -> dict[str, Path]:
    """A batch folder by itself (keyed ""), or a dump root's complete batch folders by name."""
    if (root / INDEX).is_file():
        return {"": root}
    if not root.is_dir():
        raise CompilerError(f"{root} is not a dump folder")
    return {p.name: p for p in sorted(root.glob(f"{BATCH_PREFIX}*")) if (p / INDEX).is_file()}


def compare_folders(golden: Path, output: Path) -> LayerReport:
    """Every tensor both dumps hold, matched as `layers.match` does, over the batches both hold."""
    batches = _common_batches(golden, output)
    if not batches:
        raise CompilerError(f"no batch folders in common between {golden} and {output}")
    indexes = [(read_index(g), read_index(o)) for g, o in batches]
    report = LayerReport(match([t for t, _ in indexes[0][0]], [t for t, _ in indexes[0][1]]))
    if not report.pairs:
        raise CompilerError(f"the dumps {golden} and {output} hold no tensor names in common")
    wanted = {p.golden.name for p in report.pairs} | {p.output.name for p in report.pairs}
    for golden_index, output_index in indexes:
        report.add_batch(_load(golden_index, wanted), _load(output_index, wanted))
    return report


def _common_batches(golden: Path, output: Path) -> list[tuple[Path, Path]]:
    """Batch folders of the same name; a single batch folder pairs with the other side's first batch."""
    golden_batches, output_batches = batch_folders(golden), batch_folders(output)
    if "" in golden_batches or "" in output_batches:
        if not golden_batches or not output_batches:
            return []
        return [(next(iter(golden_batches.values())), next(iter(output_batches.values())))]
    return [(golden_batches[n], output_batches[n]) for n in sorted(golden_batches.keys() & output_batches.keys())]


def _load(index: list[tuple[LayerTensor, Path]], wanted: set[str]) -> dict[str, np.ndarray]:
    try:
        return {tensor.name: np.load(path) for tensor, path in index if tensor.name in wanted}
    except (OSError, ValueError) as exc:
        raise CompilerError(f"cannot read a dumped tensor: {exc}") from None


def run_compare(args: argparse.Namespace) -> int:
    """`geserve compare`: two dump folders layer by layer, else two array files (compare.run)."""
    if args.golden.is_dir() or args.output.is_dir():
        return run_folders(args)
    return compare.run(args)


def run_folders(args: argparse.Namespace) -> int:
    """`geserve compare GOLDEN_DUMP OUTPUT_DUMP`: the per-layer table, the first layer above the threshold marked;
    exit 1 when a final output (a graph output of the golden) is above it, 2 on unreadable or unrelated dumps."""
    try:
        report = compare_folders(args.golden, args.output)
        if args.layers_csv:
            report.write_csv(args.layers_csv, args.threshold)
    except CompilerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return compare.EXIT_ERROR
    for line in report.lines(args.threshold):
        print(line)
    finals = [row for row in report.rows if row.pair.golden.kind == "output"]
    if not finals:
        print("error: the dumps share no final output", file=sys.stderr)
        return compare.EXIT_ERROR
    return compare.EXIT_OVER if any(not row.result.within(args.threshold) for row in finals) else compare.EXIT_OK
