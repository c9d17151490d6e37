"""The static checks, run by the test command: ruff (lint) on the package and the tests, mypy (types) on the package.

Both read their settings from pyproject.toml ([tool.ruff], [tool.mypy]); both come with the `test` extra. They run
with this interpreter, so the checks are those of the environment the suite runs in. mypy keeps its cache in
.mypy_cache, which makes a second run take a second or two.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


def _check(*arguments: str) -> None:
    """Run `python -m <arguments>` in the repository root; fail with its whole report unless it exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", *arguments],
        cwd=REPOSITORY_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(
            f"`{' '.join(arguments)}` exited {result.returncode}:\n{result.stdout}{result.stderr}", pytrace=False
        )


def test_ruff_finds_nothing() -> None:
    _check("ruff", "check", "--no-fix", "geserve", "tests")


def test_mypy_finds_nothing() -> None:
    _check("mypy", "--config-file", "pyproject.toml")  # files = ["geserve"] and the settings are there
