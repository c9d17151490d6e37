"""Layer-by-layer accuracy tools: `compile --check --layers`, `--keep-fp32`, the GE backend's `dump_data`, and
`geserve compare` over dump folders, on ResNet-50 in INT8 and on the MLP."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from geserve.backends.base import ModelSource
from geserve.backends.ge import GeBackend
from geserve.cli import main as cli_main
from geserve.compiler import read_package
from geserve.compiler.keep import parse_keep_fp32
from geserve.config import parse_config_text
from geserve.errors import InvalidArgumentError
from tests.support import models
from tests.support.server import geserve

THRESHOLD = 0.15  # above this ResNet's INT8 error after a dozen layers, below it for the first ones


@dataclass(frozen=True)
class Int8Compile:
    source: Path
    package: Path
    calibration: Path
    check_data: Path
    out: str
    csv: Path


def _compile(*args: str) -> tuple[int, str]:
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = cli_main(["compile", "--quiet", *args])
    return code, captured.getvalue()


def _final_max_rel(out: str) -> float:
    line = next(s for s in out.splitlines() if s.startswith("check output 'logits'"))
    return float(line.split("max rel error ")[1].split(",")[0])


@pytest.fixture(scope="module")
def resnet_int8(tmp_path_factory: pytest.TempPathFactory) -> Int8Compile:
    """ResNet-50 quantized to INT8 (4 random calibration images) and checked layer by layer on 8 other images."""
    source = models.example_onnx("resnet50")
    root = tmp_path_factory.mktemp("resnet_layers")
    for folder, seed, count in (("calibration", 0, 4), ("check", 1, 8)):
        (root / folder).mkdir()
        images = np.random.default_rng(seed).standard_normal((count, 3, 224, 224)).astype(np.float32)
        np.save(root / folder / "images.npy", images)
    package = root / "resnet_int8.gem"
    code, out = _compile("--model", str(source), "--output", str(package), "--quantize", "int8",
                         "--calibration-data", str(root / "calibration"), "--check", "--check-data",
                         str(root / "check"), "--layers", "--layers-threshold", str(THRESHOLD),
                         "--layers-csv", str(root / "layers.csv"))
    assert code == 0, out
    return Int8Compile(source, package, root / "calibration", root / "check", out, root / "layers.csv")


def test_layers_find_the_first_jump_and_keep_fp32_lowers_the_final_error(
    resnet_int8: Int8Compile, tmp_path: Path
) -> None:
    """`--check --layers` names every layer's error and the first one above the threshold; the layers up to it kept
    in FP32 lower the final error. Random weights make this ResNet amplify any early error (0.1% input noise moves
    its logits by ~13%), so INT8 error enters everywhere from the first layer on: keeping only the layer at the jump
    changes nothing measurable, keeping the layers that built the error up to it does."""
    out = resnet_int8.out
    rows = [line for line in out.splitlines() if line.startswith("layer ")]
    assert len(rows) > 60
    # The first ReLU was folded into the quantized Conv before it; its tensor exists only as uint8 and is compared
    # dequantized (a pre-ReLU comparison would have a cosine near 0.7).
    relu = next(line for line in rows if "'/2/Relu_output_0'" in line)
    assert float(relu.split("cosine ")[1].split(",")[0]) > 0.999
    marked = [line for line in rows if line.endswith(f"<-- first above {THRESHOLD:g}")]
    assert len(marked) == 1
    summary = next(line for line in out.splitlines() if line.startswith("layers: first above"))
    with open(resnet_int8.csv) as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(rows)
    first = next(int(row["index"]) for row in table if row["first_over"] == "1")
    assert f"layer {first} " in summary and f"layer {first:>3} " in marked[0]
    assert all(float(row["max_rel"]) <= THRESHOLD for row in table[:first - 1])
    assert float(table[first - 1]["max_rel"]) > THRESHOLD
    kept = [node for row in table[:first] for node in row["nodes"].split(";")]
    keep_file = tmp_path / "keep.txt"
    keep_file.write_text("# the layers up to the first jump\n" + "\n".join(kept) + "\n")
    code, kept_out = _compile("--model", str(resnet_int8.source), "--output", str(tmp_path / "kept.gem"),
                              "--quantize", "int8", "--calibration-data", str(resnet_int8.calibration),
                              "--keep-fp32", f"@{keep_file}", "--check", "--check-data", str(resnet_int8.check_data))
    assert code == 0, kept_out
    full, partial = _final_max_rel(out), _final_max_rel(kept_out)
    print(f"resnet50 int8: first layer above {THRESHOLD}: {first} ({len(kept)} nodes up to it); final max rel error "
          f"{full:.3f} all INT8, {partial:.3f} with them in FP32")
    assert partial < 0.8 * full
    graph = onnx.load_from_string(read_package(tmp_path / "kept.gem")[1]).graph
    assert "/0/Conv" in {n.name for n in graph.node if n.op_type in ("Conv", "FusedConv")}


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_dump_data_on_cpu_is_read_by_compare(resnet_int8: Int8Compile, tmp_path: Path, capsys) -> None:
    """The source (FP32) and the INT8 package served with dump_data; `geserve compare` reads the two dumps."""
    repo, dumps = tmp_path / "repo", tmp_path / "dumps"
    config = (resnet_int8.source.parents[1] / "config.pbtxt").read_text()
    dump = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                   for k, v in (("dump_data", "true"), ("dump_data_batches", "2"), ("dump_path", dumps)))
    for name, model_file, link in (("fp32", resnet_int8.source, "model.onnx"),
                                    ("int8", resnet_int8.package, "model.gem")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / link).symlink_to(model_file)
        (repo / name / "config.pbtxt").write_text(config.replace('name: "resnet50"', f'name: "{name}"') + dump)
    image = np.random.default_rng(2).standard_normal((1, 3, 224, 224)).astype(np.float32)
    body = {"inputs": [{"name": "input", "shape": list(image.shape), "datatype": "FP32",
                        "data": image.ravel().tolist()}]}
    with geserve([repo], tmp_path / "server.log") as server:
        _post(f"{server.base}/v2/models/fp32/infer", body)
        for _ in range(3):
            _post(f"{server.base}/v2/models/int8/infer", body)
        log = server.log()
    assert "'int8': dump_data wrote 2 batches" in log
    assert sorted(p.name for p in (dumps / "int8" / "1").iterdir()) == ["batch_000001", "batch_000002"]
    index = json.loads((dumps / "int8" / "1" / "batch_000001" / "index.json").read_text())["tensors"]
    assert index[0]["kind"] == "input" and index[-1] == {**index[-1], "name": "logits", "kind": "output"}
    assert any(t["name"].endswith("_quantized") and t["scale"] for t in index)
    assert np.array_equal(np.load(dumps / "int8" / "1" / "batch_000001" / index[0]["file"]), image)
    capsys.readouterr()
    golden, output = str(dumps / "fp32" / "1"), str(dumps / "int8" / "1")
    assert cli_main(["compare", golden, output, "--threshold", "0.9", "--layers-csv", str(tmp_path / "l.csv")]) == 0
    text = capsys.readouterr().out
    assert len([line for line in text.splitlines() if line.startswith("layer ")]) > 60
    assert re.search(r"layer +\d+ /22/Gemm \[Gemm\] 'logits': cosine 0\.9\d+", text)
    assert cli_main(["compare", golden, output, "--threshold", "1e-4"]) == 1  # INT8 logits are further off
    assert "<-- first above 0.0001" in capsys.readouterr().out


def test_check_layers_dump_dir_and_compare_on_fp16(mlp: Path, tmp_path: Path, capsys) -> None:
    dumps = tmp_path / "dumps"
    assert cli_main(["compile", "--quiet", "--model", str(mlp), "--output", str(tmp_path / "m.gem"), "--precision-mode",
                     "allow_fp32_to_fp16", "--check", "--layers", "--dump-dir", str(dumps)]) == 0
    layers = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layer ")]
    # No FP16 Gemm on a CPU: ONNX Runtime runs them in FP32 and renames their tensors, matched all the same.
    assert [line.split()[2] for line in layers] == ["/0/Gemm", "/1/Relu", "/2/Gemm", "/3/Relu", "/4/Gemm"]
    assert "top-1" in layers[-1] and "top-1" not in layers[0]
    assert cli_main(["compare", str(dumps / "golden"), str(dumps / "compiled"), "--threshold", "0.01"]) == 0
    compared = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layer ")]
    assert compared[0].endswith("(input) [input] 'input': cosine 1.000000, max abs error 0, max rel error 0")
    assert [line.split(maxsplit=2)[2] for line in compared[1:]] == [line.split(maxsplit=2)[2] for line in layers]
    (tmp_path / "empty").mkdir()
    assert cli_main(["compare", str(dumps / "golden"), str(tmp_path / "empty")]) == 2
    assert "no batch folders in common" in capsys.readouterr().err
    assert cli_main(["compile", "--quiet", "--model", str(mlp), "--output", str(tmp_path / "m.gem"), "--layers"]) == 1
    assert "--layers extends --check" in capsys.readouterr().err


def test_keep_fp32_in_fp16_names_files_and_errors(mlp: Path, tmp_path: Path, capsys) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text("# kept in FP32\n/2/Gemm   # the middle layer\n\nRelu\n")
    assert parse_keep_fp32(f"@{keep}") == ["/2/Gemm", "Relu"]
    assert parse_keep_fp32(" a, b ,a,") == ["a", "b"]
    out = tmp_path / "m.gem"
    assert cli_main(["compile", "--quiet", "--model", str(mlp), "--output", str(out), "--precision-mode",
                     "allow_fp32_to_fp16", "--keep-fp32", f"@{keep}"]) == 0
    manifest, onnx_bytes = read_package(out)
    weights = {t.name: t.data_type for t in onnx.load_from_string(onnx_bytes).graph.initializer}
    assert weights["2.weight"] == onnx.TensorProto.FLOAT and weights["0.weight"] == onnx.TensorProto.FLOAT16
    assert manifest.options["keep_fp32"] == ["/2/Gemm", "Relu"]
    assert cli_main(["compile", "--quiet", "--model", str(mlp), "--output", str(out), "--precision-mode",
                     "allow_fp32_to_fp16", "--keep-fp32", "/2/Gemm,/2/Gem,Softmax"]) == 1
    assert "no node or op type named '/2/Gem', 'Softmax'" in capsys.readouterr().err


def test_compile_keep_fp32_parameter_on_first_load(mlp: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = tmp_path / "mlp_keep"
    (model_dir / "1").mkdir(parents=True)
    shutil.copy(mlp, model_dir / "1" / "model.onnx")
    (model_dir / "keep.txt").write_text("/0/Gemm\n")
    base = (mlp.parents[1] / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "mlp_keep"')
    base += 'parameters { key: "compile_precision_mode" value: { string_value: "allow_fp32_to_fp16" } }\n'
    keep = 'parameters {{ key: "compile_keep_fp32" value: {{ string_value: "{}" }} }}\n'
    config = parse_config_text(base + keep.format("@keep.txt"), "mlp_keep")
    instances = GeBackend().create_instances(config, ModelSource(model_dir, 1))
    assert len(instances) == 1
    (entry,) = (tmp_path / "cache").glob("*.gem")
    assert read_package(entry)[0].options["keep_fp32"] == ["/0/Gemm"]
    config = parse_config_text(base + keep.format("/0/Gemm,Nope"), "mlp_keep")
    with pytest.raises(InvalidArgumentError, match="compile on load failed: --keep-fp32: no node or op type named "
                                                   "'Nope'"):
        GeBackend().create_instances(config, ModelSource(model_dir, 1))
