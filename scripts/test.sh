#!/usr/bin/env bash
# Installs everything (first run only), including the reference Triton server and perf_analyzer,
# then runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
bash "$ROOT/scripts/install_reference.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest "$@"
