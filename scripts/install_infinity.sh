#!/usr/bin/env bash
# Installs infinity-emb, the dedicated embedding server bench/embeddings_bench.py measures geserve's OpenAI embeddings
# against, into a venv of its own, .venv-infinity (it wants numpy<2, which the main .venv does not take), from its
# lock locks/infinity-py<X.Y>.txt (exact versions, hash-checked; scripts/update_locks.sh writes it from
# locks/infinity.in). torch comes from the CPU wheel this kind of machine keeps in GESERVE_LOCK_FIND_LINKS (default
# /opt/wheels). The bench runs this script itself when .venv-infinity is missing or stale; the test install
# (scripts/bootstrap.sh) never does. Idempotent: a second run only checks the stamp; a changed lock makes the venv anew.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-infinity"
PYTHON="${PYTHON:-python3}"
FIND_LINKS="${GESERVE_LOCK_FIND_LINKS:-/opt/wheels}"

log() { echo "install_infinity: $*" >&2; }

PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
lock="locks/infinity-py$PYVER.txt"
if [ ! -f "$ROOT/$lock" ]; then
    log "no lock for Python $PYVER ($lock): run scripts/update_locks.sh with that Python in TEST_PYTHONS"
    exit 1
fi
stamp="$VENV/.geserve-infinity-installed"
wanted="$(cd "$ROOT" && sha256sum locks/pip.txt "$lock" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$wanted" ] && "$VENV/bin/python" -c 'import infinity_emb' 2>/dev/null; then
    exit 0
fi
# A fresh venv each time the lock changes: it then holds exactly the lock's packages.
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
find_links=()
if [ -d "$FIND_LINKS" ]; then find_links=(--find-links "$FIND_LINKS"); fi
pip_install() {
    # pip warns about unreachable extra indexes on some machines: show only the rest, fail on failure.
    local out rc=0
    out="$("$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1)" || rc=$?
    echo "$out" | grep -v -e '^$' -e 'is ignored: it is neither a file nor a directory' >&2 || true
    return "$rc"
}
log "installing $lock into $VENV"
pip_install --require-hashes --no-deps -r "$ROOT/locks/pip.txt"
pip_install --require-hashes --no-deps "${find_links[@]}" -r "$ROOT/$lock"
echo "$wanted" > "$stamp"
