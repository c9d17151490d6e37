"""The sweep's progress on stderr: a bar redrawn in place with the point being measured and the time left on a
terminal, one plain line per point elsewhere (logs, CI)."""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

BAR_WIDTH = 24


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds} s"


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total, self.done = max(1, total), 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._drawn = False

    def left_s(self) -> float | None:
        """Time left at the pace so far (points skipped by early stopping count as done)."""
        if not self.done:
            return None
        return (time.monotonic() - self.started) / self.done * (self.total - self.done)

    def start(self, label: str) -> None:
        """`label` is about to be measured."""
        left = self.left_s()
        eta = "estimating" if left is None else f"~{duration(left)} left"
        if not self.enabled:
            return
        if self.tty:
            filled = BAR_WIDTH * self.done // self.total
            line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} {eta} | {label}"
            width = shutil.get_terminal_size((120, 20)).columns - 1
            self.stream.write("\r" + line[:width].ljust(width))
            self._drawn = True
        else:
            self.stream.write(f"tune: [{self.done + 1}/{self.total}] {label} ({eta})\n")
        self.stream.flush()

    def advance(self, count: int = 1) -> None:
        self.done = min(self.total, self.done + count)

    def note(self, message: str) -> None:
        """A line that stays (a repeat, a failure, an early stop)."""
        if not self.enabled:
            return
        if self.tty and self._drawn:
            self.stream.write("\r" + " " * (shutil.get_terminal_size((120, 20)).columns - 1) + "\r")
            self._drawn = False
        self.stream.write(f"tune: {message}\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False
