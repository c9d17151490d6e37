#!/usr/bin/env bash
# Issue 16's GPU check, sized for the lent H200 (about 8 minutes): the gpu-marked tests, then bench/gpu_bench.py
# (ResNet-50 and EfficientNet-Lite0; CUDA EP FP32 and FP16, TensorRT FP16 where TensorRT is installed; geserve vs raw
# ONNX Runtime on the same provider), printing each row as it is measured and writing bench/results/gpu.md (copied
# to $OUT when set).
#
# On a GPU machine that reaches PyPI: `GESERVE_CUDA=1 scripts/bootstrap.sh && scripts/gpu_check.sh`.
#
# The lent machine reaches nothing and one call carries at most 64 MiB, so onnxruntime-gpu (about 256 MB) and
# geserve's missing dependencies travel as a bundle in pieces. Here, first: `bash scripts/gpu_wheels.sh` (fills
# .gpu/p1 ... .gpu/p5). Then the device calls, back to back so that the machine stays warm (30 s) and keeps the
# pieces it was sent in /tmp:
#   run(carry=[".gpu/p1"], command="bash scripts/gpu_check.sh stage", timeout_s=120)     and the same for p2, p3, p4
#   run(carry=[".gpu/p5"], command="bash scripts/gpu_check.sh", timeout_s=560)           stages p5, then checks
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STAGE=/tmp/geserve-gpu
began=$(date +%s)
elapsed() { echo "[gpu_check] $(( $(date +%s) - began )) s: $*"; }

mkdir -p "$STAGE"
for piece in .gpu/p*/piece-*; do
    [ -e "$piece" ] && cp "$piece" "$STAGE/" && elapsed "staged $piece"
done
if [ "${1:-}" = stage ]; then
    ls -la "$STAGE"
    exit 0
fi

# ---- Python with onnxruntime-gpu ----------------------------------------------------------------------------------
has_cuda_ep() { "$1" -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null; }
if [ -x .venv/bin/python ] && has_cuda_ep .venv/bin/python; then
    PY=.venv/bin/python
elif ls "$STAGE"/piece-* >/dev/null 2>&1; then
    if [ ! -d /tmp/site/onnxruntime ]; then
        cat "$STAGE"/piece-* > "$STAGE/bundle.tar" && tar -C "$STAGE" -xf "$STAGE/bundle.tar" || {
            echo "the bundle is incomplete: send every piece (.gpu/p1 ... .gpu/pN) first"; exit 2; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$STAGE"/bundle/wheels/*.whl || exit 2
    fi
    export PYTHONPATH="/tmp/site:$ROOT" GESERVE_GPU_BUNDLE="$STAGE/bundle"
    PY=python3
    # onnxruntime-gpu loads CUDA 13 and cuDNN 9 from the nvidia-* wheels installed beside torch.
    nvidia_libs="$(python3 -c "import glob, os, site
print(':'.join(sorted({d for s in site.getsitepackages() for d in glob.glob(os.path.join(s, 'nvidia', '*', 'lib'))
                       + glob.glob(os.path.join(s, 'nvidia', '*', '*', 'lib'))})))")"
    export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    echo "no onnxruntime-gpu here: run GESERVE_CUDA=1 scripts/bootstrap.sh, or send the bundle (see this script's header)"
    exit 2
fi
export PYTHONUNBUFFERED=1
elapsed "python ready: $PY"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
"$PY" -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"

# ---- tests --------------------------------------------------------------------------------------------------------
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_devices_gpu.py tests/test_devices_options.py \
    tests/test_devices_metrics.py 2>&1 | tail -25
elapsed "tests done"

# ---- bench --------------------------------------------------------------------------------------------------------
left=$(( 470 - ($(date +%s) - began) ))
timeout $(( left > 60 ? left : 60 )) "$PY" bench/gpu_bench.py --budget $(( left > 120 ? left - 110 : 10 ))
elapsed "bench done"
cat bench/results/gpu.md
if [ -n "${OUT:-}" ]; then cp bench/results/gpu.md "$OUT/"; fi
