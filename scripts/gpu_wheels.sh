#!/usr/bin/env bash
# Prepares here (a machine that reaches PyPI) what scripts/gpu_check.sh needs on the lent GPU machine, which reaches
# nothing and already has Python 3.12 with CUDA 13, cuDNN 9, torch, torchvision, onnx, grpcio, protobuf, numpy,
# nvidia-ml-py and cuda-bindings, but neither onnxruntime-gpu nor geserve's own dependencies. One bundle (.gpu/bundle:
# the onnxruntime-gpu wheel for CUDA 13, about 256 MB; geserve's missing dependencies as wheels; the
# EfficientNet-Lite0 ONNX file built here) cut into pieces of 58 MiB in .gpu/p1 ... .gpu/pN, because one device call
# carries at most 64 MiB together with the working tree: each piece travels in a call of its own (gpu_check.sh's
# header says how). All of .gpu/ is ignored by git (.git/info/exclude).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ORT_GPU="${ORT_GPU:-onnxruntime-gpu==1.31.1}"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
download() {
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$@"
}
rm -rf .gpu
mkdir -p .gpu/bundle/wheels
download .gpu/bundle/wheels tritonclient==2.41.0 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 PyJWT==2.15.1 \
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 h11==0.16.0 python-rapidjson==1.25 "$ORT_GPU"
.venv/bin/python examples/build.py --only efficientnet_lite0 >/dev/null
cp examples/model_repository/efficientnet_lite0/1/model.onnx .gpu/bundle/efficientnet_lite0.onnx
tar -C .gpu -cf .gpu/bundle.tar bundle
rm -rf .gpu/bundle
(cd .gpu && split -b 58M bundle.tar piece-)
rm .gpu/bundle.tar
index=1
for piece in .gpu/piece-*; do
    mkdir -p ".gpu/p$index"
    mv "$piece" ".gpu/p$index/"
    index=$((index + 1))
done
du -sh .gpu/p*
