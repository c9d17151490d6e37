"""Triton's restricted APIs on a real server process, driven by the real clients: `--http-restricted-api` answers
403 with Triton's body, `--grpc-restricted-protocol` UNAVAILABLE with Triton's message (unary calls and a stream
alike); the right header lets a call through; a group restricted twice stops the start with Triton's words and
no secret; `--allow-client-shm` is `--allow-system-shared-memory`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from geserve.cli import build_parser, settings_from_args
from geserve.settings import ServerSettings
from tests.support.security import SIMPLE_INFER_BODY, http, simple_inputs, stream_answer
from tests.support.server import REPO_ROOT, RunningServer, geserve

INFER_SECRET = "infer-s3cret-value"
ADMIN_SECRET = "admin-s3cret-value"
GRPC_PREFIX = "triton-grpc-protocol-"


@pytest.fixture(scope="module")
def restricted(good_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("restricted") / "geserve.log"
    args = [
        "--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--log-verbose", "1",
        f"--http-restricted-api=inference,model-config:infer-key={INFER_SECRET}",
        f"--http-restricted-api=model-repository,shared-memory:admin-key={ADMIN_SECRET}",
        f"--grpc-restricted-protocol=inference,health:infer-key={INFER_SECRET}",
        f"--grpc-restricted-protocol=model-repository:admin-key={ADMIN_SECRET}",
    ]
    with geserve([good_repo], log, args) as server:
        yield server


def test_http_refusal_is_tritons_403_and_body(restricted: RunningServer) -> None:
    expected = b'{"error":"This API is restricted, expecting header \'infer-key\'"}'
    for headers in ({}, {"infer-key": "wrong"}, {"infer-key": INFER_SECRET + "x"}, {"admin-key": INFER_SECRET}):
        answer = http(restricted.base, "/v2/models/simple/infer", headers, SIMPLE_INFER_BODY)
        assert (answer.status, answer.body) == (403, expected), headers
        answer = http(restricted.base, "/v2/models/simple/config", headers)
        assert (answer.status, answer.body) == (403, expected), headers
    answer = http(restricted.base, "/v2/repository/index", {"infer-key": INFER_SECRET}, {})
    assert answer.status == 403
    assert answer.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
    answer = http(restricted.base, "/v2/models", {"infer-key": INFER_SECRET})  # the index by model: admitted alike
    assert answer.status == 403
    assert answer.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
    answer = http(restricted.base, "/v2/models", {"admin-key": ADMIN_SECRET})
    assert answer.status == 200 and "simple" in {model["name"] for model in answer.json()["models"]}


def test_http_right_header_passes_and_other_groups_stay_open(restricted: RunningServer) -> None:
    client = httpclient.InferenceServerClient(restricted.url)
    try:
        with pytest.raises(InferenceServerException, match="This API is restricted, expecting header 'infer-key'") as e:
            client.infer("simple", simple_inputs(httpclient))
        assert e.value.status() == "403"
        result = client.infer("simple", simple_inputs(httpclient), headers={"infer-key": INFER_SECRET})
        assert result.as_numpy("OUTPUT0") is not None
        # Header names are case-insensitive on HTTP.
        assert client.get_model_config("simple", headers={"Infer-Key": INFER_SECRET})["name"] == "simple"
        # Groups with no restriction need nothing; health is not restricted on HTTP here.
        assert client.is_server_live() and client.get_server_metadata()["name"]
        assert client.get_inference_statistics("simple")["model_stats"]
        index = client.get_model_repository_index(headers={"admin-key": ADMIN_SECRET})
        assert any(m["name"] == "simple" for m in index)
        # Past the restriction, the call gets its ordinary answer (load/unload refused in mode none).
        with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
            client.unload_model("simple", headers={"admin-key": ADMIN_SECRET})
    finally:
        client.close()


def test_grpc_refusal_is_tritons_unavailable(restricted: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(restricted.grpc_url)
    message = f"This protocol is restricted, expecting header '{GRPC_PREFIX}infer-key'"
    try:
        for headers in ({}, {GRPC_PREFIX + "infer-key": "wrong"}, {"infer-key": INFER_SECRET}):
            with pytest.raises(InferenceServerException) as refused:
                client.infer("simple", simple_inputs(grpcclient), headers=headers)
            assert refused.value.status() == "StatusCode.UNAVAILABLE", headers
            assert refused.value.message() == message
            with pytest.raises(InferenceServerException, match=message):
                client.is_server_live(headers=headers)
        with pytest.raises(InferenceServerException,
                           match=f"This protocol is restricted, expecting header '{GRPC_PREFIX}admin-key'"):
            client.unload_model("simple", headers={GRPC_PREFIX + "infer-key": INFER_SECRET})
    finally:
        client.close()


def test_grpc_right_header_passes(restricted: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(restricted.grpc_url)
    infer_key = {GRPC_PREFIX + "infer-key": INFER_SECRET}
    try:
        assert client.is_server_live(headers=infer_key)
        result = client.infer("simple", simple_inputs(grpcclient), headers=infer_key)
        assert result.as_numpy("OUTPUT0") is not None
        # Not restricted over gRPC (model-config is, over HTTP only): each protocol has its own rules.
        assert client.get_model_config("simple").config.name == "simple"
        assert client.get_server_metadata().name
        with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
            client.unload_model("simple", headers={GRPC_PREFIX + "admin-key": ADMIN_SECRET})
    finally:
        client.close()


def test_grpc_stream_is_refused_at_its_start(restricted: RunningServer) -> None:
    client = grpcclient.InferenceServerClient(restricted.grpc_url)
    try:
        error = stream_answer(client, "simple", simple_inputs(grpcclient))
        assert isinstance(error, InferenceServerException)
        assert error.status() == "StatusCode.UNAVAILABLE"
        assert f"This protocol is restricted, expecting header '{GRPC_PREFIX}infer-key'" in error.message()
        answer = stream_answer(client, "simple", simple_inputs(grpcclient), {GRPC_PREFIX + "infer-key": INFER_SECRET})
        assert not isinstance(answer, InferenceServerException), answer
        assert answer.as_numpy("OUTPUT0") is not None
    finally:
        client.close()


def test_the_secret_never_reaches_the_log(restricted: RunningServer) -> None:
    log = restricted.log()
    assert "started" in log.lower()
    assert INFER_SECRET not in log and ADMIN_SECRET not in log


def _start_error(good_repo: Path, *args: str) -> str:
    """The stderr of a `geserve serve` that must refuse to start (exit 1)."""
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(good_repo), "--http-port", "0",
               "--grpc-port", "0", "--allow-metrics", "false", *args]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    return done.stderr


def test_a_group_in_two_restrictions_stops_the_start(good_repo: Path) -> None:
    stderr = _start_error(good_repo, "--http-restricted-api=health,inference:a=first-secret",
                          "--http-restricted-api=inference:b=second-secret")
    assert "restricted api 'inference' can not be specified in multiple config groups" in stderr
    stderr = _start_error(good_repo, "--grpc-restricted-protocol=trace:a=first-secret",
                          "--grpc-restricted-protocol=logging,trace:b=second-secret")
    assert "restricted protocol 'trace' can not be specified in multiple config groups" in stderr
    stderr = _start_error(good_repo, "--http-restricted-api=inference,everything:a=first-secret")
    assert "unknown restricted api 'everything'" in stderr
    stderr = _start_error(good_repo, "--grpc-restricted-protocol=inference:first-secret")
    assert "--grpc-restricted-protocol option format is '<protocols>:<key>=<value>'" in stderr
    stderr += _start_error(good_repo, "--http-restricted-api=inference:key=")
    stderr += _start_error(good_repo, "--http-restricted-api=first-secret")
    assert "first-secret" not in stderr and "second-secret" not in stderr


def test_flags_and_environment() -> None:
    parser = build_parser()
    settings = settings_from_args(parser.parse_args(["serve", "--allow-client-shm"]))
    assert settings.allow_system_shared_memory is True
    settings = settings_from_args(parser.parse_args(["serve", "--allow-client-shm=false"]))
    assert settings.allow_system_shared_memory is False
    settings = settings_from_args(parser.parse_args([
        "serve", "--http-restricted-api=health,metadata:k=v", "--http-restricted-api=inference:k2=v2",
        "--grpc-restricted-protocol=logging:k=v",
    ]))
    assert settings.http_restricted_api == ["health,metadata:k=v", "inference:k2=v2"]
    assert settings.grpc_restricted_protocol == ["logging:k=v"]
    # In the environment several restrictions are separated by ';' (each holds commas).
    settings = ServerSettings.from_env({"GESERVE_HTTP_RESTRICTED_API": "health,metadata:k=v;inference:k2=v2"})
    assert settings.http_restricted_api == ["health,metadata:k=v", "inference:k2=v2"]
