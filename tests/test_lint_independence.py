"""The lint does not depend on what else lies in the checkout: after a wheel build leaves setuptools' `build/` folder
(which git ignores), ruff still finds nothing. It once did: ruff took that folder for the examples' `build` module
and flagged the tests' import blocks; pyproject.toml's [tool.ruff] now names the first-party modules instead.

The build runs in a copy of the checkout (the files git tracks or would track), so neither the checkout nor the
tests running beside this one ever see the folder.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


def _run(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(arguments, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)


def _checkout_files() -> list[str]:
    """The checkout's files as git sees them (tracked, or untracked but not ignored), without deleted ones."""
    if shutil.which("git") is None or not (REPOSITORY_ROOT / ".git").exists():
        pytest.skip("not a git checkout: the files to copy are those git lists")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPOSITORY_ROOT)
    assert listed.returncode == 0, listed.stderr
    return [name for name in listed.stdout.split("\0") if name and (REPOSITORY_ROOT / name).is_file()]


def test_ruff_finds_nothing_after_a_wheel_build(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    for name in _checkout_files():
        target = checkout / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPOSITORY_ROOT / name, target)

    # What `pip install .` does to a checkout, offline: setuptools builds under build/ (kept afterwards).
    wheel = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        checkout,
    )
    assert wheel.returncode == 0, f"pip wheel failed:\n{wheel.stdout}{wheel.stderr}"
    assert (checkout / "build" / "lib" / "geserve").is_dir(), "the wheel build left no build/ folder to test against"

    lint = _run([sys.executable, "-m", "ruff", "check", "--no-fix", "--no-cache", "geserve", "tests"], checkout)
    if lint.returncode != 0:
        pytest.fail(f"ruff, after a wheel build in the checkout:\n{lint.stdout}{lint.stderr}", pytrace=False)
