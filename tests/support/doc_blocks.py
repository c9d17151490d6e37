"""Docs that run: the fenced code blocks a Markdown page marks as tested, extracted and run against a live server.

A block is tested when the line right before its opening fence is `<!-- tested -->` (invisible on the site). Its
language must be bash / sh (run with `bash -euo pipefail` in the repository root) or python (fed to the suite's
interpreter on stdin, as `python - <<'PY'` would). Before running, `localhost:8000` / `:8001` / `:8002` (or
127.0.0.1) become the live server's HTTP, gRPC and metrics ports and `.venv/bin/python` the suite's interpreter. In
bash blocks `curl` fails on an HTTP error status (--fail-with-body); `command curl` is the plain one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MARKER = "<!-- tested -->"
LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
_HOST_PORT = re.compile(r"\b(localhost|127\.0\.0\.1):(8000|8001|8002)\b")
_VENV_PYTHON = re.compile(r"(?<![\w/.-])(?:\./)?\.venv/bin/python(?![\w.])")
# A block's `curl localhost:8000/...` answered 404 or 500 must fail it, though the page need not say -f.
_BASH_PRELUDE = 'curl() { command curl --fail-with-body "$@"; }\n'


class DocBlockError(ValueError):
    """The page breaks the convention: a marker without a fence, a tested block of an unknown language, ..."""


@dataclass(frozen=True)
class Block:
    language: str  # "bash" or "python"
    code: str
    line: int  # 1-based line of the opening fence


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int


def extract(text: str) -> list[Block]:
    """The tested blocks of a Markdown page, in page order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        marked = lines[index].strip() == MARKER
        if marked and (index + 1 >= len(lines) or not _FENCE.match(lines[index + 1])):
            raise DocBlockError(f"line {index + 1}: {MARKER} must be followed at once by a fenced code block")
        if opening is None:
            index += 1
            continue
        end = _closing(lines, index, opening)
        if index > 0 and lines[index - 1].strip() == MARKER:
            blocks.append(_block(lines, index, end, opening))
        index = end + 1
    return blocks


def _closing(lines: list[str], start: int, opening: re.Match[str]) -> int:
    """The line of the fence that closes the block opened at `start`: the same character, at least as long."""
    fence = opening["fence"]
    for index in range(start + 1, len(lines)):
        stripped = lines[index].strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            return index
    raise DocBlockError(f"line {start + 1}: the code block opened here is never closed")


def _block(lines: list[str], start: int, end: int, opening: re.Match[str]) -> Block:
    words = opening["info"].strip("{} ").split()
    language = words[0].lstrip(".") if words else ""
    if language not in LANGUAGES:
        raise DocBlockError(
            f"line {start + 1}: a tested block must be one of {', '.join(sorted(LANGUAGES))}, not '{language}'"
        )
    indent = len(opening["indent"])
    body = [line[indent:] if line[:indent].isspace() else line.lstrip() for line in lines[start + 1:end]]
    return Block(LANGUAGES[language], "\n".join(body) + "\n", start + 1)


def localize(code: str, ports: Ports, python: str = sys.executable) -> str:
    """The block as it runs here: the live server's ports, this interpreter."""
    by_port = {"8000": ports.http, "8001": ports.grpc, "8002": ports.metrics}
    code = _HOST_PORT.sub(lambda m: f"{m[1]}:{by_port[m[2]]}", code)
    return _VENV_PYTHON.sub(lambda _: python, code)


def run(block: Block, ports: Ports, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run one block (localized) in `cwd`; its interpreter's folder first on PATH, so `geserve` is this one."""
    code = localize(block.code, ports)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if block.language == "python":
        command, stdin = [sys.executable, "-"], code
    else:
        command, stdin = ["bash", "-euo", "pipefail", "-c", _BASH_PRELUDE + code], ""  # nothing waits on a terminal
    return subprocess.run(command, input=stdin, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def failure_report(page: str, block: Block, ports: Ports, result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{page}:{block.line}: the {block.language} block exited {result.returncode}\n"
        f"--- block, as run ---\n{localize(block.code, ports)}"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
