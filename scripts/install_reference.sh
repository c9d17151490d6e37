#!/usr/bin/env bash
# Installs the reference systems geserve is compared against (see DESIGN.md "Reference systems"):
#   * perf_analyzer from the main .venv (tritonclient 2.41.0 wheel): needs Debian's libb64-0d;
#   * the real NVIDIA tritonserver binary from nvidia-pytriton 0.7.0, in its own venv .venv-ref
#     (pytriton wants numpy<2 and tritonclient~=2.50, which clash with the main venv), from the locks
#     locks/reference-pytriton.txt and locks/reference-py<X.Y>.txt (scripts/update_locks.sh writes them);
#   * espeak-ng and sox from Debian, which make the speech recording of the Silero VAD test
#     (tests/test_vad_speech.py) and bench/vad_bench.py; that test skips without them.
# Idempotent; a second run only checks. Run from anywhere: paths are relative to the repo root.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REF_VENV="$ROOT/.venv-ref"
PYTHON="${PYTHON:-python3}"

log() { echo "install_reference: $*" >&2; }

apt_updated=0
apt_install() {
    if ! command -v apt-get >/dev/null 2>&1; then
        log "apt-get not available; please install: $*"
        return 1
    fi
    local out
    if [ "$apt_updated" = 0 ]; then
        out="$(DEBIAN_FRONTEND=noninteractive apt-get update -qq 2>&1)" || { echo "$out" >&2; return 1; }
        apt_updated=1
    fi
    out="$(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" 2>&1)" \
        || { echo "$out" >&2; return 1; }
}

# (a) perf_analyzer: libb64 from Debian (libcudart.so.12 comes from the nvidia-cuda-runtime-cu12 wheel
# in .venv; tests/support/reference.py puts it on LD_LIBRARY_PATH).
if ! ldconfig -p | grep -q 'libb64\.so\.0d'; then
    apt_install libb64-0d
fi
# espeak-ng and sox: not fatal when they cannot be installed (the speech test then skips, saying why).
missing_tools=()
for tool in espeak-ng sox; do
    command -v "$tool" >/dev/null 2>&1 || missing_tools+=("$tool")
done
if [ "${#missing_tools[@]}" -gt 0 ]; then
    apt_install "${missing_tools[@]}" || log "could not install ${missing_tools[*]}: the VAD speech test will skip"
fi

# (b) tritonserver in .venv-ref.
if [ ! -x "$REF_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$REF_VENV"
fi
PYVER="$("$REF_VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
SITE="$("$REF_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
TS="$SITE/pytriton/tritonserver"

pip_quiet() {
    # pip warns about unreachable extra indexes on some machines; show only the rest, fail on failure.
    local out rc=0
    out="$("$REF_VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1)" || rc=$?
    echo "$out" | grep -v -e '^$' -e 'is ignored: it is neither a file nor a directory' \
        -e 'requires .*, which is not installed' -e 'dependency resolver does not currently' >&2 || true
    return "$rc"
}

# nvidia-pytriton with --no-deps (only its binary is used: locks/reference-pytriton.in), and what the Python backend
# stub, our generated model.py and the example pipelines' models import (locks/reference.in), both hash-checked from
# their locks; without a lock for this Python, locks/reference.in's ranges. The stamp holds the hashes of the files
# followed, so a changed lock reinstalls.
ref_lock="locks/reference-py$PYVER.txt"
inputs=()
for file in locks/pip.txt locks/reference-pytriton.txt "$ref_lock"; do
    if [ -f "$ROOT/$file" ]; then inputs+=("$file"); fi
done
stamp="$REF_VENV/.geserve-reference-installed"
wanted="$(cd "$ROOT" && sha256sum "${inputs[@]}" | sha256sum | cut -d' ' -f1)"
imports='import numpy, onnxruntime, PIL, cv2, tokenizers; assert numpy.__version__ < "2"'
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$wanted" ] || [ ! -x "$TS/bin/tritonserver" ] \
        || ! "$REF_VENV/bin/python" -c "$imports" >/dev/null 2>&1; then
    if [ -f "$ROOT/locks/pip.txt" ]; then
        pip_quiet --require-hashes --no-deps -r "$ROOT/locks/pip.txt"
    fi
    if [ -f "$ROOT/locks/reference-pytriton.txt" ]; then
        pip_quiet --require-hashes --no-deps -r "$ROOT/locks/reference-pytriton.txt"
    else
        pip_quiet --no-deps -r "$ROOT/locks/reference-pytriton.in"
    fi
    if [ -f "$ROOT/$ref_lock" ]; then
        pip_quiet --require-hashes --no-deps -r "$ROOT/$ref_lock"
    else
        log "no lock for Python $PYVER ($ref_lock): installing locks/reference.in's ranges, unlocked"
        pip_quiet -r "$ROOT/locks/reference.in"
    fi
    echo "$wanted" > "$stamp"
fi
[ -x "$TS/bin/tritonserver" ] || { log "tritonserver binary missing at $TS/bin"; exit 1; }

STUB_SRC="$TS/python_backend_stubs/$PYVER/triton_python_backend_stub"
STUB_DST="$TS/backends/python/triton_python_backend_stub"
if [ ! -f "$STUB_SRC" ]; then
    log "no Python backend stub for Python $PYVER in $TS/python_backend_stubs"
    exit 1
fi
if ! cmp -s "$STUB_SRC" "$STUB_DST"; then
    cp "$STUB_SRC" "$STUB_DST"
    chmod +x "$STUB_DST"
fi

# The wheel is auditwheel-repaired: tritonserver and libtriton_python.so find their libs through RPATH
# (site-packages/nvidia_pytriton.libs). The stub links the system libpython<ver>.so.1.0: use the venv's
# base interpreter's LIBDIR (reference.py does the same) and fall back to Debian's libpython package.
BASE_LIBDIR="$("$REF_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
check_ldd() {
    LD_LIBRARY_PATH="$BASE_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$1" | grep 'not found' || true
}
missing="$(check_ldd "$STUB_DST")"
if [ -n "$missing" ]; then
    if echo "$missing" | grep -q "libpython$PYVER"; then
        apt_install "libpython$PYVER"
    fi
    missing="$(check_ldd "$STUB_DST")"
fi
for f in "$TS/bin/tritonserver" "$TS/backends/python/libtriton_python.so"; do
    missing="$missing$(check_ldd "$f")"
done
if [ -n "$missing" ]; then
    log "unresolved shared libraries:"
    echo "$missing" >&2
    exit 1
fi

# --help exits 1; it runs if it prints its usage.
help_text="$("$TS/bin/tritonserver" --help 2>&1 || true)"
if [[ "$help_text" != *"Usage: tritonserver"* ]]; then
    log "tritonserver does not run: $TS/bin/tritonserver --help"
    exit 1
fi
