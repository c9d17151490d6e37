"""gRPC over TLS on the native HTTP/2 server (frontends/grpc/h2_server.py): one gRPC server for cleartext and TLS,
so TLS no longer moves a deployment onto grpc.aio. The server says which server serves (its start-up line and the
frontend it builds), and a call answers over TLS exactly as over cleartext: the same status codes and messages for
bad requests (grpcio's stubs and the real tritonclient with `ssl=True`), and a deadline acted on by the server at
that moment, the request never running. Certificates are made here (tests/support/certs.py); every server listens
on 127.0.0.1 only and every client call has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from geserve.frontends.grpc.h2_server import NativeGrpcServer
from geserve.frontends.grpc.server import GrpcServer
from geserve.frontends.tls import ReloadsTls
from geserve.server import Server
from geserve.settings import ServerSettings
from tests.support import models
from tests.support.certs import Issued, client_context, issue, make_ca
from tests.support.server import RunningServer, geserve

TIMEOUT = 10.0  # seconds any one client call may take
LOCAL = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
SLOW_CONFIG = ('backend: "python"\nmax_batch_size: 0\n'
               'input [{ name: "IN", data_type: TYPE_FP32, dims: [1] }]\n'
               'output [{ name: "OUT", data_type: TYPE_FP32, dims: [1] }]\n'
               'instance_group [{ kind: KIND_CPU, count: 1 }]\n')
DEADLINE_S = 0.15
SLOW_S = 0.8


@dataclass(frozen=True)
class Certificates:
    ca: Issued
    server: Issued
    alice: Issued

    def grpc_args(self) -> list[str]:
        return ["--grpc-use-ssl-mutual=true", f"--grpc-server-cert={self.server.cert_path}",
                f"--grpc-server-key={self.server.key_path}", f"--grpc-root-cert={self.ca.cert_path}"]

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca.cert_pem, self.alice.key_pem, self.alice.cert_pem)

    def tritonclient(self, server: RunningServer) -> grpcclient.InferenceServerClient:
        """The real tritonclient over TLS: root certificates, and alice's certificate and key."""
        return grpcclient.InferenceServerClient(
            f"localhost:{server.grpc_port}", ssl=True, root_certificates=str(self.ca.cert_path),
            private_key=str(self.alice.key_path), certificate_chain=str(self.alice.cert_path),
        )


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    folder = tmp_path_factory.mktemp("grpc_tls_pki")
    ca = make_ca("geserve gRPC test CA").write(folder, "ca")
    return Certificates(ca, issue(ca, "geserve server", server=True).write(folder, "server"),
                        issue(ca, "alice", server=False, organization="Example Team").write(folder, "alice"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc_tls") / "models"
    models.simple(root)
    models.slow_python(root, "slow", SLOW_CONFIG)
    return root


@pytest.fixture(scope="module")
def cleartext(repo: Path) -> Iterator[RunningServer]:
    with geserve([repo], repo.parent / "cleartext.log", LOCAL) as running:
        yield running


@pytest.fixture(scope="module")
def tls(repo: Path, certificates: Certificates) -> Iterator[RunningServer]:
    """Mutual TLS on gRPC (HTTP stays cleartext, for the statistics), --grpc-server left at its default."""
    with geserve([repo], repo.parent / "tls.log", [*LOCAL, *certificates.grpc_args()]) as running:
        yield running


# ---- which server serves ------------------------------------------------------------------------------------------


def test_tls_is_served_by_the_native_server(tls: RunningServer, cleartext: RunningServer) -> None:
    """No silent switch to grpc.aio: the start-up line names the native server and the TLS it speaks."""
    assert f"started GRPCInferenceService at 127.0.0.1:{tls.grpc_port} (native HTTP/2, mutual TLS)" in tls.log()
    assert f"started GRPCInferenceService at 127.0.0.1:{cleartext.grpc_port} (native HTTP/2)" in cleartext.log()


@pytest.mark.parametrize(("kind", "mutual", "served_by", "speaks"), [
    ("native", False, NativeGrpcServer, "TLS"),
    ("native", True, NativeGrpcServer, "mutual TLS"),
    ("grpcio", True, GrpcServer, None),  # asked for by name: grpc.aio, over TLS too
])
def test_the_server_builds_the_grpc_frontend_asked_for(
    certificates: Certificates, repo: Path, kind: str, mutual: bool, served_by: type, speaks: str | None
) -> None:
    settings = ServerSettings(
        model_repositories=[repo], allow_http=False, allow_metrics=False, grpc_server=kind,
        grpc_use_ssl=not mutual, grpc_use_ssl_mutual=mutual, grpc_server_cert=str(certificates.server.cert_path),
        grpc_server_key=str(certificates.server.key_path), grpc_root_cert=str(certificates.ca.cert_path),
    )
    (frontend,) = Server(settings).frontends
    assert type(frontend) is served_by
    assert isinstance(frontend, ReloadsTls) and frontend.serves_tls  # and so SIGHUP re-reads its certificate
    if speaks is not None:
        assert isinstance(frontend, NativeGrpcServer) and frontend.tls == speaks


def test_tls_speaks_h2_by_alpn(certificates: Certificates, tls: RunningServer) -> None:
    """gRPC clients insist on ALPN h2; over TLS 1.2 only a cipher suite HTTP/2 allows is chosen (RFC 9113 9.2.2)."""
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        context = client_context(certificates.ca, certificates.alice)
        context.maximum_version = version
        context.set_alpn_protocols(["http/1.1", "h2"])
        with socket.create_connection(("127.0.0.1", tls.grpc_port), timeout=TIMEOUT) as sock, \
                context.wrap_socket(sock, server_hostname="localhost") as connection:
            assert connection.selected_alpn_protocol() == "h2"
            assert connection.version() == version.name.replace("v1_", "v1.")
            cipher = connection.cipher()
            assert cipher is not None and ("GCM" in cipher[0] or "CHACHA20" in cipher[0]), cipher


# ---- the same answers over TLS as over cleartext --------------------------------------------------------------------


def outcomes(channel: grpc.Channel) -> list[Any]:
    """What a handful of RPCs answer, successes and failures, in a form two servers can be compared by."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    seen: list[Any] = [stub.ServerLive(pb.ServerLiveRequest(), timeout=TIMEOUT).live,
                       stub.ModelReady(pb.ModelReadyRequest(name="simple"), timeout=TIMEOUT).ready]
    for call in (
        lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="nope"), timeout=TIMEOUT),
        lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="n\u00f6pe \u2603 100%"), timeout=TIMEOUT),
        lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="nope"), timeout=TIMEOUT),
        lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="simple"), timeout=TIMEOUT),  # no inputs
        lambda: stub.ModelInfer(pb.ModelInferRequest(model_name="simple", model_version="x"), timeout=TIMEOUT),
        lambda: channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(b"\xff\xff\xff", timeout=TIMEOUT),
        lambda: channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")(b"", timeout=TIMEOUT),
        lambda: channel.unary_unary("/no.Such/Service")(b"", timeout=TIMEOUT),
        lambda: stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="simple"), timeout=TIMEOUT),
    ):
        with pytest.raises(grpc.RpcError) as failed:
            call()
        seen.append((failed.value.code(), failed.value.details()))
    return seen


def test_bad_requests_get_the_same_status_over_tls(
    certificates: Certificates, tls: RunningServer, cleartext: RunningServer
) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cleartext.grpc_port}") as channel:
        theirs = outcomes(channel)
    with grpc.secure_channel(f"localhost:{tls.grpc_port}", certificates.credentials()) as channel:
        ours = outcomes(channel)
    assert ours == theirs
    assert ours[:2] == [True, True]
    assert ours[2][0] == ours[4][0] == grpc.StatusCode.NOT_FOUND
    assert ours[5][0] == ours[7][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert ours[8][0] == ours[9][0] == grpc.StatusCode.UNIMPLEMENTED


def _refusal(client: grpcclient.InferenceServerClient, model: str) -> tuple[str | None, str]:
    tensor = grpcclient.InferInput("IN", [3], "FP32")  # wrong for both models
    tensor.set_data_from_numpy(np.zeros(3, np.float32))
    with pytest.raises(InferenceServerException) as refused:
        client.infer(model, [tensor], client_timeout=TIMEOUT)
    return refused.value.status(), refused.value.message()


def test_tritonclient_over_tls_is_refused_as_over_cleartext(
    certificates: Certificates, tls: RunningServer, cleartext: RunningServer
) -> None:
    with certificates.tritonclient(tls) as secure, grpcclient.InferenceServerClient(cleartext.grpc_url) as plain:
        assert secure.is_server_live(client_timeout=TIMEOUT)
        for model in ("simple", "slow", "nope"):
            assert _refusal(secure, model) == _refusal(plain, model), model
        assert _refusal(secure, "nope")[0] == "StatusCode.NOT_FOUND"
        assert _refusal(secure, "simple")[0] == "StatusCode.INVALID_ARGUMENT"


def _slow(seconds: float) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.full([1], seconds, np.float32))
    return [tensor]


def _executions(server: RunningServer) -> int:
    with urllib.request.urlopen(f"{server.base}/v2/models/slow/stats", timeout=TIMEOUT) as response:
        return int(json.loads(response.read())["model_stats"][0]["execution_count"])


@pytest.mark.parametrize("transport", ["tls", "cleartext"])
def test_a_deadline_acts_alike_over_tls_and_cleartext(
    request: pytest.FixtureRequest, certificates: Certificates, transport: str
) -> None:
    """A request still queued when its deadline passes is answered DEADLINE_EXCEEDED by the server then, and never
    runs (service/deadlines.py), over TLS as over cleartext."""
    server: RunningServer = request.getfixturevalue(transport)

    def client() -> grpcclient.InferenceServerClient:
        return certificates.tritonclient(server) if transport == "tls" else grpcclient.InferenceServerClient(
            server.grpc_url)

    before = _executions(server)
    with client() as holder, client() as caller:
        busy = threading.Thread(target=lambda: holder.infer("slow", _slow(SLOW_S), client_timeout=TIMEOUT))
        busy.start()  # holds the model's one instance
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as refused:
            caller.infer("slow", _slow(0.0), client_timeout=DEADLINE_S)
        waited = time.monotonic() - started
        busy.join()
    assert refused.value.status() == "StatusCode.DEADLINE_EXCEEDED", refused.value
    assert waited < DEADLINE_S + 0.1, f"answered after {waited:.3f} s"
    time.sleep(0.1)
    assert _executions(server) - before == 1  # only the one that held the instance ran


# ---- refused handshakes ---------------------------------------------------------------------------------------------


def _refused(port: int, context: ssl.SSLContext | None) -> None:
    """A connection the server must refuse: TLS without a client certificate (under TLS 1.3 the refusal, an alert,
    arrives on the first read), or plaintext HTTP/2 on the TLS port. Nothing but the close comes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        if context is None:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(65536):
                    pass
            return
        with contextlib.suppress(ssl.SSLError, ConnectionResetError, BrokenPipeError), \
                context.wrap_socket(sock, server_hostname="localhost") as tls:
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert tls.recv(65536) == b""


def test_refused_handshakes_leak_nothing(certificates: Certificates, tls: RunningServer) -> None:
    """Every refused connection gives its descriptor back, and the server goes on serving."""
    fds = Path(f"/proc/{tls.process.pid}/fd")
    no_certificate = client_context(certificates.ca)
    no_certificate.set_alpn_protocols(["h2"])
    with certificates.tritonclient(tls) as client:
        assert client.is_server_live(client_timeout=TIMEOUT)
        before = len(list(fds.iterdir()))
        for _ in range(20):
            _refused(tls.grpc_port, no_certificate)
            _refused(tls.grpc_port, None)
        deadline = time.monotonic() + TIMEOUT
        while len(list(fds.iterdir())) > before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(fds.iterdir())) <= before + 2
        assert client.is_server_live(client_timeout=TIMEOUT)
