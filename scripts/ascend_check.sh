#!/usr/bin/env bash
# Issue 16's Ascend check, for a machine with an NPU and the CANN toolkit (never run by the project so far: no NPU
# was at hand). Source CANN's environment first (`source /usr/local/Ascend/ascend-toolkit/set_env.sh`) and install
# onnxruntime-cann in place of onnxruntime in .venv (`pip uninstall -y onnxruntime && pip install onnxruntime-cann`).
#
#   1. what is there: npu-smi, pyACL (`acl`), ATC, onnxruntime's providers
#   2. the device unit tests (option mapping, refusals, the .om engine against its stand-in)
#   3. the MLP example through the CANN execution provider (backend npu_ge, session.ge.* options, DEVICE_ID), its
#      answers against ONNX Runtime on the CPU
#   4. where ATC is on PATH: the MLP converted to model.om with batch gears 1,4,8 and served through pyACL, its
#      answers against ONNX Runtime on the CPU
# Prints each step's outcome; exits non-zero when a step that could run failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-.venv/bin/python}"
DEVICE_ID="${DEVICE_ID:-0}"
failed=0
step() { echo; echo "== $*"; }

step "1. what is there"
npu-smi info 2>/dev/null | head -20 || echo "npu-smi: not found"
"$PY" -c "import acl; print('pyACL:', acl.__file__)" 2>&1 | tail -1
command -v atc >/dev/null && echo "atc: $(command -v atc)" || echo "atc: not on PATH"
"$PY" -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"

step "2. device unit tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_devices_options.py tests/test_devices_offline.py \
    tests/test_devices_backend.py || failed=1

"$PY" examples/build.py --only mlp >/dev/null || { echo "cannot build the MLP example"; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/repo/mlp_cann/1"
cp examples/model_repository/mlp/1/model.onnx "$work/repo/mlp_cann/1/model.onnx"
cat > "$work/repo/mlp_cann/config.pbtxt" <<EOF
name: "mlp_cann"
backend: "npu_ge"
max_batch_size: 8
instance_group [ { count: 1 kind: KIND_GPU } ]
parameters { key: "DEVICE_ID" value: { string_value: "$DEVICE_ID" } }
parameters { key: "execution_accelerator" value: { string_value: "npu" } }
parameters { key: "session.ge.exec.precision_mode_v2" value: { string_value: "origin" } }
parameters { key: "graph.ge.inputShape" value: { string_value: "input:-1,256" } }
parameters { key: "graph.ge.dynamicDims" value: { string_value: "1;4;8" } }
EOF
served=(mlp_cann)
if command -v atc >/dev/null; then
    step "4a. ATC: the MLP as model.om with batch gears 1,4,8"
    mkdir -p "$work/repo/mlp_om/1"
    soc="$(npu-smi info 2>/dev/null | awk '/Ascend/ {print $3; exit}')"
    if atc --model=examples/model_repository/mlp/1/model.onnx --framework=5 --output="$work/repo/mlp_om/1/model" \
        --input_shape="input:-1,256" --dynamic_batch_size="1,4,8" --soc_version="Ascend${soc#Ascend}" >"$work/atc.log" 2>&1; then
        printf 'name: "mlp_om"\nbackend: "npu_ge"\nparameters { key: "DEVICE_ID" value: { string_value: "%s" } }\n' \
            "$DEVICE_ID" > "$work/repo/mlp_om/config.pbtxt"
        served+=(mlp_om)
    else
        echo "atc failed:"; tail -20 "$work/atc.log"; failed=1
    fi
fi

step "3/4. serving ${served[*]} on the NPU, answers against ONNX Runtime on the CPU"
"$PY" - "$work/repo" "${served[@]}" <<'EOF' || failed=1
import json, sys, urllib.request
import numpy as np, onnxruntime as ort
sys.path.insert(0, ".")
from tests.support.server import geserve
from pathlib import Path

repo, names = Path(sys.argv[1]), sys.argv[2:]
cpu = ort.InferenceSession("examples/model_repository/mlp/1/model.onnx", providers=["CPUExecutionProvider"])
ok = True
with geserve([repo], repo.parent / "server.log") as server:
    for name in names:
        for batch in (1, 3, 8):
            x = np.random.default_rng(batch).standard_normal((batch, 256)).astype(np.float32)
            body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [batch, 256], "data": x.ravel().tolist()}]}
            request = urllib.request.Request(f"{server.base}/v2/models/{name}/infer", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    got = np.array(json.loads(response.read())["outputs"][0]["data"], np.float32).reshape(batch, 10)
            except Exception as exc:
                print(f"{name} batch {batch}: FAILED {exc}"); ok = False; continue
            error = float(np.max(np.abs(got - cpu.run(None, {"input": x})[0])))
            print(f"{name} batch {batch}: max abs difference from ONNX Runtime CPU {error:.2e}")
            ok &= error < 1e-2
    print(server.log()[-3000:])
sys.exit(0 if ok else 1)
EOF
echo
[ "$failed" = 0 ] && echo "ascend check: passed" || echo "ascend check: FAILED (see above)"
exit "$failed"
