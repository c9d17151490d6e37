"""Bearer tokens (JWT) on a real server process, with tokens signed here by keys made here, driven by the real
clients over HTTP and gRPC: each refusal (no token, expired, forged, another audience or issuer, missing scope)
with its status, header and words; valid tokens pass; health stays open unless protected; the caller's identity
reaches a Python model; a JWK set picks keys by `kid`. The token cache and the mutual-TLS identity are checked on
the policy itself."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve import Server, ServerSettings
from geserve.errors import PermissionDeniedError, UnauthenticatedError
from geserve.service import auth
from geserve.service.context import ApiGroup, CallContext, Transport
from tests.support.reference import free_port
from tests.support.security import (
    AUDIENCE,
    ISSUER,
    SIMPLE_INFER_BODY,
    KeyPair,
    bearer,
    ec_key,
    http,
    rsa_key,
    simple_inputs,
    stream_answer,
    whoami_inputs,
    whoami_repository,
)
from tests.support.server import REPO_ROOT, RunningServer, geserve


@pytest.fixture(scope="module")
def key() -> KeyPair:
    return rsa_key()


@pytest.fixture(scope="module")
def whoami_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return whoami_repository(tmp_path_factory.mktemp("whoami") / "models")


@pytest.fixture(scope="module")
def secured(
    key: KeyPair, good_repo: Path, whoami_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("jwt")
    (folder / "public.pem").write_bytes(key.public_pem)
    args = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1",
            f"--auth-jwt-public-key={folder / 'public.pem'}", f"--auth-jwt-audience={AUDIENCE}",
            f"--auth-jwt-issuer={ISSUER}", "--auth-jwt-leeway-secs=5"]
    with geserve([good_repo, whoami_repo], folder / "geserve.log", args) as server:
        yield server


def _refusals(key: KeyPair) -> dict[str, tuple[str | None, str]]:
    """Tokens that must be refused 401, and the words each is refused with."""
    return {
        "missing": (None, "This API requires a bearer token"),
        "expired": (key.token(lifetime_s=-60), "invalid bearer token: the token has expired"),
        "forged": (rsa_key().token(), "invalid bearer token: the token's signature does not verify"),
        "audience": (key.token(aud="another-service"), "invalid bearer token: the token's audience is not accepted"),
        "issuer": (key.token(iss="https://elsewhere.test"), "invalid bearer token: the token's issuer is not accepted"),
        "no expiry": (key.token(exp=None), "invalid bearer token: the token lacks a required claim (exp)"),
        "not yet": (key.token(nbf=int(time.time()) + 600), "invalid bearer token: the token is not valid yet"),
        "garbage": ("not.a.token", "invalid bearer token: the token is malformed"),
        "unsigned": (_unsigned(), "invalid bearer token"),
    }


def _unsigned() -> str:
    import jwt

    return jwt.encode({"sub": "mallory", "aud": AUDIENCE, "iss": ISSUER, "exp": int(time.time()) + 300,
                       "scope": "inference"}, None, algorithm="none")


def test_http_refusals_are_401_with_www_authenticate(secured: RunningServer, key: KeyPair) -> None:
    for case, (token, words) in _refusals(key).items():
        headers = {} if token is None else bearer(token)
        answer = http(secured.base, "/v2/models/simple/infer", headers, SIMPLE_INFER_BODY)
        assert answer.status == 401, (case, answer)
        assert answer.json()["error"].startswith(words), (case, answer)
        challenge = answer.headers["www-authenticate"]
        if token is None:
            assert challenge == "Bearer"
        else:
            assert challenge.startswith('Bearer error="invalid_token"'), (case, challenge)
        assert token is None or token not in answer.body.decode()
    # Another scheme is no bearer token.
    answer = http(secured.base, "/v2", {"authorization": "Basic YWxpY2U6c2VjcmV0"})
    assert answer.status == 401 and answer.headers["www-authenticate"] == "Bearer"


def test_http_scopes(secured: RunningServer, key: KeyPair) -> None:
    client = httpclient.InferenceServerClient(secured.url)
    try:
        inference_only = key.token(scope="inference")
        result = client.infer("simple", simple_inputs(httpclient), headers=bearer(inference_only))
        assert result.as_numpy("OUTPUT0") is not None
        with pytest.raises(InferenceServerException, match="the token's scopes do not include 'metadata'") as e:
            client.get_model_metadata("simple", headers=bearer(inference_only))
        assert e.value.status() == "403"
        answer = http(secured.base, "/v2/models/simple", bearer(inference_only))
        assert answer.status == 403
        assert answer.headers["www-authenticate"] == 'Bearer error="insufficient_scope", scope="metadata"'
        # `scp` as a list names groups too; unknown names are ignored.
        several = key.token(scope=None, scp=["metadata", "model-config", "admin"])
        assert client.get_model_metadata("simple", headers=bearer(several))["name"] == "simple"
        assert client.get_model_config("simple", headers=bearer(several))["name"] == "simple"
        with pytest.raises(InferenceServerException, match="do not include 'inference'"):
            client.infer("simple", simple_inputs(httpclient), headers=bearer(several))
        with pytest.raises(InferenceServerException, match="do not include 'model-repository'"):
            client.get_model_repository_index(headers=bearer(several))
    finally:
        client.close()


def test_health_stays_open_for_probes(secured: RunningServer) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/simple/ready"):
        assert http(secured.base, path).status == 200, path
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
        with pytest.raises(InferenceServerException) as refused:
            client.get_server_metadata()
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        client.close()


def test_grpc_statuses(secured: RunningServer, key: KeyPair) -> None:
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    try:
        for case, (token, words) in _refusals(key).items():
            headers = {} if token is None else bearer(token)
            with pytest.raises(InferenceServerException) as refused:
                client.infer("simple", simple_inputs(grpcclient), headers=headers)
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED", case
            assert refused.value.message().startswith(words), case
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_repository_index(headers=bearer(key.token(scope="inference metadata")))
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
        assert "the token's scopes do not include 'model-repository'" in refused.value.message()
        result = client.infer("simple", simple_inputs(grpcclient), headers=bearer(key.token()))
        assert result.as_numpy("OUTPUT0") is not None
    finally:
        client.close()


def test_grpc_stream_needs_a_token(secured: RunningServer, key: KeyPair) -> None:
    client = grpcclient.InferenceServerClient(secured.grpc_url)
    try:
        error = stream_answer(client, "simple", simple_inputs(grpcclient))
        assert isinstance(error, InferenceServerException) and error.status() == "StatusCode.UNAUTHENTICATED"
        answer = stream_answer(client, "simple", simple_inputs(grpcclient), bearer(key.token()))
        assert not isinstance(answer, InferenceServerException), answer
        assert answer.as_numpy("OUTPUT0") is not None
    finally:
        client.close()


def test_identity_reaches_a_python_model(secured: RunningServer, key: KeyPair) -> None:
    token = key.token(sub="team-vision@example.test")
    http_client = httpclient.InferenceServerClient(secured.url)
    grpc_client = grpcclient.InferenceServerClient(secured.grpc_url)
    try:  # a fresh headers dict per call: tritonclient.http adds its own to the one it is given
        result = http_client.infer("whoami", whoami_inputs(httpclient), headers=bearer(token))
        assert result.as_numpy("WHO").tolist() == [b"team-vision@example.test"]
        result = grpc_client.infer("whoami", whoami_inputs(grpcclient), headers=bearer(token))
        assert result.as_numpy("WHO").tolist() == [b"team-vision@example.test"]
    finally:
        http_client.close()
        grpc_client.close()


def test_jwks_keys_by_kid(good_repo: Path, whoami_repo: Path, tmp_path: Path) -> None:
    first, second = ec_key("k-1"), rsa_key("k-2")
    jwks = tmp_path / "keys.json"
    jwks.write_text(json.dumps({"keys": [first.jwk(), second.jwk()]}))
    args = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", f"--auth-jwt-jwks={jwks}",
            f"--auth-jwt-audience={AUDIENCE}"]
    with geserve([good_repo, whoami_repo], tmp_path / "geserve.log", args) as server:
        client = httpclient.InferenceServerClient(server.url)
        try:
            for pair in (first, second):
                result = client.infer("whoami", whoami_inputs(httpclient), headers=bearer(pair.token(sub=pair.kid)))
                assert result.as_numpy("WHO").tolist() == [pair.kid.encode()]
            unknown = ec_key("k-3")
            answer = http(server.base, "/v2/models/simple/infer", bearer(unknown.token()), SIMPLE_INFER_BODY)
            assert answer.status == 401
            assert answer.json()["error"] == "invalid bearer token: the token's key id is not known"
            # A known kid whose key did not sign the token; and an RS256 token under the EC key's id (the key's
            # algorithm only is accepted).
            for pair in (KeyPair(ec_key().private, "ES256", "k-1"), KeyPair(second.private, "RS256", "k-1")):
                answer = http(server.base, "/v2/models/simple/infer", bearer(pair.token()), SIMPLE_INFER_BODY)
                assert answer.status == 401, answer
        finally:
            client.close()


def test_protected_health(good_repo: Path, tmp_path: Path, key: KeyPair) -> None:
    """In process (a probe-less start: the process helper waits on an open /v2/health/live), real frontends."""
    (tmp_path / "public.pem").write_bytes(key.public_pem)
    http_port, grpc_port = free_port(), free_port()
    settings = ServerSettings(model_repositories=[good_repo], http_port=http_port, grpc_port=grpc_port,
                              allow_metrics=False, http_address="127.0.0.1", grpc_address="127.0.0.1",
                              auth_jwt_public_key=str(tmp_path / "public.pem"), auth_jwt_audience=AUDIENCE,
                              auth_protect_health=True)
    base = f"http://127.0.0.1:{http_port}"

    async def run() -> None:
        server = Server(settings)
        await server.start()
        loop = asyncio.get_running_loop()
        try:
            for headers, status in (({}, 401), (bearer(key.token(scope="inference")), 403),
                                    (bearer(key.token(scope="health")), 200)):
                for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/simple/ready"):
                    answer = await loop.run_in_executor(None, http, base, path, headers)
                    assert answer.status == status, (path, headers, answer)
        finally:
            await server.stop()

    asyncio.run(run())


def _start_error(good_repo: Path, *args: str) -> str:
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(good_repo), "--http-port", "0",
               "--grpc-port", "0", "--allow-metrics", "false", *args]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    return done.stderr


def test_unusable_settings_stop_the_start(good_repo: Path, tmp_path: Path, key: KeyPair) -> None:
    private = tmp_path / "private.pem"
    private.write_bytes(key.private_pem)
    public = tmp_path / "public.pem"
    public.write_bytes(key.public_pem)
    stderr = _start_error(good_repo, f"--auth-jwt-public-key={private}")
    assert "holds no PEM public key or certificate" in stderr
    assert "PRIVATE KEY" not in stderr and key.private_pem.decode().splitlines()[1] not in stderr
    stderr = _start_error(good_repo, f"--auth-jwt-public-key={public}", f"--auth-jwt-jwks={public}")
    assert "give --auth-jwt-public-key or --auth-jwt-jwks, not both" in stderr
    stderr = _start_error(good_repo, "--auth-jwt-audience=x")
    assert "--auth-jwt-audience need --auth-jwt-public-key or --auth-jwt-jwks" in stderr
    secret_jwks = tmp_path / "hs.json"
    secret_jwks.write_text(json.dumps({"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "s"}]}))
    stderr = _start_error(good_repo, f"--auth-jwt-jwks={secret_jwks}")
    assert "is not a public RSA, EC or OKP key" in stderr and "c2VjcmV0" not in stderr


# ---- the policy itself: the cache and mutual TLS ---------------------------------------------------------


def _policy(key: KeyPair, **options: Any) -> auth.JwtAuthentication:
    return auth.JwtAuthentication(auth._Keys(key.private.public_key(), ("RS256",)), audience=AUDIENCE,
                                  issuer=ISSUER, **options)


def _http(headers: dict[str, str] | None = None, subject: str | None = None) -> CallContext:
    return CallContext(Transport.HTTP, "127.0.0.1:1", headers or {}, peer_certificate_subject=subject)


def test_verified_tokens_are_cached_until_they_expire(key: KeyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = _policy(key, leeway_s=0, cache_size=2)
    verifications = 0
    decode = auth.jwt.decode

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal verifications
        verifications += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(auth.jwt, "decode", counting)
    short = key.token(lifetime_s=2)
    for _ in range(3):
        context = _http(bearer(short))
        policy.admit(ApiGroup.INFERENCE, context)
        assert context.identity == "alice"
    assert verifications == 1
    # The LRU is bounded: two more tokens push the first out.
    for sub in ("bob", "carol"):
        policy.admit(ApiGroup.INFERENCE, _http(bearer(key.token(sub=sub))))
    policy.admit(ApiGroup.INFERENCE, _http(bearer(short)))
    assert verifications == 4
    # Past its exp, a cached token is verified again, and refused.
    time.sleep(2.2)
    with pytest.raises(UnauthenticatedError, match="the token has expired"):
        policy.admit(ApiGroup.INFERENCE, _http(bearer(short)))
    assert verifications == 5


def test_mutual_tls_subject_is_the_identity_without_a_token(key: KeyPair) -> None:
    policy = _policy(key)
    context = _http(subject="CN=client-a,O=Team A")
    policy.admit(ApiGroup.MODEL_REPOSITORY, context)
    assert context.identity == "CN=client-a,O=Team A" and context.caller == "CN=client-a,O=Team A"
    # A token, when sent, decides: its subject and scopes, even over mutual TLS.
    context = _http(bearer(key.token(scope="inference")), subject="CN=client-a")
    with pytest.raises(PermissionDeniedError):
        policy.admit(ApiGroup.MODEL_REPOSITORY, context)
    assert context.identity == "alice"
    with pytest.raises(UnauthenticatedError):
        policy.admit(ApiGroup.INFERENCE, _http(bearer(key.token(lifetime_s=-60)), subject="CN=client-a"))
    # Without a certificate or a token: refused; in-process calls are never checked.
    with pytest.raises(UnauthenticatedError):
        policy.admit(ApiGroup.INFERENCE, _http())
    policy.admit(ApiGroup.MODEL_REPOSITORY, CallContext(Transport.IN_PROCESS))
