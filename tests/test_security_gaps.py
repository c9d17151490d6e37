"""What the security work left open, each closed and checked here on real frontends and clients:

- the standard `grpc.health.v1.Health` asks for readiness with the call's own context, so a restricted or
  protected health group treats it as it treats `ServerReady` (the header, the token, the scope), with the same
  statuses and words, instead of failing with UNKNOWN;
- an ensemble's steps carry the caller's identity to the Python models they run;
- an inference call is admitted before its body is read or decoded (HTTP and gRPC), once, and the order of the
  faults a client sees is otherwise Triton's (an unknown model is 404 whatever the body).
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve import Server, ServerSettings
from geserve.errors import UnavailableError
from geserve.frontends.grpc import converters
from geserve.frontends.grpc.health import SERVING, HealthCheckRequest, HealthCheckResponse
from geserve.frontends.http import app as http_app
from geserve.service.context import ApiGroup, CallContext
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
from tests.support.server import RunningServer, geserve

HEALTH_SECRET = "health-s3cret"


@pytest.fixture(scope="module")
def key() -> KeyPair:
    return rsa_key()


def _run_in_process(settings: ServerSettings, body: Callable[[], Any], policies: list[Any] | None = None) -> None:
    """Start an in-process server, run the blocking `body` (real clients) on a worker thread, stop the server."""

    async def run() -> None:
        server = Server(settings, policies=policies or [])
        await server.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, body)
        finally:
            await server.stop()

    asyncio.run(run())


def _settings(good_repo: Path, **overrides: Any) -> ServerSettings:
    return ServerSettings(model_repositories=[good_repo], http_port=free_port(), grpc_port=free_port(),
                          allow_metrics=False, http_address="127.0.0.1", grpc_address="127.0.0.1", **overrides)


# ---- grpc.health.v1 under the health group's rules -------------------------------------------------------------


def test_standard_grpc_health_follows_the_health_groups_rules(good_repo: Path, tmp_path: Path, key: KeyPair) -> None:
    (tmp_path / "public.pem").write_bytes(key.public_pem)
    settings = _settings(good_repo, grpc_restricted_protocol=[f"health:hkey={HEALTH_SECRET}"],
                         auth_jwt_public_key=str(tmp_path / "public.pem"), auth_jwt_audience=AUDIENCE,
                         auth_protect_health=True)
    header = ("triton-grpc-protocol-hkey", HEALTH_SECRET)

    def body() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check", HealthCheckRequest.SerializeToString,
                                        HealthCheckResponse.FromString)
            watch = channel.unary_stream("/grpc.health.v1.Health/Watch", HealthCheckRequest.SerializeToString,
                                         HealthCheckResponse.FromString)
            refusals = [
                ((), grpc.StatusCode.UNAVAILABLE,
                 "This protocol is restricted, expecting header 'triton-grpc-protocol-hkey'"),
                ((header,), grpc.StatusCode.UNAUTHENTICATED, "This API requires a bearer token"),
                ((header, ("authorization", f"Bearer {key.token(scope='inference')}")),
                 grpc.StatusCode.PERMISSION_DENIED, "the token's scopes do not include 'health'"),
            ]
            for metadata, code, words in refusals:
                for call in (check, lambda *a, **k: next(iter(watch(*a, **k)))):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(HealthCheckRequest(), metadata=metadata, timeout=10)
                    assert refused.value.code() == code, (metadata, refused.value)
                    assert (refused.value.details() or "").startswith(words), refused.value.details()
            allowed = (header, ("authorization", f"Bearer {key.token(scope='health')}"))
            assert check(HealthCheckRequest(), metadata=allowed, timeout=10).status == SERVING
            stream = watch(HealthCheckRequest(service="inference.GRPCInferenceService"), metadata=allowed, timeout=10)
            assert next(iter(stream)).status == SERVING
            stream.cancel()

    _run_in_process(settings, body)


# ---- the caller's identity through an ensemble ------------------------------------------------------------------

WHO_ENSEMBLE = """name: "who_ensemble"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "WHO" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "whoami" model_version: -1
  input_map { key: "IN" value: "IN" }
  output_map { key: "WHO" value: "WHO" }
} ] }
"""


@pytest.fixture(scope="module")
def ensemble_server(key: KeyPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("who_ensemble")
    repo = whoami_repository(folder / "models")
    (repo / "who_ensemble" / "1").mkdir(parents=True)
    (repo / "who_ensemble" / "config.pbtxt").write_text(WHO_ENSEMBLE)
    (folder / "public.pem").write_bytes(key.public_pem)
    args = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
            f"--auth-jwt-public-key={folder / 'public.pem'}", f"--auth-jwt-audience={AUDIENCE}"]
    with geserve([repo], folder / "geserve.log", args) as server:
        yield server


def test_ensemble_steps_carry_the_callers_identity(ensemble_server: RunningServer, key: KeyPair) -> None:
    http_client = httpclient.InferenceServerClient(ensemble_server.url)
    grpc_client = grpcclient.InferenceServerClient(ensemble_server.grpc_url)
    try:
        for client, module in ((http_client, httpclient), (grpc_client, grpcclient)):
            token = key.token(sub=f"{module.__name__}@example.test")
            result = client.infer("who_ensemble", whoami_inputs(module), headers=bearer(token))
            assert result.as_numpy("WHO").tolist() == [f"{module.__name__}@example.test".encode()]
    finally:
        http_client.close()
        grpc_client.close()


# ---- admission before decoding --------------------------------------------------------------------------------


class Gate:
    """Records each admitted call's group; refuses inference while `closed`."""

    def __init__(self) -> None:
        self.closed = False
        self.admitted: list[ApiGroup] = []

    def admit(self, group: ApiGroup, context: CallContext) -> None:
        if self.closed and group is ApiGroup.INFERENCE:
            raise UnavailableError("inference is closed by policy")
        self.admitted.append(group)


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_inference_is_admitted_once_before_its_body_is_decoded(
    good_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded = {"http": 0, "grpc": 0}
    http_decode, grpc_decode = http_app.decode_infer_request, converters.from_model_infer_request

    def counted_http(*args: Any, **kwargs: Any) -> Any:
        decoded["http"] += 1
        return http_decode(*args, **kwargs)

    def counted_grpc(*args: Any, **kwargs: Any) -> Any:
        decoded["grpc"] += 1
        return grpc_decode(*args, **kwargs)

    monkeypatch.setattr(http_app, "decode_infer_request", counted_http)
    monkeypatch.setattr(converters, "from_model_infer_request", counted_grpc)
    gate = Gate()
    settings = _settings(good_repo)
    base = f"http://127.0.0.1:{settings.http_port}"

    def body() -> None:
        grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{settings.grpc_port}")
        http_client = httpclient.InferenceServerClient(f"127.0.0.1:{settings.http_port}")
        try:
            # Refused: nothing of the body is decoded, on either protocol.
            gate.closed = True
            status, answer = _post(base + "/v2/models/simple/infer", b'{"inputs": [{"name": "INPUT0"}]')
            assert (status, answer) == (503, b'{"error":"inference is closed by policy"}')
            with pytest.raises(InferenceServerException) as refused:
                grpc_client.infer("simple", simple_inputs(grpcclient))
            assert refused.value.status() == "StatusCode.UNAVAILABLE"
            assert decoded == {"http": 0, "grpc": 0}
            # Admitted: decoded once, admitted once per call.
            gate.closed = False
            for client, module, protocol in ((http_client, httpclient, "http"), (grpc_client, grpcclient, "grpc")):
                gate.admitted.clear()
                result = client.infer("simple", simple_inputs(module))
                assert result.as_numpy("OUTPUT0").tolist() == [list(range(0, 32, 2))]
                assert gate.admitted == [ApiGroup.INFERENCE], protocol
                assert decoded[protocol] == 1
            # Triton's order of faults, admitted: an unknown model is 404 whatever the body, a bad body of a known
            # model is 400.
            gate.admitted.clear()
            assert _post(base + "/v2/models/nope/infer", b"{not json")[0] == 404
            status, answer = _post(base + "/v2/models/simple/infer", b"{not json")
            assert status == 400, answer
            assert gate.admitted == [ApiGroup.INFERENCE, ApiGroup.INFERENCE]
        finally:
            grpc_client.close()
            http_client.close()

    _run_in_process(settings, body, [gate])
