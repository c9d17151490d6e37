"""`mode=triton`: Triton's JSON trace file, which Triton's tools (trace_summary.py) read.

Each trace is written as Triton writes it: its model header (with `parent_id` for an ensemble step), one object per
timestamp, one per tensor at TENSORS level. With `log_frequency` N > 0 every N traces go to `<file>.<index>`;
with 0 all of them go to `<file>` when the server stops (or when `trace_count` runs out), as in Triton.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from geserve.service.tracing.trace import Trace
from geserve.types import Tensor

logger = logging.getLogger(__name__)


def trace_entries(trace: Trace) -> list[dict[str, Any]]:
    """The trace's objects in Triton's order: the frontend's receive times, the header, the core's times and
    tensors, the frontend's send times."""
    header: dict[str, Any] = {"id": trace.id, "model_name": trace.model_name, "model_version": trace.model_version}
    if trace.request_id:
        header["request_id"] = trace.request_id
    if trace.parent is not None:
        header["parent_id"] = trace.parent.id
    received = [m for m in trace.marks if m[0] in ("HTTP_RECV_START", "HTTP_RECV_END")]
    entries = [_timestamp(trace.id, m) for m in received]
    entries.append(header)
    entries += [_timestamp(trace.id, m) for m in trace.marks if m not in received]
    for activity, tensor in trace.tensors:
        entries.insert(_tensor_position(entries, activity), _tensor(trace.id, activity, tensor))
    return entries


def _timestamp(trace_id: int, mark: tuple[str, int]) -> dict[str, Any]:
    return {"id": trace_id, "timestamps": [{"name": mark[0], "ns": mark[1]}]}


def _tensor_position(entries: list[dict[str, Any]], activity: str) -> int:
    """Inputs after QUEUE_START, outputs before REQUEST_END (where Triton records them)."""
    names = [e["timestamps"][0]["name"] if "timestamps" in e else "" for e in entries]
    anchor = "QUEUE_START" if activity == "TENSOR_QUEUE_INPUT" else "REQUEST_END"
    if anchor not in names:
        return len(entries)
    index = names.index(anchor)
    if activity == "TENSOR_BACKEND_OUTPUT":
        return index
    while index + 1 < len(entries) and entries[index + 1].get("activity") == "TENSOR_QUEUE_INPUT":
        index += 1
    return index + 1


def _tensor(trace_id: int, activity: str, tensor: Tensor) -> dict[str, Any]:
    values = np.asarray(tensor.data).ravel().tolist()
    data = ",".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values)
    shape = ",".join(str(d) for d in tensor.shape)
    return {"id": trace_id, "activity": activity,
            "tensor": {"name": tensor.name, "data": data, "shape": shape, "dtype": tensor.datatype}}


class TraceFile:
    """Collects complete traces and writes them out."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._pending: list[dict[str, Any]] = []  # entries not yet in a `<file>.<index>`
        self._pending_traces = 0
        self._all: list[dict[str, Any]] = []  # log_frequency 0: everything, rewritten to `<file>` on each flush
        self._index = 0

    def add(self, trace: Trace, log_frequency: int) -> None:
        entries = trace_entries(trace)
        if log_frequency <= 0:
            self._all += entries
            return
        self._pending += entries
        self._pending_traces += 1
        if self._pending_traces >= log_frequency:
            self._write_indexed()

    def flush(self) -> None:
        if self._pending:
            self._write_indexed()
        if self._all:
            self._write(Path(self._path), self._all)

    def _write_indexed(self) -> None:
        self._write(Path(f"{self._path}.{self._index}"), self._pending)
        self._index += 1
        self._pending, self._pending_traces = [], 0

    @staticmethod
    def _write(path: Path, entries: list[dict[str, Any]]) -> None:
        try:
            path.write_text(json.dumps(entries, separators=(",", ":")))
        except OSError as exc:  # a trace is never worth a request: say so and go on
            logger.error("cannot write the trace file %s: %s", path, exc)
