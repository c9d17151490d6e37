"""The audit log on a real server process with bearer tokens and a restricted API, driven by the real clients:
one JSON line per model-repository, shared-memory, logging and trace call and per refused call, with its fields;
none for an admitted inference; a new file after rotation; and no token, key or secret anywhere in the audit log
or the server's own log (at --log-verbose)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.security import (
    AUDIENCE,
    ISSUER,
    SIMPLE_INFER_BODY,
    KeyPair,
    bearer,
    http,
    rsa_key,
    simple_inputs,
)
from tests.support.server import RunningServer, geserve

LOG_SECRET = "logging-header-s3cret"
ALL_SCOPES = "model-repository shared-memory logging trace inference metadata"


@pytest.fixture(scope="module")
def key() -> KeyPair:
    return rsa_key()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit")


@pytest.fixture(scope="module")
def audited(key: KeyPair, good_repo: Path, folder: Path) -> Iterator[RunningServer]:
    (folder / "public.pem").write_bytes(key.public_pem)
    args = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--log-verbose", "1",
            "--model-control-mode", "explicit", "--load-model", "simple",
            f"--auth-jwt-public-key={folder / 'public.pem'}", f"--auth-jwt-audience={AUDIENCE}",
            f"--auth-jwt-issuer={ISSUER}", f"--audit-log={folder / 'audit.log'}",
            f"--http-restricted-api=logging:x-log-key={LOG_SECRET}"]
    with geserve([good_repo], folder / "geserve.log", args) as server:
        yield server


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _new_lines(path: Path, before: int) -> list[dict[str, Any]]:
    return _lines(path)[before:]


class Tokens:
    """Every token a test sends, so the last test can look for each in the logs."""

    sent: list[str] = []

    @classmethod
    def make(cls, key: KeyPair, **claims: Any) -> str:
        token = key.token(**claims)
        cls.sent.append(token)
        return token


def test_audited_groups_and_refusals(audited: RunningServer, key: KeyPair, folder: Path) -> None:
    audit = folder / "audit.log"
    before = len(_lines(audit))
    started = datetime.now(timezone.utc)
    token = Tokens.make(key, scope=ALL_SCOPES, sub="ops@example.test")
    narrow = Tokens.make(key, scope="inference")
    http_client = httpclient.InferenceServerClient(audited.url)
    grpc_client = grpcclient.InferenceServerClient(audited.grpc_url)
    try:
        http_client.get_model_repository_index(headers=bearer(token))
        http_client.unload_model("simple", headers=bearer(token))
        grpc_client.load_model("simple", headers=bearer(token))
        http_client.get_log_settings(headers={**bearer(token), "x-log-key": LOG_SECRET})
        grpc_client.get_trace_settings(headers=bearer(token))
        http_client.get_system_shared_memory_status(headers=bearer(token))
        with pytest.raises(InferenceServerException):
            http_client.load_model("no_such_model", headers=bearer(token))
        # Not audited when admitted: inference, metadata.
        http_client.infer("simple", simple_inputs(httpclient), headers=bearer(token))
        grpc_client.get_server_metadata(headers=bearer(token))
        # Refused: no token (any group), a scope missing, a restricted header missing.
        assert http(audited.base, "/v2/models/simple/infer", {}, SIMPLE_INFER_BODY).status == 401
        with pytest.raises(InferenceServerException, match="the token's scopes do not include 'model-repository'"):
            grpc_client.get_model_repository_index(headers=bearer(narrow))
        assert http(audited.base, "/v2/logging", bearer(token)).status == 403
    finally:
        http_client.close()
        grpc_client.close()

    lines = _new_lines(audit, before)
    summary = [(r["protocol"], r["group"], r["action"], r["model"], r["outcome"], r.get("refused", False))
               for r in lines]
    assert summary == [
        ("http", "model-repository", "repository_index", "", "OK", False),
        ("http", "model-repository", "unload_model", "simple", "OK", False),
        ("grpc", "model-repository", "load_model", "simple", "OK", False),
        ("http", "logging", "log_settings", "", "OK", False),
        ("grpc", "trace", "trace_setting", "", "OK", False),
        ("http", "shared-memory", "shared_memory_status", "", "OK", False),
        ("http", "model-repository", "load_model", "no_such_model", lines[6]["outcome"], False),
        ("http", "inference", "infer", "simple", "UNAUTHENTICATED", True),
        ("grpc", "model-repository", "repository_index", "", "PERMISSION_DENIED", True),
        ("http", "logging", "log_settings", "", "PERMISSION_DENIED", True),
    ], summary
    assert lines[6]["outcome"] != "OK" and "no_such_model" in lines[6]["message"]
    for record in lines:
        assert set(record) >= {"time", "protocol", "peer", "identity", "group", "action", "model", "outcome"}
        assert record["time"].endswith("Z")
        when = datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
        assert started - timedelta(seconds=5) <= when <= datetime.now(timezone.utc) + timedelta(seconds=5)
        assert "127.0.0.1" in record["peer"], record
    identities = [r["identity"] for r in lines]
    # The restricted API's header is checked before the token: that refusal knows no identity yet.
    assert identities == ["ops@example.test"] * 7 + [None, "alice", None]
    assert lines[5]["region"] == ""
    assert lines[7]["message"].startswith("This API requires a bearer token")
    assert lines[9]["message"] == "This API is restricted, expecting header 'x-log-key'"


def test_a_rotated_log_is_followed(audited: RunningServer, key: KeyPair, folder: Path) -> None:
    audit = folder / "audit.log"
    rotated = folder / "audit.log.1"
    token = Tokens.make(key, scope=ALL_SCOPES)
    client = httpclient.InferenceServerClient(audited.url)
    try:
        client.get_model_repository_index(headers=bearer(token))
        kept = audit.read_text()
        audit.rename(rotated)  # what logrotate does (no copytruncate, no signal)
        client.get_model_repository_index(headers=bearer(token))
        with pytest.raises(InferenceServerException, match="Unable to find system shared memory region"):
            client.get_system_shared_memory_status("some_region", headers=bearer(token))
        assert audit.exists()
        assert rotated.read_text() == kept
        lines = _lines(audit)
        assert [(r["action"], r["outcome"]) for r in lines] == [
            ("repository_index", "OK"), ("shared_memory_status", "NOT_FOUND")
        ]
        assert lines[1]["region"] == "some_region"
        assert lines[1]["message"] == "Unable to find system shared memory region: 'some_region'"
        audit.unlink()  # removed outright: a new file again
        client.get_model_repository_index(headers=bearer(token))
        assert [r["action"] for r in _lines(audit)] == ["repository_index"]
        assert oct(audit.stat().st_mode & 0o777) == oct(0o600)
    finally:
        client.close()


def test_no_token_key_or_secret_in_any_log(audited: RunningServer, key: KeyPair, folder: Path) -> None:
    # One more of each kind of refusal, with material the server must not repeat.
    expired = Tokens.make(key, lifetime_s=-120)
    forged = rsa_key().token()
    Tokens.sent.append(forged)
    for headers in (bearer(expired), bearer(forged), {**bearer(Tokens.make(key)), "x-log-key": "wrong-" + LOG_SECRET}):
        http(audited.base, "/v2/logging", headers)
        http(audited.base, "/v2/models/simple/infer", headers, SIMPLE_INFER_BODY)
    time.sleep(0.2)
    texts = {path.name: path.read_bytes() for path in folder.iterdir() if path.name.startswith(("audit", "geserve"))}
    assert {"audit.log", "geserve.log"} <= texts.keys()
    assert b"started HTTPService" in texts["geserve.log"]  # the server's log is the one read
    secrets = [token.encode() for token in Tokens.sent]
    secrets += [token.encode().split(b".")[2] for token in Tokens.sent]  # the signatures alone
    secrets += [LOG_SECRET.encode()]
    key_lines = [line for line in key.private_pem.splitlines() if line and not line.startswith(b"-----")]
    secrets += key_lines
    assert len(Tokens.sent) >= 3 and len(key_lines) > 10
    for name, text in texts.items():
        for secret in secrets:
            assert secret not in text, (name, secret[:12])
        assert b"Bearer ey" not in text, name
