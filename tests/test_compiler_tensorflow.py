"""The TensorFlow front end: real TensorFlow models (built once per module in a child process) compiled with
`geserve compile` and on first load from a Triton TensorFlow repository, served over HTTP and gRPC."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from geserve.cli import main as cli_main
from geserve.compiler import read_package
from tests.support import tf_models
from tests.support.server import RunningServer, geserve

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tf_models.build(tmp_path_factory.mktemp("tf_models"))


def _compile(tmp_path: Path, source: Path, *args: str) -> tuple[int, Path]:
    out = tmp_path / f"{source.name}.gem"
    return cli_main(["compile", "--quiet", "--model", str(source), "--output", str(out), *args]), out


def _run(gem: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    _, onnx_bytes = read_package(gem)
    return ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"]).run(None, feed)


@pytest.mark.parametrize(
    ("source", "args", "names"),
    [
        ("keras_export", (), ("image", "output_0")),  # Keras 3 `model.export`
        ("tf_saved", (), ("inputs", "output_0")),  # tf.saved_model.save
        ("cnn.keras", (), ("image", "probs")),  # Keras file: the layers' names
        ("frozen.pb", ("--input-shape", "image:-1,16,16,3", "--out-nodes", "Identity",
                       "--dynamic-batch-size", "1,2,4"), ("image", "Identity")),
    ],
)
def test_each_tensorflow_format_compiles_to_tensorflows_answers(
    tf_dir: Path, tmp_path: Path, source: str, args: tuple[str, ...], names: tuple[str, str]
) -> None:
    status, gem = _compile(tmp_path, tf_dir / source, *args)
    assert status == 0
    manifest, _ = read_package(gem)
    assert manifest.framework == "tensorflow"
    assert (list(manifest.inputs), list(manifest.outputs)) == ([names[0]], [names[1]])
    x, expected = np.load(tf_dir / "x.npy"), np.load(tf_dir / "y.npy")
    rows = 4 if manifest.batch_gears else 5  # a gear-fixed graph takes a gear's rows
    if manifest.batch_gears:
        assert manifest.batch_gears == [1, 2, 4] and manifest.inputs["image"]["shape"][0] == -1
    np.testing.assert_allclose(_run(gem, {names[0]: x[:rows]})[0], expected[:rows], atol=TOLERANCE, rtol=0)


def test_signature_is_chosen_or_named(tf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tf_dir / "two_signatures"
    assert _compile(tmp_path, source)[0] == 1
    err = capsys.readouterr().err
    assert "no 'serving_default' signature" in err and "double, triple" in err and "--signature" in err
    assert _compile(tmp_path, source, "--signature", "half")[0] == 1
    assert "has no signature 'half'; it has: double, triple" in capsys.readouterr().err
    status, gem = _compile(tmp_path, source, "--signature", "triple")
    assert status == 0
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(_run(gem, {"x": x})[0], 3 * x)


def test_unsupported_op_is_named(tf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, gem = _compile(tmp_path, tf_dir / "svd")
    assert status == 1 and not gem.exists()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unsupported TensorFlow op Svd (node PartitionedCall/Svd)" in err


def test_graphdef_needs_its_tensors(tf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _compile(tmp_path, tf_dir / "frozen.pb")[0] == 1
    assert "needs --input-shape (its inputs) and --out-nodes" in capsys.readouterr().err
    assert _compile(tmp_path, tf_dir / "frozen.pb", "--input-shape", "image:-1,16,16,3", "--out-nodes", "nope")[0] == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err


def _config(name: str, platform: str, output: str, extra: str = "") -> str:
    return (
        f'name: "{name}"\nplatform: "{platform}"\nmax_batch_size: 8\n'
        'input [ { name: "image" data_type: TYPE_FP32 dims: [ 16, 16, 3 ] } ]\n'
        f'output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n'
        'dynamic_batching { }\n' + extra
    )


@pytest.fixture(scope="module")
def tf_server(tf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A Triton TensorFlow repository: SavedModel and GraphDef with configs, and a SavedModel with none."""
    repo = tmp_path_factory.mktemp("tf_repo")
    for name in ("cnn_savedmodel", "cnn_auto"):
        shutil.copytree(tf_dir / "keras_export", repo / name / "1" / "model.savedmodel")
    (repo / "cnn_savedmodel" / "config.pbtxt").write_text(
        _config("cnn_savedmodel", "tensorflow_savedmodel", "output_0",
                'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "serving_default" } }\n'))
    (repo / "cnn_graphdef" / "1").mkdir(parents=True)
    shutil.copy(tf_dir / "frozen.pb", repo / "cnn_graphdef" / "1" / "model.graphdef")
    (repo / "cnn_graphdef" / "config.pbtxt").write_text(_config(
        "cnn_graphdef", "tensorflow_graphdef", "Identity",
        'parameters { key: "compile_dynamic_batch_size" value: { string_value: "1,2,4,8" } }\n'))
    cache = tmp_path_factory.mktemp("tf_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GESERVE_CACHE_DIR", str(cache))
        with geserve([repo], repo.parent / "tf_server.log") as server:
            yield server


@pytest.mark.parametrize(("model", "output"), [
    ("cnn_savedmodel", "output_0"), ("cnn_graphdef", "Identity"), ("cnn_auto", "output_0"),
])
def test_triton_tensorflow_repository_serves_tensorflows_answers(
    tf_server: RunningServer, tf_dir: Path, model: str, output: str
) -> None:
    x, expected = np.load(tf_dir / "x.npy")[:3], np.load(tf_dir / "y.npy")[:3]
    http = httpclient.InferenceServerClient(tf_server.url)
    image = httpclient.InferInput("image", list(x.shape), "FP32")
    image.set_data_from_numpy(x)
    np.testing.assert_allclose(http.infer(model, [image]).as_numpy(output), expected, atol=TOLERANCE, rtol=0)
    grpc = grpcclient.InferenceServerClient(tf_server.grpc_url)
    image = grpcclient.InferInput("image", list(x.shape), "FP32")
    image.set_data_from_numpy(x)
    np.testing.assert_allclose(grpc.infer(model, [image]).as_numpy(output), expected, atol=TOLERANCE, rtol=0)
    grpc.close()
    http.close()


def test_triton_tensorflow_configs_and_log(tf_server: RunningServer) -> None:
    def config(model: str) -> dict:
        with urllib.request.urlopen(f"{tf_server.base}/v2/models/{model}/config", timeout=10) as response:
            return json.loads(response.read())

    saved, graphdef, auto = config("cnn_savedmodel"), config("cnn_graphdef"), config("cnn_auto")
    assert (saved["platform"], saved["backend"], saved["default_model_filename"]) == (
        "tensorflow_savedmodel", "tensorflow", "model.savedmodel")
    assert (graphdef["platform"], graphdef["default_model_filename"]) == ("tensorflow_graphdef", "model.graphdef")
    assert graphdef["parameters"]["batch_gears"]["string_value"] == "1,2,4,8"
    # Auto-completed from the SavedModel's signature, as Triton's TensorFlow backend does.
    assert auto["platform"] == "tensorflow_savedmodel"
    assert [(t["name"], t["dims"]) for t in auto["input"]] == [("image", [16, 16, 3])]
    assert [(t["name"], t["dims"]) for t in auto["output"]] == [("output_0", [4])]
    log = tf_server.log()
    assert "'cnn_graphdef' (platform 'tensorflow_graphdef', converted to ONNX): compiled" in log
