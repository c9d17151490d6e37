"""TLS and mutual TLS on real server processes, with certificates made here (tests/support/certs.py) and the real
clients: tritonclient.http with `ssl=True` and tritonclient.grpc with root / key / chain, over HTTPS, gRPC over
TLS and the metrics port. Each refusal is checked: a client trusting another CA, no client certificate under
mutual TLS, a client certificate from another CA, plaintext on a TLS port (both protocols). SIGHUP rotates the
certificates: a new connection sees the new one while an open keep-alive connection goes on. Under mutual TLS the
client certificate's subject is the caller's identity (a Python model and the audit log see it). Start-up
refuses missing or unusable files with the flag's name. Every client call has a timeout, and every server
listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gevent.ssl
import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve.frontends.http.app import _context
from geserve.frontends.tls import (
    TlsError,
    TlsFiles,
    asgi_tls_extension,
    grpc_auth_context,
    grpc_peer_subject,
    tls_files,
)
from tests.support.certs import Issued, client_context, issue, make_ca
from tests.support.reference import free_port
from tests.support.security import (
    AUDIENCE,
    KeyPair,
    bearer,
    rsa_key,
    simple_inputs,
    whoami_inputs,
    whoami_repository,
)
from tests.support.server import REPO_ROOT, RunningServer, stop_geserve

# geventhttpclient 2.0 (under tritonclient.http) checks the host name with the deprecated ssl.match_hostname.
pytestmark = pytest.mark.filterwarnings("ignore:ssl.match_hostname:DeprecationWarning")
TIMEOUT = 10.0  # seconds any one client call may take
LOCAL = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]


@dataclass
class Pki:
    """A CA, the server's certificate, a client of that CA, and another CA with a client of its own."""

    folder: Path
    ca: Issued
    server: Issued
    alice: Issued
    other_ca: Issued
    mallory: Issued

    def tls_args(self, protocol: str, mutual: bool) -> list[str]:
        assert self.server.cert_path and self.server.key_path and self.ca.cert_path
        args = [f"--{protocol}-use-ssl{'-mutual' if mutual else ''}=true",
                f"--{protocol}-server-cert={self.server.cert_path}", f"--{protocol}-server-key={self.server.key_path}"]
        return [*args, f"--{protocol}-root-cert={self.ca.cert_path}"] if mutual else args


def make_pki(folder: Path) -> Pki:
    ca, other = make_ca("geserve test CA").write(folder, "ca"), make_ca("another CA").write(folder, "other-ca")
    return Pki(
        folder, ca, issue(ca, "geserve server", server=True).write(folder, "server"),
        issue(ca, "alice", server=False, organization="Example Team").write(folder, "alice"),
        other, issue(other, "mallory", server=False).write(folder, "mallory"),
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---- servers -------------------------------------------------------------------------------------------


def _wait_live_https(server: RunningServer, context: ssl.SSLContext, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"geserve exited with {server.process.returncode}:\n{server.log()[-4000:]}")
        try:
            url = f"https://127.0.0.1:{server.http_port}/v2/health/live"
            with urllib.request.urlopen(url, timeout=1, context=context) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"geserve did not come up within {timeout} s:\n{server.log()[-4000:]}")


@contextlib.contextmanager
def tls_geserve(repos: Sequence[Path], log_path: Path, args: Sequence[str], live: ssl.SSLContext
                ) -> Iterator[RunningServer]:
    """`geserve serve` on free ports with `args`, up once HTTPS answers liveness to a client using `live`."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "geserve", "serve", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
               "--metrics-port", str(metrics_port), *LOCAL, *args]
    for repo in repos:
        command += ["--model-repository", str(repo)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=dict(os.environ))
    server = RunningServer(process, http_port, log_path, grpc_port, metrics_port)
    try:
        _wait_live_https(server, live)
        yield server
    finally:
        stop_geserve(server)


@pytest.fixture(scope="module")
def whoami_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return whoami_repository(tmp_path_factory.mktemp("whoami") / "models")


@pytest.fixture(scope="module")
def jwt_key() -> KeyPair:
    return rsa_key()


@pytest.fixture(scope="module")
def mutual(pki: Pki, jwt_key: KeyPair, good_repo: Path, whoami_repo: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RunningServer]:
    """Mutual TLS on HTTP (and so metrics) and gRPC, bearer tokens on (the certificate stands in for a token) and an
    audit log."""
    folder = tmp_path_factory.mktemp("mutual")
    (folder / "jwt.pem").write_bytes(jwt_key.public_pem)
    args = [*pki.tls_args("http", mutual=True), *pki.tls_args("grpc", mutual=True),
            f"--auth-jwt-public-key={folder / 'jwt.pem'}", f"--auth-jwt-audience={AUDIENCE}",
            f"--audit-log={folder / 'audit.log'}"]
    alice = client_context(pki.ca, pki.alice)
    with tls_geserve([good_repo, whoami_repo], folder / "geserve.log", args, alice) as server:
        yield server


# ---- clients -------------------------------------------------------------------------------------------


def gevent_context(ca: Issued, client: Issued | None = None) -> gevent.ssl.SSLContext:
    """tritonclient.http runs on gevent: its ssl_context_factory must make gevent's SSLContext."""
    context = gevent.ssl.create_default_context(cadata=ca.cert_pem.decode())
    if client is not None:
        context.load_cert_chain(str(client.cert_path), str(client.key_path))
    return context


def https_client(server: RunningServer, ca: Issued, client: Issued | None = None) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(
        f"127.0.0.1:{server.http_port}", ssl=True, ssl_context_factory=lambda: gevent_context(ca, client),
        connection_timeout=TIMEOUT, network_timeout=TIMEOUT,
    )


def grpc_tls_client(server: RunningServer, ca: Issued, client: Issued | None = None
                    ) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        f"localhost:{server.grpc_port}", ssl=True, root_certificates=str(ca.cert_path),
        private_key=str(client.key_path) if client else None,
        certificate_chain=str(client.cert_path) if client else None,
    )


def check_simple(result: Any) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a)


def raw_https(port: int, context: ssl.SSLContext, request: bytes = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n"
              ) -> bytes:
    """One request on a fresh TLS connection; what came back (a refusal raises from the handshake or the read)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock, \
            context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
        tls.sendall(request)
        return tls.recv(65536)


def plaintext_answer(port: int, payload: bytes) -> bytes:
    """What a plaintext client gets from a TLS port: everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(payload)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
        return received


def served_serial(port: int, ca: Issued, client: Issued | None = None, alpn: str | None = None) -> int:
    """The serial number of the certificate the server presents to a new connection."""
    context = client_context(ca, client)
    if alpn:
        context.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock, \
            context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
        return int(tls.getpeercert()["serialNumber"], 16)


# ---- mutual TLS: the real clients work, and see the right identity -----------------------------------------


def test_tritonclient_http_over_mutual_tls(pki: Pki, mutual: RunningServer) -> None:
    client = https_client(mutual, pki.ca, pki.alice)
    try:
        assert client.is_server_live()
        assert client.is_model_ready("simple")
        check_simple(client.infer("simple", simple_inputs(httpclient)))
        # One connection carried those calls: the subject is read once per connection and still applies.
        result = client.infer("whoami", whoami_inputs(httpclient))
        assert result.as_numpy("WHO")[0] == pki.alice.subject.encode() == b"CN=alice,O=Example Team"
    finally:
        client.close()


def test_tritonclient_grpc_over_mutual_tls(pki: Pki, mutual: RunningServer) -> None:
    # One gRPC server for cleartext and TLS: the native one, not grpc.aio (tests/test_grpc_tls.py compares them).
    # With workers, each serves the connections the supervisor accepts: TLS is the worker's, on the native server.
    assert "started GRPCInferenceService (native HTTP/2, mutual TLS) on the connections handed" in mutual.log()
    with grpc_tls_client(mutual, pki.ca, pki.alice) as client:
        assert client.is_server_live(client_timeout=TIMEOUT)
        check_simple(client.infer("simple", simple_inputs(grpcclient), client_timeout=TIMEOUT))
        result = client.infer("whoami", whoami_inputs(grpcclient), client_timeout=TIMEOUT)
        assert result.as_numpy("WHO")[0] == b"CN=alice,O=Example Team"


def test_the_certificate_stands_in_for_a_token(pki: Pki, jwt_key: KeyPair, mutual: RunningServer) -> None:
    """Bearer tokens are on: a call without one is admitted as the certificate's subject, and audited as such; a
    token, when sent, decides."""
    with grpc_tls_client(mutual, pki.ca, pki.alice) as client:
        client.get_model_repository_index(client_timeout=TIMEOUT)  # audited (model-repository group)
        token = bearer(jwt_key.token(scope="inference"))
        result = client.infer("whoami", whoami_inputs(grpcclient), headers=token, client_timeout=TIMEOUT)
        assert result.as_numpy("WHO")[0] == b"alice"  # the token's `sub`, not the certificate's subject
    client = https_client(mutual, pki.ca, pki.alice)
    try:
        assert client.infer("whoami", whoami_inputs(httpclient), headers=token).as_numpy("WHO")[0] == b"alice"
    finally:
        client.close()
    audit = (mutual.log_path.parent / "audit.log").read_text().splitlines()
    lines = [json.loads(line) for line in audit if '"repository_index"' in line]
    assert lines, audit
    assert lines[-1]["identity"] == "CN=alice,O=Example Team" and lines[-1]["protocol"] == "grpc"


def test_metrics_over_mutual_tls(pki: Pki, mutual: RunningServer) -> None:
    url = f"https://127.0.0.1:{mutual.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=TIMEOUT, context=client_context(pki.ca, pki.alice)) as response:
        assert response.status == 200
        assert b"nv_inference_count" in response.read()
    with pytest.raises((ssl.SSLError, ConnectionResetError, urllib.error.URLError)):  # no client certificate
        urllib.request.urlopen(url, timeout=TIMEOUT, context=client_context(pki.ca)).read()


# ---- mutual TLS: refusals --------------------------------------------------------------------------------


def _refused_on_read(port: int, context: ssl.SSLContext) -> None:
    """Under TLS 1.3 the client's handshake can end before the server has checked the client's certificate: the
    server's refusal (an alert) then arrives on the first read. Either way no HTTP answer comes back."""
    try:
        answer = raw_https(port, context)
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as exc:
        assert "certificate" in str(exc).lower() or "unknown ca" in str(exc).lower() or isinstance(
            exc, (ConnectionResetError, BrokenPipeError)), exc
    else:
        assert answer == b"", answer


@pytest.mark.parametrize("port_of", ["http", "metrics"])
def test_https_refusals(pki: Pki, mutual: RunningServer, port_of: str) -> None:
    port = mutual.http_port if port_of == "http" else mutual.metrics_port
    assert raw_https(port, client_context(pki.ca, pki.alice)).startswith(b"HTTP/1.1 ")  # the control
    # The client trusts another CA: it refuses the server's certificate itself.
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        raw_https(port, client_context(pki.other_ca, pki.alice))
    _refused_on_read(port, client_context(pki.ca))  # no client certificate
    _refused_on_read(port, client_context(pki.ca, pki.mallory))  # a client certificate from another CA
    # Plaintext HTTP on the TLS port: never an HTTP answer, and the connection closes.
    answer = plaintext_answer(port, b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n")
    assert not answer.startswith(b"HTTP/"), answer
    # The server still serves after the refusals.
    assert raw_https(port, client_context(pki.ca, pki.alice)).startswith(b"HTTP/1.1 ")


def test_tritonclient_http_refusals(pki: Pki, mutual: RunningServer) -> None:
    for ca, client in ((pki.other_ca, pki.alice), (pki.ca, None), (pki.ca, pki.mallory)):
        triton = https_client(mutual, ca, client)
        try:
            with pytest.raises(Exception):  # noqa: B017 - gevent's ssl errors, or a reset: anything but an answer
                triton.is_server_live()
        finally:
            triton.close()
    plain = httpclient.InferenceServerClient(f"127.0.0.1:{mutual.http_port}", connection_timeout=TIMEOUT,
                                             network_timeout=TIMEOUT)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the server closes a connection that does not speak TLS
            plain.is_server_live()
    finally:
        plain.close()


@pytest.mark.parametrize("case", ["no client certificate", "client of another CA", "client trusts another CA",
                                  "plaintext"])
def test_grpc_refusals(pki: Pki, mutual: RunningServer, case: str) -> None:
    if case == "plaintext":
        client = grpcclient.InferenceServerClient(f"localhost:{mutual.grpc_port}")
    else:
        ca, who = {"no client certificate": (pki.ca, None), "client of another CA": (pki.ca, pki.mallory),
                   "client trusts another CA": (pki.other_ca, pki.alice)}[case]
        client = grpc_tls_client(mutual, ca, who)
    with client, pytest.raises(InferenceServerException) as refused:
        client.is_server_live(client_timeout=TIMEOUT)
    assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value


def test_grpc_plaintext_channel_on_a_tls_port(mutual: RunningServer) -> None:
    """The same with plain grpc: the handshake never completes, the call fails UNAVAILABLE."""
    with grpc.insecure_channel(f"127.0.0.1:{mutual.grpc_port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- one-way TLS and rotation on SIGHUP -------------------------------------------------------------------


@pytest.fixture
def rotating(good_repo: Path, tmp_path: Path) -> Iterator[tuple[RunningServer, Pki]]:
    """One-way TLS on HTTP, metrics and gRPC, from files a test may replace."""
    pki = make_pki(tmp_path / "pki")
    args = [*pki.tls_args("http", mutual=False), *pki.tls_args("grpc", mutual=False)]
    with tls_geserve([good_repo], tmp_path / "geserve.log", args, client_context(pki.ca)) as server:
        yield server, pki


def _replace_server_certificate(pki: Pki, common_name: str = "geserve server, rotated") -> Issued:
    assert pki.server.cert_path and pki.server.key_path
    fresh = issue(pki.ca, common_name, server=True)
    # As an operator would: new files written beside, then renamed over the old ones.
    for data, path in ((fresh.key_pem, pki.server.key_path), (fresh.cert_pem, pki.server.cert_path)):
        path.with_suffix(".new").write_bytes(data)
        path.with_suffix(".new").replace(path)
    return fresh


def _eventually(check: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def test_one_way_tls_needs_no_client_certificate(rotating: tuple[RunningServer, Pki]) -> None:
    server, pki = rotating
    assert "started GRPCInferenceService (native HTTP/2, TLS) on the connections handed" in server.log()
    client = https_client(server, pki.ca)
    try:
        check_simple(client.infer("simple", simple_inputs(httpclient)))
    finally:
        client.close()
    with grpc_tls_client(server, pki.ca) as grpc_client:
        check_simple(grpc_client.infer("simple", simple_inputs(grpcclient), client_timeout=TIMEOUT))
    with urllib.request.urlopen(f"https://127.0.0.1:{server.metrics_port}/metrics", timeout=TIMEOUT,
                                context=client_context(pki.ca)) as response:
        assert response.status == 200


def test_sighup_rotates_certificates_without_dropping_connections(rotating: tuple[RunningServer, Pki]) -> None:
    server, pki = rotating
    old = pki.server.certificate.serial_number
    ports = {"http": (server.http_port, None), "metrics": (server.metrics_port, None), "grpc": (server.grpc_port, "h2")}
    for name, (port, alpn) in ports.items():
        assert served_serial(port, pki.ca, alpn=alpn) == old, name
    # Connections open before the rotation: an HTTPS keep-alive connection and a gRPC channel.
    kept = http.client.HTTPSConnection("127.0.0.1", server.http_port, timeout=TIMEOUT, context=client_context(pki.ca))
    kept.request("GET", "/v2/health/ready")
    assert kept.getresponse().read() == b"" and kept.sock is not None
    grpc_client = grpc_tls_client(server, pki.ca)
    assert grpc_client.is_server_live(client_timeout=TIMEOUT)

    fresh = _replace_server_certificate(pki)
    assert fresh.certificate.serial_number != old
    server.process.send_signal(signal.SIGHUP)
    new = fresh.certificate.serial_number
    for name, (port, alpn) in ports.items():
        _eventually(lambda port=port, alpn=alpn: served_serial(port, pki.ca, alpn=alpn) == new,
                    f"{name} serves the new certificate")

    # The connections made before go on, on the certificate they were made with.
    assert int(kept.sock.getpeercert()["serialNumber"], 16) == old
    kept.request("POST", "/v2/models/simple/infer", body=json.dumps(_SIMPLE_BODY),
                 headers={"content-type": "application/json"})
    answer = kept.getresponse()
    assert answer.status == 200
    assert json.loads(answer.read())["outputs"][0]["data"] == [2 * i for i in range(16)]
    kept.close()
    assert grpc_client.is_server_live(client_timeout=TIMEOUT)
    check_simple(grpc_client.infer("simple", simple_inputs(grpcclient), client_timeout=TIMEOUT))
    grpc_client.close()
    assert server.process.poll() is None
    assert "TLS certificate reloaded" in server.log()


def test_a_broken_rotation_keeps_the_current_certificate(rotating: tuple[RunningServer, Pki]) -> None:
    server, pki = rotating
    old = pki.server.certificate.serial_number
    assert pki.server.key_path is not None
    pki.server.key_path.write_bytes(issue(pki.ca, "someone else", server=True).key_pem)  # not the cert's key
    server.process.send_signal(signal.SIGHUP)
    _eventually(lambda: server.log().count("TLS certificate not reloaded") >= 3, "three refusals logged")
    assert "is not the private key of the certificate" in server.log()
    assert served_serial(server.http_port, pki.ca) == old
    assert served_serial(server.grpc_port, pki.ca, alpn="h2") == old
    assert raw_https(server.http_port, client_context(pki.ca)).startswith(b"HTTP/1.1 200")


_SIMPLE_BODY = {"inputs": [{"name": name, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                           for name in ("INPUT0", "INPUT1")]}


# ---- uvicorn ------------------------------------------------------------------------------------------------


def test_uvicorn_serves_mutual_tls_and_rotates(pki: Pki, good_repo: Path, whoami_repo: Path, tmp_path: Path) -> None:
    local = make_pki(tmp_path / "pki")
    args = ["--http-server", "uvicorn", "--allow-grpc=false", "--allow-metrics=false", *local.tls_args("http", True)]
    alice = client_context(local.ca, local.alice)
    with tls_geserve([good_repo, whoami_repo], tmp_path / "geserve.log", args, alice) as server:
        client = https_client(server, local.ca, local.alice)
        try:
            check_simple(client.infer("simple", simple_inputs(httpclient)))
            assert client.infer("whoami", whoami_inputs(httpclient)).as_numpy("WHO")[0] == b"CN=alice,O=Example Team"
        finally:
            client.close()
        _refused_on_read(server.http_port, client_context(local.ca))
        _refused_on_read(server.http_port, client_context(local.ca, pki.mallory))
        fresh = _replace_server_certificate(local)
        server.process.send_signal(signal.SIGHUP)
        _eventually(lambda: served_serial(server.http_port, local.ca, local.alice) == fresh.certificate.serial_number,
                    "uvicorn serves the new certificate")
        assert raw_https(server.http_port, alice).startswith(b"HTTP/1.1 200")


# ---- start-up errors ------------------------------------------------------------------------------------------


def test_startup_errors_name_the_flag_and_the_file(pki: Pki, good_repo: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(good_repo), *LOCAL,
               "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    result = subprocess.run([*command, "--grpc-use-ssl"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 1
    assert "error: creating server: --grpc-use-ssl needs --grpc-server-cert and --grpc-server-key" in result.stderr
    result = subprocess.run([*command, "--http-use-ssl", f"--http-server-cert={missing}",
                             f"--http-server-key={pki.server.key_path}"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 1
    assert f"--http-server-cert: cannot read '{missing}': No such file or directory" in result.stderr


def test_tls_settings_are_checked(pki: Pki, tmp_path: Path) -> None:
    cert, key, root = str(pki.server.cert_path), str(pki.server.key_path), str(pki.ca.cert_path)
    assert tls_files("--grpc", False, False, cert, key, root) is None
    assert tls_files("--grpc", True, False, cert, key, "") == TlsFiles(cert, key, "", False, "--grpc")
    # Mutual overrides plain, and needs the root.
    assert tls_files("--grpc", True, True, cert, key, root) == TlsFiles(cert, key, root, True, "--grpc")
    with pytest.raises(TlsError, match=r"^--grpc-use-ssl-mutual needs --grpc-root-cert"):
        tls_files("--grpc", False, True, cert, key, "")
    with pytest.raises(TlsError, match=r"^--http-use-ssl needs --http-server-key"):
        tls_files("--http", True, False, cert, "", "")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsError, match=r"^--http-server-cert: '.*garbage.pem' holds no PEM certificate"):
        tls_files("--http", True, False, str(garbage), key, "")
    with pytest.raises(TlsError, match=r"^--http-server-key: '.*garbage.pem' holds no usable"):
        tls_files("--http", True, False, cert, str(garbage), "")
    with pytest.raises(TlsError, match=r"^--http-root-cert: '.*garbage.pem' holds no PEM certificate"):
        tls_files("--http", True, True, cert, key, str(garbage))
    with pytest.raises(TlsError, match="is not the private key of the certificate"):
        tls_files("--http", True, False, cert, str(pki.alice.key_path), "")
    unreadable = tmp_path / "unreadable.pem"
    unreadable.write_bytes(pki.server.key_pem)
    unreadable.chmod(0)
    if os.geteuid() != 0:  # root reads it all the same
        with pytest.raises(TlsError, match=r"^--grpc-server-key: cannot read '.*unreadable.pem': Permission denied"):
            tls_files("--grpc", True, False, cert, str(unreadable), "")


# ---- the identity, unit by unit ----------------------------------------------------------------------------------


class _FakeSslObject:
    def __init__(self, der: bytes | None) -> None:
        self._der = der

    def getpeercert(self, binary_form: bool = False) -> bytes | None:
        assert binary_form
        return self._der

    def version(self) -> str:
        return "TLSv1.3"


class _FakeTransport:
    def __init__(self, der: bytes | None) -> None:
        self._ssl = _FakeSslObject(der)

    def get_extra_info(self, name: str) -> Any:
        return self._ssl if name == "ssl_object" else None


def test_the_client_certificate_reaches_the_call_context(pki: Pki) -> None:
    from cryptography.hazmat.primitives import serialization

    der = pki.alice.certificate.public_bytes(serialization.Encoding.DER)
    extension = asgi_tls_extension(_FakeTransport(der), mutual=True)
    assert extension["client_cert_name"] == "CN=alice,O=Example Team" and extension["tls_version"] == 0x0304
    assert extension["client_cert_chain"] == [ssl.DER_cert_to_PEM_cert(der)]
    client = ("127.0.0.1", 5)
    assert _context(client, {}, {"tls": extension}).peer_certificate_subject == "CN=alice,O=Example Team"
    assert _context(client, {}, {}).peer_certificate_subject is None  # plain HTTP
    assert _context(client, {}, None).peer_certificate_subject is None  # the native server's plain HTTP
    one_way = asgi_tls_extension(_FakeTransport(None), mutual=False)
    assert one_way["client_cert_name"] is None
    assert _context(client, {}, {"tls": one_way}).peer_certificate_subject is None
    assert grpc_peer_subject({"x509_pem_cert": [pki.alice.cert_pem]}) == "CN=alice,O=Example Team"
    assert grpc_peer_subject({"transport_security_type": [b"insecure"]}) is None
    # The native gRPC server's auth context, as gRPC core names it: the same subject comes out of it.
    assert grpc_peer_subject(grpc_auth_context(_FakeTransport(der))) == "CN=alice,O=Example Team"
    assert grpc_auth_context(_FakeTransport(der))["x509_pem_cert"] == [ssl.DER_cert_to_PEM_cert(der).encode()]
    assert grpc_auth_context(_FakeTransport(None)) == {"transport_security_type": [b"ssl"]}  # one-way TLS
    assert grpc_auth_context(None) == {}  # cleartext


def test_many_refused_handshakes_leak_nothing(pki: Pki, mutual: RunningServer) -> None:
    """Every refused handshake gives back its descriptor and its place under the connection cap."""
    fds = Path(f"/proc/{mutual.process.pid}/fd")
    raw_https(mutual.http_port, client_context(pki.ca, pki.alice))
    before = len(list(fds.iterdir()))
    for _ in range(30):
        _refused_on_read(mutual.http_port, client_context(pki.ca))
        plaintext_answer(mutual.http_port, b"\x00" * 64)
    _eventually(lambda: len(list(fds.iterdir())) <= before + 2, "the refused connections' descriptors are closed")
    assert raw_https(mutual.http_port, client_context(pki.ca, pki.alice)).startswith(b"HTTP/1.1 200")

