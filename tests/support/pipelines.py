"""Inputs for the example pipelines (encoded photos, a rendered text page) and their Triton-servable copy.

The real Triton has no GE backend: `triton_repository` copies an ensemble and its Python models as they
are and turns its GE models into Python-backend ONNX Runtime models (reference.build_python_backend_repository).
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from tests.support.reference import build_python_backend_repository

OCR_LINES = ("Invoice 2024-117", "Total due: 58.40 EUR", "Thank you for shopping")


def load_config(model_dir: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def photo_bytes(name: str, image_format: str = "JPEG") -> bytes:
    """A scikit-image sample photo (`chelsea`, `coffee`, ...) encoded as a file's bytes."""
    import skimage.data
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(getattr(skimage.data, name)()).save(buffer, image_format)
    return buffer.getvalue()


def rendered_page(lines: Sequence[str] = OCR_LINES, size: int = 36) -> bytes:
    """PNG bytes of black lines of text on white, in Pillow's built-in scalable font."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=size)
    width = max(int(font.getlength(line)) for line in lines) + 80
    page = Image.new("RGB", (width, 40 + 2 * size * len(lines)), "white")
    draw = ImageDraw.Draw(page)
    for row, line in enumerate(lines):
        draw.text((40, 20 + 2 * size * row), line, fill="black", font=font)
    buffer = io.BytesIO()
    page.save(buffer, "PNG")
    return buffer.getvalue()


def triton_repository(source: Path, dest: Path, ensembles: Sequence[str]) -> Path:
    """``ensembles`` from ``source`` with every model they use, servable by the real Triton, in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    converted: list[str] = []
    for ensemble in ensembles:
        steps = [step.model_name for step in load_config(source / ensemble).ensemble_scheduling.step]
        for name in (ensemble, *steps):
            config = load_config(source / name)
            if config.platform == "ensemble" or config.backend == "python":
                if not (dest / name).exists():
                    shutil.copytree(source / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".stamp"))
            elif name not in converted:
                converted.append(name)
    if converted:
        build_python_backend_repository(source, dest, converted)
    return dest
