"""The GE compiler: `geserve compile` on the real example models, the .gem format, and serving its output."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from geserve.cli import main as cli_main
from geserve.compiler import CompileOptions, PackageError, read_package
from geserve.compiler.package import read_manifest
from geserve.compiler.pipeline import compile_model
from tests.support import models
from tests.support.server import geserve

KEY_HEX = "11" * 32


def _session(source: Path | bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(source if isinstance(source, bytes) else str(source), options,
                                providers=["CPUExecutionProvider"])


def _compile(*args: str) -> int:
    return cli_main(["compile", "--quiet", *args])


def test_manifest_round_trip_gears_and_info(mlp: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mlp.gem"
    assert _compile("--model", str(mlp), "--output", str(out), "--input-shape", "input:-1,256",
                    "--dynamic-batch-size", "8,1,4,2") == 0
    manifest, onnx_bytes = read_package(out)
    assert manifest.batch_gears == [1, 2, 4, 8]
    assert manifest.inputs == {"input": {"dtype": "FLOAT", "onnx_type": 1, "shape": [-1, 256]}}
    assert manifest.source_hash and manifest.compiler_version.startswith("geserve-compiler")
    assert manifest.precision == "force_fp32" and manifest.target == "cpu" and not manifest.encrypted
    x = np.random.default_rng(0).standard_normal((3, 256), dtype=np.float32)
    expected = _session(mlp).run(None, {"input": x})[0]
    np.testing.assert_allclose(_session(onnx_bytes).run(None, {"input": x})[0], expected, rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    assert _compile("--model", str(out), "--info") == 0
    info = capsys.readouterr().out
    assert "batch_gears       [1, 2, 4, 8]" in info and "input             input: FLOAT [-1, 256]" in info


def test_fp16_stays_close_to_fp32(mlp: Path, tmp_path: Path) -> None:
    out = tmp_path / "mlp16.gem"
    assert _compile("--model", str(mlp), "--output", str(out), "--precision-mode", "allow_fp32_to_fp16") == 0
    manifest, onnx_bytes = read_package(out)
    assert manifest.precision == "allow_fp32_to_fp16"
    session = _session(onnx_bytes)
    assert session.get_inputs()[0].type == "tensor(float)"  # I/O types kept
    x = np.random.default_rng(1).standard_normal((16, 256), dtype=np.float32)
    expected = _session(mlp).run(None, {"input": x})[0]
    got = session.run(None, {"input": x})[0]
    assert np.abs(got - expected).max() < 1e-2 * max(1.0, float(np.abs(expected).max()))
    assert (got.argmax(1) == expected.argmax(1)).mean() >= 0.9


def test_int8_digits_accuracy_within_one_point(digits: Path, tmp_path: Path) -> None:
    pixels, labels = models.digits_test_set()
    calibration = tmp_path / "calib"
    calibration.mkdir()
    np.save(calibration / "part0.npy", pixels[:100])
    np.savez(calibration / "part1.npz", pixels=pixels[100:200])
    out = tmp_path / "digits8.gem"
    assert _compile("--model", str(digits), "--output", str(out), "--quantize", "int8",
                    "--calibration-data", str(calibration)) == 0
    manifest, onnx_bytes = read_package(out)
    assert manifest.quantization == "int8"
    fp32 = (_session(digits).run(["label"], {"pixels": pixels})[0].ravel() == labels).mean()
    int8 = (_session(onnx_bytes).run(["label"], {"pixels": pixels})[0].ravel() == labels).mean()
    print(f"digits accuracy: fp32 {fp32:.4f}, int8 {int8:.4f}")
    assert int8 >= fp32 - 0.01


def test_encryption_round_trip_wrong_key_tampering(mlp: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "key.hex"
    key_file.write_text(KEY_HEX)
    out_dir = tmp_path / "out"
    out = out_dir / "mlp.gem"
    assert _compile("--model", str(mlp), "--output", str(out), "--encrypt-key-file", str(key_file)) == 0
    assert [p.name for p in out_dir.iterdir()] == ["mlp.gem"]  # no decrypted or temporary file left
    data = out.read_bytes()
    assert read_manifest(out).encrypted  # the manifest stays readable without the key
    manifest, onnx_bytes = read_package(out, bytes.fromhex(KEY_HEX))
    middle = len(onnx_bytes) // 2
    assert onnx_bytes[middle:middle + 64] not in data  # the weights are not stored in the clear
    assert manifest.encrypted and onnx_bytes.startswith(b"\x08")
    with pytest.raises(PackageError, match="wrong key"):
        read_package(out, b"\x22" * 32)
    with pytest.raises(PackageError, match="is encrypted"):
        read_package(out)
    tampered = tmp_path / "tampered.gem"
    tampered.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    with pytest.raises(PackageError, match="modified"):
        read_package(tampered, bytes.fromhex(KEY_HEX))
    plain_out = tmp_path / "plain.gem"
    assert _compile("--model", str(mlp), "--output", str(plain_out)) == 0
    raw = bytearray(plain_out.read_bytes())
    raw[-10] ^= 0xFF
    plain_out.write_bytes(bytes(raw))
    with pytest.raises(PackageError, match="integrity check failed"):
        read_package(plain_out)


def test_errors_are_one_line_with_exit_codes(tmp_path: Path, capsys) -> None:
    saved = tmp_path / "saved_model"
    saved.mkdir()
    (saved / "saved_model.pb").write_bytes(b"")
    assert _compile("--model", str(saved), "--output", str(tmp_path / "x.gem")) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tf2onnx failed" in err and "could not be found in SavedModel" in err
    assert _compile("--model", str(tmp_path / "missing.onnx"), "--output", str(tmp_path / "x.gem")) == 1
    assert "not found" in capsys.readouterr().err
    (tmp_path / "junk.gem").write_bytes(b"not a package")
    assert _compile("--model", str(tmp_path / "junk.gem"), "--info") == 1
    assert "not a geserve compiled model" in capsys.readouterr().err


def test_pytorch_front_end(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    source = tmp_path / "tiny.pt"
    torch.save(module, source)
    out = tmp_path / "tiny.gem"
    assert _compile("--model", str(source), "--output", str(out), "--input-shape", "x:-1,8",
                    "--out-nodes", "y", "--dynamic-batch-size", "1,4") == 0
    manifest, onnx_bytes = read_package(out)
    assert manifest.framework == "pytorch" and list(manifest.outputs) == ["y"]
    x = np.random.default_rng(2).standard_normal((4, 8), dtype=np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(_session(onnx_bytes).run(None, {"x": x})[0], expected, rtol=1e-4, atol=1e-5)


def test_aipp_preprocessing_matches_manual(tmp_path: Path) -> None:
    source = models.example_onnx("resnet50")
    mean, std = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]
    conf = tmp_path / "aipp.json"
    conf.write_text(json.dumps({"input_format": "BGR888_U8", "model_format": "RGB", "mean": mean, "std": std,
                                "crop": {"top": 4, "left": 2, "height": 224, "width": 224}}))
    options = CompileOptions(model=source, insert_op_conf=conf, input_shapes={"input": [1, 3, 224, 224]},
                             optimize=False)
    manifest, onnx_bytes = compile_model(options)
    assert manifest.inputs["input"]["dtype"] == "UINT8"
    image = np.random.default_rng(3).integers(0, 256, (1, 230, 232, 3), dtype=np.uint8)
    got = _session(onnx_bytes).run(None, {"input": image})[0]
    manual = image[:, 4:228, 2:226, ::-1].astype(np.float32)  # crop, BGR -> RGB
    manual = ((manual - np.float32(mean)) / np.float32(std)).transpose(0, 3, 1, 2).copy()
    expected = _session(source).run(None, {"input": manual})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)


def _infer_mlp(base: str, model: str, rows: int) -> np.ndarray:
    x = np.random.default_rng(4).standard_normal((rows, 256), dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "input", "shape": [rows, 256], "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()
    request = urllib.request.Request(f"{base}/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        output = json.loads(response.read())["outputs"][0]
    return np.asarray(output["data"], np.float32).reshape(output["shape"])


def test_server_serves_gem_and_compiles_on_first_load(mlp: Path, tmp_path: Path, monkeypatch) -> None:
    repo = tmp_path / "repo"
    config = (mlp.parents[1] / "config.pbtxt").read_text()
    (repo / "mlp_gem" / "1").mkdir(parents=True)
    (repo / "mlp_gem" / "config.pbtxt").write_text(config.replace('name: "mlp"', 'name: "mlp_gem"'))
    key_file = tmp_path / "key.bin"
    key_file.write_bytes(bytes.fromhex(KEY_HEX))
    assert _compile("--model", str(mlp), "--output", str(repo / "mlp_gem" / "1" / "model.gem"),
                    "--dynamic-batch-size", "1,2,4,8", "--encrypt-key-file", str(key_file)) == 0
    (repo / "mlp_jit" / "1").mkdir(parents=True)
    shutil.copy(mlp, repo / "mlp_jit" / "1" / "model.onnx")
    (repo / "mlp_jit" / "config.pbtxt").write_text(
        config.replace('name: "mlp"', 'name: "mlp_jit"')
        + 'parameters { key: "compile_precision_mode" value: { string_value: "allow_fp32_to_fp16" } }\n'
        + 'parameters { key: "compile_dynamic_batch_size" value: { string_value: "1,2,4" } }\n'
    )
    cache = tmp_path / "cache"
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(cache))
    monkeypatch.setenv("GESERVE_MODEL_KEY", KEY_HEX)
    for attempt in ("first", "second"):
        with geserve([repo], tmp_path / f"{attempt}.log") as server:
            reference = _session(mlp).run(None, {"input": np.random.default_rng(4).standard_normal(
                (3, 256), dtype=np.float32)})[0]
            np.testing.assert_allclose(_infer_mlp(server.base, "mlp_gem", 3), reference, rtol=1e-3, atol=1e-4)
            got = _infer_mlp(server.base, "mlp_jit", 3)
            assert np.abs(got - reference).max() < 0.05
            with urllib.request.urlopen(f"{server.base}/v2/models/mlp_gem/config", timeout=10) as response:
                gem_config = json.loads(response.read())
            assert gem_config["parameters"]["batch_gears"]["string_value"] == "1,2,4,8"
            log = server.log()
        entries = sorted(cache.glob("*.gem"))
        assert len(entries) == 1
        if attempt == "first":
            assert "'mlp_jit': compiled" in log
            stamp = entries[0].stat().st_mtime_ns
        else:
            assert "'mlp_jit': compiled" not in log and "'mlp_jit': using cached compiled model" in log
            assert entries[0].stat().st_mtime_ns == stamp
    assert not [p for p in repo.rglob("*") if p.name.endswith(".onnx") and "mlp_gem" in str(p)]
    assert os.environ.get("GESERVE_MODEL_KEY") == KEY_HEX
