#!/usr/bin/env bash
# NVIDIA perf_analyzer from the tritonclient wheel in .venv, with the CUDA runtime library it links.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIB="$("$ROOT/.venv/bin/python" -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')"
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$ROOT/.venv/bin/perf_analyzer" "$@"
