"""CPU sessions map one file of prepacked weights (geserve/backends/ge/shared_weights.py): the workers of a server map
the same cache file, answers are unchanged, an encrypted model is never written out, and a cache that cannot be
written only costs the sharing. Real ONNX Runtime sessions and a real server with the real tritonclient."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient

from geserve.backends.ge.shared_weights import PACKED_DATA, PACKED_MODEL, packed_graph
from geserve.compiler import CompileOptions
from geserve.compiler.package import load_key, write_package
from geserve.compiler.pipeline import compile_model
from tests.support import models
from tests.support.server import RunningServer, geserve

KEY_HEX = "22" * 32


@pytest.fixture(scope="module")
def mlp() -> Path:
    return models.example_onnx("mlp")


def _options() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return options


def _run(graph: Path | bytes, rows: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(graph if isinstance(graph, bytes) else str(graph), _options(),
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"input": rows})[0]


def _rows(count: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((count, 256), dtype=np.float32)


def test_a_packed_graph_answers_alike_and_is_packed_once(mlp: Path, tmp_path: Path) -> None:
    packed = packed_graph(mlp, mlp, "level 0", _options, tmp_path)
    assert packed is not None and packed.name == PACKED_MODEL
    data = packed.parent / PACKED_DATA
    assert data.stat().st_size > mlp.stat().st_size  # the prepacked weights are in it, beside the plain ones
    written = data.stat().st_mtime_ns
    assert packed_graph(mlp, mlp, "level 0", _options, tmp_path) == packed and data.stat().st_mtime_ns == written
    np.testing.assert_array_equal(_run(packed, _rows(8)), _run(mlp, _rows(8)))
    assert packed_graph(mlp, mlp, "level 1", _options, tmp_path) != packed  # other graph-shaping options: another entry
    assert not list((tmp_path / "weights").glob("*.partial"))


def test_a_model_rewritten_in_place_is_packed_again_and_stale_entries_go(mlp: Path, tmp_path: Path) -> None:
    model = tmp_path / "model" / "model.onnx"
    model.parent.mkdir()
    shutil.copy(mlp, model)
    cache = tmp_path / "cache"
    first = packed_graph(model, model, "", _options, cache)
    kept = packed_graph(mlp, mlp, "", _options, cache)
    shutil.copy(mlp, model)  # same bytes and size; a new change time
    second = packed_graph(model, model, "", _options, cache)
    assert first is not None and second is not None and kept is not None and first != second
    assert not first.parent.exists() and kept.is_file()  # the entry of the file as it was is gone; others stay
    shutil.rmtree(model.parent)
    packed_graph(mlp, mlp, "other", _options, cache)
    assert not second.parent.exists() and kept.is_file()
    assert (cache / "weights").stat().st_mode & 0o077 == 0  # the weights are the model owner's alone


def _infer(server: RunningServer, model: str, rows: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    try:
        tensor = httpclient.InferInput("input", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        return client.infer(model, [tensor]).as_numpy("logits")
    finally:
        client.close()


def _repository(repo: Path, mlp: Path, name: str, extra: str = "", graph: bytes | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    config = (mlp.parents[1] / "config.pbtxt").read_text().replace('name: "mlp"', f'name: "{name}"')
    (repo / name / "config.pbtxt").write_text(config + extra)
    if graph is None:
        shutil.copy(mlp, repo / name / "1" / "model.onnx")
    else:
        (repo / name / "1" / "model.gem").write_bytes(graph)


def _mapped(pid: int, folder: Path) -> set[int]:
    """Inodes of the files under `folder` that process `pid` maps."""
    inodes = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(str(folder)):
            inodes.add(int(fields[4]))
    return inodes


def test_every_worker_maps_the_same_prepacked_weights(
    mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(cache))
    repo = tmp_path / "repo"
    _repository(repo, mlp, "mlp")
    _repository(repo, mlp, "mlp_private", 'parameters { key: "share_weights", value: { string_value: "false" } }\n')
    with geserve([repo], tmp_path / "server.log", ["--workers", "2"]) as server:
        rows = _rows(5)
        expected = _run(mlp, rows)
        for model in ("mlp", "mlp_private"):
            np.testing.assert_allclose(_infer(server, model, rows), expected, rtol=1e-5, atol=1e-6)
        workers = server.children()
        assert len(workers) == 2
        entries = list((cache / "weights").glob(f"*/{PACKED_DATA}"))
        assert len(entries) == 1  # mlp's; mlp_private keeps its copy on the heap
        data = entries[0].stat().st_ino
        assert all(_mapped(pid, cache / "weights") == {data} for pid in workers)


def test_an_encrypted_model_is_never_written_out_and_an_unwritable_cache_costs_only_the_sharing(
    mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest, onnx_bytes = compile_model(CompileOptions(model=mlp))
    key_file = tmp_path / "key"
    key_file.write_text(KEY_HEX)
    sealed = write_package(tmp_path / "sealed.gem", manifest, onnx_bytes, load_key(key_file, env=""))
    plain = write_package(tmp_path / "plain.gem", manifest, onnx_bytes)
    repo = tmp_path / "repo"
    _repository(repo, mlp, "mlp_sealed", graph=sealed.read_bytes())
    cache = tmp_path / "cache"
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(cache))
    monkeypatch.setenv("GESERVE_MODEL_KEY", KEY_HEX)
    rows = _rows(3)
    expected = _run(onnx_bytes, rows)
    with geserve([repo], tmp_path / "sealed.log") as server:
        np.testing.assert_allclose(_infer(server, "mlp_sealed", rows), expected, rtol=1e-5, atol=1e-6)
    assert not list(cache.glob(f"**/{PACKED_DATA}"))
    shutil.rmtree(repo / "mlp_sealed")
    _repository(repo, mlp, "mlp_gem", graph=plain.read_bytes())
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("")
    monkeypatch.setenv("GESERVE_CACHE_DIR", str(blocked))
    with geserve([repo], tmp_path / "blocked.log") as server:
        np.testing.assert_allclose(_infer(server, "mlp_gem", rows), expected, rtol=1e-5, atol=1e-6)
        assert "each session keeps its own copy" in server.log()
