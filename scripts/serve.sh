#!/usr/bin/env bash
# Installs everything (first run only), builds the example repository, and serves it: HTTP on :8000.
# Extra arguments go to `geserve serve`, e.g. ./scripts/serve.sh --http-port 9000
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/geserve" serve --model-repository "$ROOT/examples/model_repository" "$@"
