"""pyproject.toml and the lock files in locks/ agree: every environment lock pins, with hashes, each requirement its
environment needs at a version that requirement admits. When this fails, run scripts/update_locks.sh (--keep moves
only what must move). Reads files only: no network, no resolution.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 has no tomllib; the locks are checked on 3.11+
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = canonicalize_name(PYPROJECT["project"]["name"])

# Environment locks, named <environment>-py<X.Y>.txt, and the extras of geserve each installs (scripts/bootstrap.sh:
# GESERVE_SERVE_ONLY=1 gives serve, GESERVE_CUDA=1 adds -cuda).
ENVIRONMENTS: dict[str, tuple[str, ...]] = {
    "serve": (),
    "serve-cuda": ("cuda",),
    "test": ("test",),
    "test-cuda": ("test", "cuda"),
}
# Locks of a locks/*.in file: lock-name pattern -> (input, whether it was compiled with --no-deps: then the lock holds
# exactly the input's packages).
INPUT_LOCKS: dict[str, tuple[str, bool]] = {
    r"reference-py\d+\.\d+\.txt": ("reference.in", False),
    r"reference-pytriton\.txt": ("reference-pytriton.in", True),
    r"infinity-py\d+\.\d+\.txt": ("infinity.in", False),
    r"models\.txt": ("models.in", True),
    r"pip\.txt": ("pip.in", False),
    r"tools\.txt": ("tools.in", False),
}
ENVIRONMENT_LOCK = re.compile(r"(?P<environment>[a-z-]+?)-py(?P<python>\d+\.\d+)\.txt")
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)\s*(?:;(?P<marker>[^\\]*))?\\?\s*$")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


@dataclass
class Pin:
    """One package of a lock file."""

    version: Version
    hashes: int


def read_lock(path: Path) -> dict[NormalizedName, Pin]:
    """The pins of a pip requirements file written by `uv pip compile --generate-hashes`; fails on any other line."""
    pins: dict[NormalizedName, Pin] = {}
    current: Pin | None = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = PIN.match(line)
        if match:
            current = Pin(Version(match["version"]), 0)
            pins[canonicalize_name(match["name"])] = current
        elif line[0].isspace() and current is not None and HASH.search(stripped):
            current.hashes += 1
        else:
            raise AssertionError(f"{path.name}:{number}: not an exact pin or its hash: {line!r}")
    return pins


def marker_environment(python: str | None) -> dict[str, str]:
    """This interpreter's marker environment, moved to another Python version for a lock made for that version."""
    environment = dict(default_environment())
    if python is not None and python != environment["python_version"]:
        environment["python_version"] = python
        environment["python_full_version"] = f"{python}.0"
    return environment


def project_requirements(extras: Iterable[str], environment: dict[str, str]) -> list[Requirement]:
    """geserve's dependencies, those of `extras` (self-references like geserve[examples] expanded recursively) and its
    build requirements, keeping those whose markers hold in `environment`."""
    optional: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
    found: list[Requirement] = []
    pending = [*PYPROJECT["project"]["dependencies"], *PYPROJECT["build-system"]["requires"]]
    pending += [text for extra in extras for text in optional[extra]]
    seen_extras = set(extras)
    while pending:
        requirement = Requirement(pending.pop(0))
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        if canonicalize_name(requirement.name) == PROJECT:
            for extra in sorted(requirement.extras - seen_extras):
                seen_extras.add(extra)
                pending += optional[extra]
            continue
        found.append(requirement)
    return found


def input_requirements(name: str) -> list[Requirement]:
    """The requirements of locks/<name> (a requirements file of plain requirement lines and comments)."""
    lines = (line.split("#", 1)[0].strip() for line in (LOCKS / name).read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def disagreements(
    requirements: Iterable[Requirement], pins: dict[NormalizedName, Pin], environment: dict[str, str]
) -> list[str]:
    """Each requirement the pins miss, or pin at a version it excludes."""
    problems = []
    for requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(pin.version, prereleases=True):
            problems.append(f"{requirement} excludes the locked {requirement.name}=={pin.version}")
    return problems


def _locks(pattern: str) -> list[Path]:
    return sorted(path for path in LOCKS.glob("*.txt") if re.fullmatch(pattern, path.name))


ALL_LOCKS = sorted(LOCKS.glob("*.txt"))
ENVIRONMENT_LOCKS = [
    path
    for path in ALL_LOCKS
    if (match := ENVIRONMENT_LOCK.fullmatch(path.name)) is not None and match["environment"] in ENVIRONMENTS
]


def test_every_lock_file_is_known_and_the_test_environment_is_locked() -> None:
    input_locks = {path for pattern in INPUT_LOCKS for path in _locks(pattern)}
    unknown = [path.name for path in ALL_LOCKS if path not in input_locks and path not in ENVIRONMENT_LOCKS]
    assert not unknown, f"lock files no test reads (add them to ENVIRONMENTS or INPUT_LOCKS): {unknown}"
    for pattern, (input_name, _) in INPUT_LOCKS.items():
        assert _locks(pattern), f"no lock of locks/{input_name}: run scripts/update_locks.sh"
    # The Python of this machine kind (CI, the developers): scripts/test.sh installs from this lock.
    assert (LOCKS / "test-py3.11.txt").is_file()


@pytest.mark.parametrize("path", ALL_LOCKS, ids=lambda path: path.name)
def test_every_pin_is_exact_and_hashed(path: Path) -> None:
    pins = read_lock(path)
    assert pins, f"{path.name} pins nothing"
    assert PROJECT not in pins, f"{path.name} pins geserve itself (bootstrap installs it from the checkout)"
    unhashed = sorted(name for name, pin in pins.items() if pin.hashes == 0)
    assert not unhashed, f"{path.name}: pins without a hash: {unhashed}"


@pytest.mark.parametrize("path", ENVIRONMENT_LOCKS, ids=lambda path: path.name)
def test_environment_lock_admits_pyproject(path: Path) -> None:
    match = ENVIRONMENT_LOCK.fullmatch(path.name)
    assert match is not None
    environment = marker_environment(match["python"])
    requirements = project_requirements(ENVIRONMENTS[match["environment"]], environment)
    problems = disagreements(requirements, read_lock(path), environment)
    assert not problems, f"{path.name} disagrees with pyproject.toml (run scripts/update_locks.sh):\n" + "\n".join(
        problems
    )


@pytest.mark.parametrize(
    ("path", "input_name", "no_deps"),
    [(path, input_name, no_deps) for pattern, (input_name, no_deps) in INPUT_LOCKS.items() for path in _locks(pattern)],
    ids=lambda value: value.name if isinstance(value, Path) else str(value),
)
def test_input_lock_admits_its_input(path: Path, input_name: str, no_deps: bool) -> None:
    match = re.search(r"-py(\d+\.\d+)\.txt$", path.name)
    environment = marker_environment(match[1] if match else None)
    requirements = input_requirements(input_name)
    pins = read_lock(path)
    problems = disagreements(requirements, pins, environment)
    if no_deps:  # installed with --no-deps: the lock is the input, nothing more
        extra = set(pins) - {canonicalize_name(requirement.name) for requirement in requirements}
        problems += [f"{name} is not in locks/{input_name}" for name in sorted(extra)]
    assert not problems, f"{path.name} disagrees with locks/{input_name} (run scripts/update_locks.sh):\n" + "\n".join(
        problems
    )


def test_the_check_catches_a_disagreement() -> None:
    environment = marker_environment(None)
    pins = {canonicalize_name("numpy"): Pin(Version("1.23.5"), 1)}
    problems = disagreements([Requirement("numpy>=1.24"), Requirement("orjson>=3.9")], pins, environment)
    assert problems == ["numpy>=1.24 excludes the locked numpy==1.23.5", "orjson>=3.9 is not in the lock"]
    # Markers are evaluated: uvloop is not required on Windows.
    windows = {**environment, "sys_platform": "win32"}
    assert not disagreements([Requirement("uvloop>=0.19; sys_platform != 'win32'")], {}, windows)
    # Extras expand through geserve's self-references (test -> examples -> torch).
    names = {requirement.name for requirement in project_requirements(["test"], environment)}
    assert {"torch", "matplotlib", "tf2onnx", "setuptools", "numpy"} <= names
