"""The markdown table of per-round measurements that several benches print: a row per cell, its median and every
round. Imports nothing heavy, so a bench whose children fork before importing onnxruntime can use it."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence


def median_rows(cell_header: str, value_header: str, cells: Mapping[str, Sequence[float]], digits: int) -> list[str]:
    """The table's lines: `| cell | median | rounds |`, values with `digits` decimals."""
    lines = [f"| {cell_header} | {value_header} | rounds |", "|---|---:|---|"]
    for label, values in cells.items():
        rounds = ", ".join(f"{value:.{digits}f}" for value in values)
        lines.append(f"| {label} | {statistics.median(values):.{digits}f} | {rounds} |")
    return lines
