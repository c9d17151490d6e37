"""The compiler's accuracy tools (`compile --check`, `geserve compare`), node counts, custom-op libraries and the
shape refusal of a served compiled model."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from geserve.backends.base import ModelSource
from geserve.backends.ge import GeBackend
from geserve.backends.ge.parameters import parse_ge_options
from geserve.cli import main as cli_main
from geserve.compiler import read_package
from geserve.compiler.compare import compare
from geserve.config import parse_config_text
from geserve.errors import UnavailableError
from tests.support import models
from tests.support.server import geserve

REPOSITORY = models.EXAMPLES / "model_repository"


def test_compare_math() -> None:
    golden = np.array([[1.0, 3.0, 2.0], [0.5, -1.0, 0.0]], np.float32)
    same = compare(golden, golden)
    assert (same.cosine, same.max_abs, same.max_rel, same.top1) == (pytest.approx(1.0), 0.0, 0.0, 1.0)
    output = golden.copy()
    output[1, 0] = -2.0  # row 1: argmax moves from column 0 to column 2
    result = compare(golden, output)
    assert result.max_abs == pytest.approx(2.5) and result.max_rel == pytest.approx(2.5 / 3.0)
    assert result.top1 == 0.5 and result.cosine < 0.9 and not result.within(1e-3)
    embedding = compare(np.ones(8), np.ones(8) * 1.0005)
    assert embedding.top1 is None and embedding.within(1e-3) and not embedding.within(1e-4)
    assert not compare(np.ones(3), np.array([1.0, np.nan, 1.0])).within(1.0)  # NaN never passes


def test_compare_command_exit_codes(tmp_path: Path, capsys) -> None:
    golden = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    np.save(tmp_path / "golden.npy", golden)
    np.save(tmp_path / "close.npy", golden + 1e-5)
    np.save(tmp_path / "far.npy", golden * 1.1)
    np.save(tmp_path / "shape.npy", golden[:2])
    assert cli_main(["compare", str(tmp_path / "golden.npy"), str(tmp_path / "close.npy"), "--threshold", "1e-3"]) == 0
    line = capsys.readouterr().out
    assert "cosine 1.000000" in line and "top-1 agreement 4/4" in line and line.rstrip().endswith(": ok")
    assert cli_main(["compare", str(tmp_path / "golden.npy"), str(tmp_path / "far.npy"), "--threshold", "1e-3"]) == 1
    assert "OVER threshold 0.001" in capsys.readouterr().out
    assert cli_main(["compare", str(tmp_path / "golden.npy"), str(tmp_path / "shape.npy")]) == 2
    assert "shapes differ" in capsys.readouterr().err
    np.savez(tmp_path / "g.npz", logits=golden, other=golden)
    np.savez(tmp_path / "o.npz", logits=golden, other=golden + 1)
    assert cli_main(["compare", str(tmp_path / "g.npz"), str(tmp_path / "o.npz")]) == 1
    out = capsys.readouterr().out
    assert "logits: cosine" in out and "other: cosine" in out


def test_compile_check_random_and_given_data_and_node_counts(mlp: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mlp16.gem"
    assert cli_main(["compile", "--quiet", "--model", str(mlp), "--output", str(out), "--precision-mode",
                     "allow_fp32_to_fp16", "--check"]) == 0
    captured = capsys.readouterr()
    assert "random inputs" in captured.out
    line = next(s for s in captured.out.splitlines() if s.startswith("check output 'logits'"))
    cosine = float(line.split("cosine ")[1].split(",")[0])
    assert cosine > 0.999 and "top-1 agreement 2/2" in line
    counts = read_package(out)[0].node_counts
    assert set(counts) == {"source", "before_optimization", "after_optimization", "compiled"}
    assert f"graph optimization: {counts['before_optimization']} -> {counts['after_optimization']} nodes" \
        in captured.err
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32))
    assert cli_main(["compile", "--quiet", "--model", str(mlp), "--output", str(out), "--check",
                     "--check-data", str(data)]) == 0
    assert f"from {data}" in (text := capsys.readouterr().out) and "top-1 agreement 5/5 (100.0%)" in text


def test_optimizer_node_counts_on_efficientnet(efficientnet: Path, tmp_path: Path) -> None:
    out = tmp_path / "e.gem"
    assert cli_main(["compile", "--quiet", "--model", str(efficientnet), "--output", str(out)]) == 0
    counts = read_package(out)[0].node_counts
    print(f"efficientnet_lite0 nodes: {counts}")
    assert counts["after_optimization"] < counts["before_optimization"] <= counts["source"]  # BN folded, fused


def _mlp_config(name: str, extra: str = "") -> str:
    text = (REPOSITORY / "mlp" / "config.pbtxt").read_text().replace('name: "mlp"', f'name: "{name}"')
    return text + extra


def test_custom_ops_library_errors_are_unavailable(mlp: Path, tmp_path: Path) -> None:
    """The `custom_ops` parameter's error paths: a missing library, and a file that is not a custom-op library
    (tests/test_compiler_custom_ops.py compiles and serves a real one, onnxruntime-extensions')."""
    model_dir = tmp_path / "mlp_custom"
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(mlp, model_dir / "1" / "model.onnx")
    (model_dir / "bogus.so").write_bytes(b"not a shared library")
    parameter = 'parameters {{ key: "custom_ops" value: {{ string_value: "{}" }} }}\n'
    config = parse_config_text(_mlp_config("mlp_custom", parameter.format("ops/libmissing.so")), "mlp_custom")
    config.backend = "ge"
    assert parse_ge_options(config).custom_ops == ["ops/libmissing.so"]
    listed = parse_config_text(_mlp_config("m", parameter.format(" a.so, ops/b.so ,")), "m")
    assert parse_ge_options(listed).custom_ops == ["a.so", "ops/b.so"]
    with pytest.raises(UnavailableError, match=r"custom operator library .*ops/libmissing.so \(parameter "
                                               r"'custom_ops'\) not found"):
        GeBackend().create_instances(config, ModelSource(model_dir, 1))
    config = parse_config_text(_mlp_config("mlp_custom", parameter.format("bogus.so")), "mlp_custom")
    config.backend = "ge"
    with pytest.raises(UnavailableError, match=r"cannot register custom operator library .*bogus\.so"):
        GeBackend().create_instances(config, ModelSource(model_dir, 1))


def _post(url: str, body: dict) -> tuple[int, dict | list]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_served_gem_refuses_wrong_shape_and_reports_missing_custom_ops(
    efficientnet: Path, mlp: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    (repo / "effnet" / "1").mkdir(parents=True)
    config = (efficientnet.parents[1] / "config.pbtxt").read_text()
    (repo / "effnet" / "config.pbtxt").write_text(config.replace('"efficientnet_lite0"', '"effnet"'))
    shutil.copy(efficientnet.parents[1] / "labels.txt", repo / "effnet" / "labels.txt")
    assert cli_main(["compile", "--quiet", "--model", str(efficientnet), "--input-shape", "input:-1,3,224,224",
                     "--output", str(repo / "effnet" / "1" / "model.gem")]) == 0
    (repo / "mlp_custom" / "1").mkdir(parents=True)
    shutil.copy(mlp, repo / "mlp_custom" / "1" / "model.onnx")
    (repo / "mlp_custom" / "config.pbtxt").write_text(_mlp_config(
        "mlp_custom", 'parameters { key: "custom_ops" value: { string_value: "libmissing.so" } }\n'))
    with geserve([repo], tmp_path / "server.log") as server:
        status, body = _post(f"{server.base}/v2/models/effnet/infer", {"inputs": [
            {"name": "input", "shape": [1, 224, 224, 3], "datatype": "FP32", "data": [0.0] * (224 * 224 * 3)}]})
        assert status == 400
        assert "input 'input'" in body["error"] and "Expected [-1,3,224,224], got [1,224,224,3]" in body["error"]
        status, index = _post(f"{server.base}/v2/repository/index", {})
    states = {entry["name"]: entry for entry in index}
    assert states["effnet"]["state"] == "READY"
    assert states["mlp_custom"]["state"] == "UNAVAILABLE"
    assert "libmissing.so" in states["mlp_custom"]["reason"] and "custom_ops" in states["mlp_custom"]["reason"]


def test_calibration_data_from_a_python_callable(tmp_path: Path) -> None:
    """`--calibration-data file.py:function`: the callable yields the calibration batches."""
    import onnx
    from onnx import TensorProto, helper

    from geserve.compiler.errors import CompilerError
    from geserve.compiler.quantize import calibration_batches

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    script = tmp_path / "calibrate.py"
    script.write_text("import numpy as np\ndef batches():\n    for i in range(3):\n"
                      "        yield np.full((2, 4), float(i), dtype=np.float32)\n")
    batches = calibration_batches(Path(f"{script}:batches"), model)
    assert [b["x"].shape for b in batches] == [(2, 4)] * 3 and batches[2]["x"][0, 0] == 2.0
    with pytest.raises(CompilerError, match="cannot load the calibration callable"):
        calibration_batches(Path(f"{script}:missing"), onnx.load_from_string(model.SerializeToString()))
