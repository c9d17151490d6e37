"""Custom operators in the compiler: a graph with onnxruntime-extensions ops (Inverse, StringUpper) compiled with
`--custom-op-library`, described by `--info`, served from its package and compiled on first load."""

from __future__ import annotations

import importlib.util
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from geserve.cli import main as cli_main
from geserve.compiler import read_package
from geserve.compiler.package import Manifest, decode_package, encode_package
from tests.support.server import geserve

LIBRARY = "libortextensions.so"
DOMAIN = "ai.onnx.contrib"
_RNG = np.random.default_rng(7)
W = (2 * np.eye(3) + 0.1 * _RNG.standard_normal((3, 3))).astype(np.float32)
B = _RNG.standard_normal((3, 3)).astype(np.float32)
CONFIG = """name: "{name}"
backend: "ge"
max_batch_size: 0
input [ {{ name: "x", data_type: TYPE_FP32, dims: [ 3, 3 ] }}, {{ name: "s", data_type: TYPE_STRING, dims: [ -1 ] }} ]
output [ {{ name: "y", data_type: TYPE_FP32, dims: [ 3, 3 ] }}, {{ name: "u", data_type: TYPE_STRING, dims: [ -1 ] }} ]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
"""


def _graph() -> onnx.ModelProto:
    """y = inverse(x @ W) + B (MatMul -> ai.onnx.contrib Inverse -> Add), u = StringUpper(s)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Inverse", ["m"], ["inv"], domain=DOMAIN),
        helper.make_node("Add", ["inv", "B"], ["y"]),
        helper.make_node("StringUpper", ["s"], ["u"], domain=DOMAIN),
    ]
    graph = helper.make_graph(
        nodes, "custom_ops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3]),
         helper.make_tensor_value_info("s", TensorProto.STRING, [-1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 3]),
         helper.make_tensor_value_info("u", TensorProto.STRING, [-1])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(B, "B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder: model.onnx and the real onnxruntime-extensions library beside it, also under ops/."""
    folder = tmp_path_factory.mktemp("custom_source")
    onnx.save(_graph(), str(folder / "model.onnx"))
    (folder / "ops").mkdir()
    shutil.copy(extensions_library(), folder / LIBRARY)
    shutil.copy(extensions_library(), folder / "ops" / LIBRARY)
    return folder


def extensions_library() -> Path:
    """onnxruntime-extensions' custom-op library, found without importing the package: its import sets
    PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in os.environ, and every server the suite starts afterwards would
    inherit protobuf's slow pure-Python parser (and its other error messages)."""
    spec = importlib.util.find_spec("onnxruntime_extensions")
    assert spec is not None and spec.submodule_search_locations, "onnxruntime-extensions is in the test extra"
    found = sorted(Path(spec.submodule_search_locations[0]).glob("_extensions_pydll*.so"))
    assert found, "onnxruntime-extensions ships _extensions_pydll*.so"
    return found[0]


def _compile(*args: str) -> int:
    return cli_main(["compile", "--quiet", *args])


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    x = (np.random.default_rng(3).standard_normal((3, 3)) + 3 * np.eye(3)).astype(np.float32)
    return x, np.array(["hello", "Geserve 1"], dtype=object)


def _expected(x: np.ndarray) -> np.ndarray:
    return np.linalg.inv(x.astype(np.float64) @ W.astype(np.float64)) + B


def _run(onnx_bytes: bytes, library: Path) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    x, s = _inputs()
    session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
    return list(session.run(None, {"x": x, "s": s}))


def test_compile_with_a_custom_op_library_fp32_and_fp16(source: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    model = str(source / "model.onnx")
    assert _compile("--model", model, "--output", str(tmp_path / "none.gem")) == 1
    error = capsys.readouterr().err
    assert f"custom operators (domain {DOMAIN})" in error and "--custom-op-library" in error

    out = tmp_path / "fp32.gem"
    assert _compile("--model", model, "--output", str(out), "--custom-op-library", str(source / LIBRARY),
                    "--check") == 0
    printed = capsys.readouterr().out
    assert "check output 'y': cosine 1.000000" in printed and "check output 'u': 2/2 strings equal" in printed
    manifest, onnx_bytes = read_package(out)
    assert manifest.custom_op_libraries == [LIBRARY] and manifest.custom_op_domains == [DOMAIN]  # absolute: its name
    y, u = _run(onnx_bytes, source / LIBRARY)
    np.testing.assert_allclose(y, _expected(_inputs()[0]), rtol=1e-4, atol=1e-5)
    assert u.tolist() == ["HELLO", "GESERVE 1"]

    monkeypatch.chdir(source)  # a relative library path is recorded as given: the model folder holds ops/
    out16 = tmp_path / "fp16.gem"
    assert _compile("--model", model, "--output", str(out16), "--custom-op-library", f"ops/{LIBRARY}",
                    "--precision-mode", "force_fp16") == 0
    manifest, onnx_bytes = read_package(out16)
    assert manifest.custom_op_libraries == [f"ops/{LIBRARY}"] and manifest.precision == "force_fp16"
    graph = onnx.load_from_string(onnx_bytes).graph
    assert {i.name: i.data_type for i in graph.initializer if i.name in ("W", "B")} == {
        "W": TensorProto.FLOAT16, "B": TensorProto.FLOAT16}  # the standard ops went to FP16
    y, _ = _run(onnx_bytes, source / LIBRARY)
    np.testing.assert_allclose(y, _expected(_inputs()[0]), rtol=1e-2, atol=1e-2)

    capsys.readouterr()
    assert _compile("--model", str(out16), "--info") == 0
    assert f"custom ops        {DOMAIN} (ops/{LIBRARY})" in capsys.readouterr().out


def test_fp16_keeps_custom_ops_in_fp32(source: Path) -> None:
    """The FP16 pass alone (the CPU optimizer after it casts ops without FP16 kernels back): MatMul and Add in FP16,
    Cast to FP32 before Inverse and back to FP16 after it."""
    from geserve.compiler.precision import apply_precision

    graph = apply_precision(_graph(), "force_fp16", True, [source / LIBRARY]).graph
    producer = {name: node for node in graph.node for name in node.output}
    consumer = {name: node for node in graph.node for name in node.input}
    inverse = next(node for node in graph.node if node.op_type == "Inverse")
    before, after = producer[inverse.input[0]], consumer[inverse.output[0]]
    assert (before.op_type, before.attribute[0].i) == ("Cast", TensorProto.FLOAT)
    assert (after.op_type, after.attribute[0].i) == ("Cast", TensorProto.FLOAT16)
    assert producer[before.input[0]].op_type == "MatMul" and consumer[after.output[0]].op_type == "Add"
    assert {i.name: i.data_type for i in graph.initializer} == {"W": TensorProto.FLOAT16, "B": TensorProto.FLOAT16}


def test_library_errors_and_int8_refusal_are_one_line(source: Path, tmp_path: Path, capsys) -> None:
    model, out = str(source / "model.onnx"), str(tmp_path / "m.gem")
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a shared library")
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    np.save(calibration / "0.npy", _inputs()[0])
    cases = [
        (["--custom-op-library", str(tmp_path / "libmissing.so")],
         f"custom-op library {tmp_path / 'libmissing.so'} not found"),
        (["--custom-op-library", str(bogus)], f"cannot load custom-op library {bogus}: "),
        (["--custom-op-library", str(source / LIBRARY), "--quantize", "int8", "--calibration-data", str(calibration)],
         f"--quantize int8 cannot calibrate a graph with custom operators (domain {DOMAIN})"),
    ]
    for extra, message in cases:
        assert _compile("--model", model, "--output", out, *extra) == 1
        error = capsys.readouterr().err
        assert error.startswith(f"error: {message}") and error.count("\n") == 1, error
    assert not Path(out).exists()


def test_a_manifest_without_custom_op_fields_still_reads() -> None:
    manifest = Manifest(source_hash="0" * 64, compiler_version="geserve-compiler 0")
    data = encode_package(manifest, b"graph")
    header = data[12:12 + int.from_bytes(data[8:12], "little")]
    old = json.loads(header)
    del old["manifest"]["custom_op_libraries"], old["manifest"]["custom_op_domains"]
    old_header = json.dumps(old, sort_keys=True).encode()
    read, payload = decode_package(data[:8] + len(old_header).to_bytes(4, "little") + old_header + b"graph")
    assert payload == b"graph" and read.custom_op_libraries == [] and read.custom_op_domains == []


def _infer(base: str, name: str) -> tuple[int, dict]:
    x, s = _inputs()
    body = {"inputs": [{"name": "x", "shape": [3, 3], "datatype": "FP32", "data": x.ravel().tolist()},
                       {"name": "s", "shape": [2], "datatype": "BYTES", "data": s.tolist()}]}
    request = urllib.request.Request(f"{base}/v2/models/{name}/infer", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _model(repo: Path, name: str, extra: str = "") -> Path:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name) + extra)
    return repo / name


def test_server_serves_custom_op_packages_and_compiles_on_first_load(
    source: Path, tmp_path: Path, monkeypatch
) -> None:
    repo = tmp_path / "repo"
    gem = _model(repo, "inv_gem")
    shutil.copy(source / LIBRARY, gem / LIBRARY)
    assert _compile("--model", str(source / "model.onnx"), "--output", str(gem / "1" / "model.gem"),
                    "--custom-op-library", str(gem / LIBRARY)) == 0
    fp16 = _model(repo, "inv_fp16")
    shutil.copytree(source / "ops", fp16 / "ops")
    monkeypatch.chdir(fp16)
    assert _compile("--model", str(source / "model.onnx"), "--output", "1/model.gem",
                    "--custom-op-library", f"ops/{LIBRARY}", "--precision-mode", "allow_fp32_to_fp16") == 0
    jit = _model(repo, "inv_jit", f'parameters {{ key: "custom_ops" value: {{ string_value: "ops/{LIBRARY}" }} }}\n'
                 'parameters { key: "compile_precision_mode" value: { string_value: "force_fp16" } }\n')
    shutil.copy(source / "model.onnx", jit / "1" / "model.onnx")
    shutil.copytree(source / "ops", jit / "ops")
    missing = _model(repo, "inv_missing")  # a package whose library was not deployed with it
    shutil.copy(gem / "1" / "model.gem", missing / "1" / "model.gem")
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(tmp_path / "cache"))
    with geserve([repo], tmp_path / "server.log") as server:
        for name, tolerance in (("inv_gem", 1e-5), ("inv_fp16", 1e-2), ("inv_jit", 1e-2)):
            status, body = _infer(server.base, name)
            assert status == 200, (name, body)
            outputs = {output["name"]: output["data"] for output in body["outputs"]}
            np.testing.assert_allclose(np.array(outputs["y"]).reshape(3, 3), _expected(_inputs()[0]),
                                       rtol=tolerance, atol=tolerance, err_msg=name)
            assert outputs["u"] == ["HELLO", "GESERVE 1"], name
        request = urllib.request.Request(f"{server.base}/v2/repository/index", b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            states = {entry["name"]: entry for entry in json.loads(response.read())}
        log = server.log()
    assert "'inv_jit': compiled" in log
    assert states["inv_missing"]["state"] == "UNAVAILABLE"
    reason = states["inv_missing"]["reason"]
    assert f"{missing / LIBRARY} (needed by the compiled model model.gem) not found" in reason, reason
