"""Builds the example model repository (examples/model_repository) from packages installed from PyPI."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_digits import build as build_digits

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE / "model_repository"
DATA = HERE / ".build"


def main() -> int:
    REPOSITORY.mkdir(exist_ok=True)
    build_digits(REPOSITORY, DATA)
    return 0


if __name__ == "__main__":
    sys.exit(main())
