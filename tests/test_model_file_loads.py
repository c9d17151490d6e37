"""Model files in load requests (Triton's model file override) on real server processes, driven by the real
tritonclient: `load_model(name, config=..., files={"file:1/model.onnx": ...})` over HTTP (base64) and gRPC (bytes)
loads a model that then infers; paths leaving the model's folder, oversized files and malformed values are refused
with a clear 400 / INVALID_ARGUMENT; the repository on disk is never touched; the files serve until the model is
unloaded or loaded again without them; the private folders are the server's own (0700) and go away when nothing
serves from them; with tokens on, only the model-repository scope may load files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from geserve.errors import InvalidArgumentError
from geserve.repository.store import ModelStore
from tests.support import models
from tests.support.security import AUDIENCE, KeyPair, bearer, http, rsa_key
from tests.support.server import RunningServer, geserve

MAX_FILE_BYTES = 64 * 1024
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)
TRAVERSALS = ["file:../x", "file:/abs", "file:1/../../x", "file:1/../1/model.onnx", "file:..", "file:1//model.onnx",
              "file:./1/model.onnx", "file:1/", "file:"]


def _onnx(swapped: bool) -> bytes:
    """`simple`'s graph (OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1), or with the two outputs swapped:
    a model whose answers tell which files it was loaded from."""
    first, second = ("Sub", "Add") if swapped else ("Add", "Sub")
    dims = ["batch", 16]
    graph = helper.make_graph(
        [helper.make_node(first, ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node(second, ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "simple",
        [helper.make_tensor_value_info("INPUT0", TensorProto.INT32, dims),
         helper.make_tensor_value_info("INPUT1", TensorProto.INT32, dims)],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.INT32, dims),
         helper.make_tensor_value_info("OUTPUT1", TensorProto.INT32, dims)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _config(name: str) -> str:
    tensor = {"data_type": "TYPE_INT32", "dims": [16]}
    return json.dumps({
        "name": name, "backend": "onnxruntime", "max_batch_size": 8,
        "input": [{"name": "INPUT0", **tensor}, {"name": "INPUT1", **tensor}],
        "output": [{"name": "OUTPUT0", **tensor}, {"name": "OUTPUT1", **tensor}],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    })


def _inputs(module: Any) -> list[Any]:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(A)
    inputs[1].set_data_from_numpy(B)
    return inputs


def _outputs(client: Any, module: Any, name: str) -> tuple[list[int], list[int]]:
    result = client.infer(name, _inputs(module))
    return result.as_numpy("OUTPUT0").tolist(), result.as_numpy("OUTPUT1").tolist()


ADDS = ((A + B).tolist(), (A - B).tolist())  # the repository's simple
SWAPPED = ((A - B).tolist(), (A + B).tolist())  # the files' simple


def _tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: its content's hash and modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _private_root(tmp: Path) -> Path:
    roots = list(tmp.glob("geserve-model-files-*"))
    assert len(roots) == 1, roots
    return roots[0]


def _eventually(check: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not _checked(check):
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.05)


def _checked(check: Any) -> bool:
    """A check that scans folders the server may be deleting meanwhile: a folder gone mid-scan means look again."""
    try:
        return bool(check())
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("file_loads") / "models"
    models.simple(folder)
    return folder


@pytest.fixture(scope="module")
def server_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's temporary directory (TMPDIR), where its private model folders go."""
    return tmp_path_factory.mktemp("server_tmp")


@pytest.fixture(scope="module")
def server(repo: Path, server_tmp: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    args = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--model-control-mode", "explicit",
            "--load-model", "simple", "--model-load-max-file-bytes", str(MAX_FILE_BYTES)]
    log = tmp_path_factory.mktemp("file_loads_log") / "geserve.log"
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(server_tmp)  # the process inherits it at start
    try:
        running = geserve([repo], log, args)
        server = running.__enter__()
    finally:
        if previous is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = previous
    try:
        yield server
    finally:
        running.__exit__(None, None, None)


@pytest.fixture
def clients(server: RunningServer) -> Iterator[tuple[Any, Any]]:
    """An HTTP and a gRPC client of `server`."""
    http_client = httpclient.InferenceServerClient(server.url)
    grpc_client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        yield http_client, grpc_client
    finally:
        http_client.close()
        grpc_client.close()


def test_a_model_loads_from_the_files_of_the_request_over_http_and_grpc(
    clients: tuple[Any, Any], server_tmp: Path
) -> None:
    http_client, grpc_client = clients
    http_client.load_model("from_http", config=_config("from_http"), files={"file:1/model.onnx": _onnx(True)})
    grpc_client.load_model("from_grpc", config=_config("from_grpc"), files={"file:1/model.onnx": _onnx(True)})
    for name in ("from_http", "from_grpc"):
        assert http_client.is_model_ready(name) and grpc_client.is_model_ready(name)
        assert _outputs(http_client, httpclient, name) == SWAPPED
        assert _outputs(grpc_client, grpcclient, name) == SWAPPED
        assert grpc_client.get_model_config(name).config.name == name
    # The server's own folders: 0700, one per load, the files and the request's config inside.
    root = _private_root(server_tmp)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    folders = {p.name for p in root.glob("load-*/*")}
    assert {"from_http", "from_grpc"} <= folders
    written = next(root.glob("load-*/from_http"))
    assert (written / "1" / "model.onnx").read_bytes() == _onnx(True)
    assert 'name: "from_http"' in (written / "config.pbtxt").read_text()
    for name in ("from_http", "from_grpc"):
        http_client.unload_model(name)
    _eventually(lambda: not any(p.name in ("from_http", "from_grpc") for p in root.glob("load-*/*")))
    # Unloaded, a model that was never in the repository cannot come back without files.
    with pytest.raises(InferenceServerException) as missing:
        http_client.load_model("from_http")
    assert "failed to poll from model repository" in missing.value.message()


def test_files_override_the_repository_until_unloaded_or_loaded_without_them(
    clients: tuple[Any, Any], repo: Path, server_tmp: Path
) -> None:
    http_client, grpc_client = clients
    before = _tree(repo)
    assert _outputs(http_client, httpclient, "simple") == ADDS
    # Loaded again without files: the repository's model again.
    grpc_client.load_model("simple", config=_config("simple"), files={"file:1/model.onnx": _onnx(True)})
    assert _outputs(grpc_client, grpcclient, "simple") == SWAPPED
    http_client.load_model("simple")
    assert _outputs(http_client, httpclient, "simple") == ADDS
    # Unloaded, then loaded without files: the repository's model again.
    http_client.load_model("simple", config=_config("simple"), files={"file:1/model.onnx": _onnx(True)})
    assert _outputs(http_client, httpclient, "simple") == SWAPPED
    http_client.unload_model("simple")
    assert not http_client.is_model_ready("simple")
    http_client.load_model("simple")
    assert _outputs(http_client, httpclient, "simple") == ADDS
    # Another version in the files: the version policy (latest) serves it.
    http_client.load_model("simple", config=_config("simple"),
                           files={"file:1/model.onnx": _onnx(False), "file:2/model.onnx": _onnx(True)})
    assert grpc_client.get_model_metadata("simple").versions == ["2"]
    assert _outputs(http_client, httpclient, "simple") == SWAPPED
    http_client.load_model("simple")
    assert grpc_client.get_model_metadata("simple").versions == ["1"]
    # The repository on disk never changed, and no private folder of simple's is left once nothing serves from it.
    assert _tree(repo) == before
    _eventually(lambda: not list(_private_root(server_tmp).glob("load-*/simple")))


def test_paths_that_leave_the_model_folder_are_refused(clients: tuple[Any, Any], server: RunningServer) -> None:
    http_client, grpc_client = clients
    for key in TRAVERSALS:
        for client in (http_client, grpc_client):
            with pytest.raises(InferenceServerException) as refused:
                client.load_model("sneaky", config=_config("sneaky"), files={key: b"x"})
            assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (key, refused.value)
            assert f"Invalid file parameter '{key}'" in refused.value.message(), refused.value.message()
    with pytest.raises(InferenceServerException) as refused:
        http_client.load_model("sneaky", config=_config("sneaky"), files={"file:../x": b"x"})
    assert refused.value.message() == (
        "Invalid file parameter 'file:../x' with normalized path '../x' must stay within model directory."
    )
    # A file in the way of a folder (the one way left to make a path go elsewhere), in both orders.
    for files in ({"file:1": b"x", "file:1/model.onnx": _onnx(True)},
                  {"file:1/model.onnx": _onnx(True), "file:1": b"x"}):
        with pytest.raises(InferenceServerException) as refused:
            http_client.load_model("sneaky", config=_config("sneaky"), files=files)
        assert refused.value.status() == "400"
        assert "Invalid file parameter 'file:1" in refused.value.message()
    # A model name cannot leave the private folder either (Triton's check, on every load).
    for name in ("..", "a/../b", " "):
        stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
        request = service_pb2.RepositoryModelLoadRequest(model_name=name)
        request.parameters["config"].string_param = _config("x")
        request.parameters["file:1/model.onnx"].bytes_param = _onnx(True)
        with pytest.raises(grpc.RpcError) as caught:
            stub.RepositoryModelLoad(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "model name" in (caught.value.details() or "")
    assert not http_client.is_model_ready("sneaky")


def test_oversized_files_are_refused_before_they_are_decoded(clients: tuple[Any, Any]) -> None:
    http_client, grpc_client = clients
    big = {"file:1/model.onnx": _onnx(True), "file:1/padding.bin": bytes(MAX_FILE_BYTES)}
    total = sum(len(v) for v in big.values())
    for client in (http_client, grpc_client):
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("big", config=_config("big"), files=big)
        assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        assert refused.value.message() == (
            f"the model files of the load request for 'big' are {total} bytes, more than the {MAX_FILE_BYTES} bytes "
            f"--model-load-max-file-bytes allows"
        )
    assert not http_client.is_model_ready("big")
    # Right at the limit passes.
    fits = {"file:1/model.onnx": _onnx(True),
            "file:1/padding.bin": bytes(MAX_FILE_BYTES - len(_onnx(True)))}
    http_client.load_model("big", config=_config("big"), files=fits)
    assert _outputs(http_client, httpclient, "big") == SWAPPED
    http_client.unload_model("big")


def test_malformed_load_requests(clients: tuple[Any, Any], server: RunningServer) -> None:
    http_client, _ = clients
    path = "/v2/repository/models/bad/load"
    onnx_text = base64.b64encode(_onnx(True)).decode()
    cases = [
        ({"file:1/model.onnx": onnx_text}, "Load parameter 'config' must be specified for model file override"),
        ({"config": _config("bad"), "file:1/model.onnx": "not base64!"},
         "File parameter 'file:1/model.onnx' is not valid base64"),
        ({"config": _config("bad"), "file:1/model.onnx": 12}, "File parameter 'file:1/model.onnx' must have a base64"),
        ({"config": {"name": "bad"}, "file:1/model.onnx": onnx_text},
         "Config parameter 'config' must have string type for its value"),
        ({"config": "{not json", "file:1/model.onnx": onnx_text}, "failed to parse the 'config' parameter"),
    ]
    for parameters, words in cases:
        answer = http(server.base, path, body={"parameters": parameters})
        assert answer.status == 400, (parameters.keys(), answer)
        assert answer.json()["error"].startswith(words) or words in answer.json()["error"], answer.json()
    # gRPC: a file in a string parameter is refused with Triton's words.
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
    request = service_pb2.RepositoryModelLoadRequest(model_name="bad")
    request.parameters["config"].string_param = _config("bad")
    request.parameters["file:1/model.onnx"].string_param = onnx_text
    with pytest.raises(grpc.RpcError) as caught:
        stub.RepositoryModelLoad(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "File parameter 'file:1/model.onnx' must have bytes type for its value"
    # Files that are no model: the load fails as any load does, and the model is not served.
    with pytest.raises(InferenceServerException) as failed:
        http_client.load_model("bad", config=_config("bad"), files={"file:1/model.onnx": b"not onnx"})
    assert "load failed for model 'bad'" in failed.value.message()
    assert not http_client.is_model_ready("bad")


def test_a_failed_reload_from_files_keeps_the_served_files(clients: tuple[Any, Any], server_tmp: Path) -> None:
    http_client, _ = clients
    http_client.load_model("kept", config=_config("kept"), files={"file:1/model.onnx": _onnx(True)})
    with pytest.raises(InferenceServerException):
        http_client.load_model("kept", config=_config("kept"), files={"file:1/model.onnx": b"broken"})
    # Version 1 from the first files still serves, and its folder is still there.
    assert _outputs(http_client, httpclient, "kept") == SWAPPED
    folders = list(_private_root(server_tmp).glob("load-*/kept"))
    assert any((f / "1" / "model.onnx").is_file() and (f / "1" / "model.onnx").read_bytes() == _onnx(True)
               for f in folders)
    http_client.unload_model("kept")
    _eventually(lambda: not list(_private_root(server_tmp).glob("load-*/kept")))


@pytest.fixture(scope="module")
def key() -> KeyPair:
    return rsa_key()


def test_only_the_model_repository_scope_loads_files(
    repo: Path, key: KeyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "public.pem").write_bytes(key.public_pem)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    args = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--model-control-mode", "explicit",
            f"--auth-jwt-public-key={tmp_path / 'public.pem'}", f"--auth-jwt-audience={AUDIENCE}",
            f"--audit-log={tmp_path / 'audit.log'}"]
    files = {"file:1/model.onnx": _onnx(True)}
    with geserve([repo], tmp_path / "geserve.log", args) as server:
        http_client = httpclient.InferenceServerClient(server.url)
        grpc_client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            for scope, http_status, grpc_status in (
                (None, "401", "StatusCode.UNAUTHENTICATED"),
                ("inference metadata", "403", "StatusCode.PERMISSION_DENIED"),
            ):
                headers = {} if scope is None else bearer(key.token(scope=scope))
                for client, status in ((http_client, http_status), (grpc_client, grpc_status)):
                    with pytest.raises(InferenceServerException) as refused:
                        client.load_model("scoped", headers=dict(headers), config=_config("scoped"), files=files)
                    assert refused.value.status() == status, (scope, refused.value)
                assert not http_client.is_model_ready("scoped", headers=bearer(key.token(scope="health")))
            admin = key.token(scope="model-repository inference")
            http_client.load_model("scoped", headers=bearer(admin), config=_config("scoped"), files=files)
            result = http_client.infer("scoped", _inputs(httpclient), headers=bearer(admin))
            assert result.as_numpy("OUTPUT0").tolist() == SWAPPED[0]
            grpc_client.load_model("scoped", headers=bearer(admin), config=_config("scoped"), files=files)
            assert list((tmp_path / "tmp").glob("geserve-model-files-*/load-*/scoped"))
        finally:
            http_client.close()
            grpc_client.close()
    assert not list((tmp_path / "tmp").glob("geserve-model-files-*"))  # the server's stop deleted them
    # The audit log tells who loaded what, and never holds the files.
    lines = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    loads = [line for line in lines if line["action"] == "load_model"]
    assert [(line["outcome"], line.get("refused", False)) for line in loads] == [
        ("UNAUTHENTICATED", True), ("UNAUTHENTICATED", True), ("PERMISSION_DENIED", True),
        ("PERMISSION_DENIED", True), ("OK", False), ("OK", False),
    ]
    audit = (tmp_path / "audit.log").read_bytes()
    assert base64.b64encode(_onnx(True)) not in audit and _onnx(True)[:32] not in audit


def test_the_repository_folder_is_never_written(repo: Path) -> None:
    """Whatever the tests above loaded, the repository holds what it was made with."""
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == ["simple", "simple/1", "simple/1/model.onnx",
                                                                          "simple/config.pbtxt"]
    assert onnx.load(str(repo / "simple" / "1" / "model.onnx")).graph.node[0].op_type == "Add"


def test_the_store_checks_containment_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repository's writer does not rely on the service's checks: a path that resolves outside the model's
    folder is refused there too, and a refused load leaves nothing behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = ModelStore([])
    for relative in ("../escape", "1/../../escape", "/abs/escape"):
        with pytest.raises(InvalidArgumentError, match="must stay within model directory"):
            store.write_override("m", {relative: b"x"}, None)
    assert not list(tmp_path.rglob("escape")) and not list(tmp_path.glob("*/load-*"))
    folder = store.write_override("m", {"1/model.onnx": b"x"}, _config("m"))
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "1" / "model.onnx").stat().st_mode) == 0o600
    store.set_override("m", folder)
    assert store.find("m") == folder
    store.remove_overrides()
    assert store.find("m") is None and not list(tmp_path.glob("geserve-model-files-*"))
