"""Builds the example model repository (examples/model_repository) from packages installed from PyPI.

`python examples/build.py` builds every model (each is skipped while its stamp is current); `--only NAME` one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_digits import build as build_digits
from build_efficientnet import build as build_efficientnet
from build_minilm import build as build_minilm
from build_pipelines import build_image_pipeline, build_ocr_pipeline, build_text_embedding
from build_resnet50 import build as build_resnet50
from build_resnet50 import build_mlp

HERE = Path(__file__).resolve().parent
REPOSITORY = HERE / "model_repository"
DATA = HERE / ".build"
BUILDERS: dict[str, Callable[[Path, Path], Path]] = {
    "digits": build_digits,
    "efficientnet_lite0": build_efficientnet,
    "minilm": build_minilm,
    "resnet50": build_resnet50,
    "mlp": build_mlp,
    # ensembles of Python and GE models (examples/pipelines/); each also builds the GE models it uses
    "image_pipeline": build_image_pipeline,
    "text_embedding": build_text_embedding,
    "ocr_pipeline": build_ocr_pipeline,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(BUILDERS), action="append", help="build just this model (repeatable)")
    args = parser.parse_args(argv)
    REPOSITORY.mkdir(exist_ok=True)
    for name in args.only or BUILDERS:
        started = time.perf_counter()
        model_dir = BUILDERS[name](REPOSITORY, DATA)
        print(f"{name}: {model_dir} ({time.perf_counter() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
