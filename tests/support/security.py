"""Keys, signed tokens and a model that reports its caller, for the security tests (tests/test_security_*.py).

Keys are made here with `cryptography`, tokens signed with PyJWT: nothing is fixed in the tree.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from tritonclient.utils import InferenceServerException

AUDIENCE = "geserve-tests"
ISSUER = "https://issuer.example.test"


@dataclass
class KeyPair:
    private: Any
    algorithm: str
    kid: str | None = None

    @property
    def public_pem(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    @property
    def private_pem(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def jwk(self) -> dict[str, Any]:
        """The public key as a JWK (with `kid`, `use` and `alg`)."""
        algorithm = jwt.algorithms.RSAAlgorithm if self.algorithm.startswith("RS") else jwt.algorithms.ECAlgorithm
        entry = json.loads(algorithm.to_jwk(self.private.public_key()))
        entry.update({"use": "sig", "alg": self.algorithm})
        if self.kid:
            entry["kid"] = self.kid
        return entry

    def token(self, scope: str | None = "inference", lifetime_s: float = 300, **claims: Any) -> str:
        """A signed token for `alice` with this audience and issuer; `claims` override or add (None removes)."""
        now = int(time.time())
        payload: dict[str, Any] = {"sub": "alice", "aud": AUDIENCE, "iss": ISSUER, "iat": now,
                                   "exp": now + int(lifetime_s), "scope": scope}
        payload.update(claims)
        payload = {k: v for k, v in payload.items() if v is not None}
        headers = {"kid": self.kid} if self.kid else None
        return jwt.encode(payload, self.private, algorithm=self.algorithm, headers=headers)


def rsa_key(kid: str | None = None) -> KeyPair:
    return KeyPair(rsa.generate_private_key(public_exponent=65537, key_size=2048), "RS256", kid)


def ec_key(kid: str | None = None) -> KeyPair:
    return KeyPair(ec.generate_private_key(ec.SECP256R1()), "ES256", kid)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


WHOAMI_CONFIG = """name: "whoami"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "WHO" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
WHOAMI_MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            who = request.identity()
            text = b"<nobody>" if who is None else who.encode()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("WHO", np.array([text], dtype=np.object_))]))
        return responses
'''


def whoami_repository(repo: Path) -> Path:
    """A repository with `whoami`: a Python model answering with `request.identity()`."""
    model = repo / "whoami"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(WHOAMI_CONFIG)
    (model / "1" / "model.py").write_text(WHOAMI_MODEL)
    return repo


def whoami_inputs(module: Any) -> list[Any]:
    tensor = module.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], dtype=np.int32))
    return [tensor]


def simple_inputs(module: Any) -> list[Any]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    return inputs


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(base: str, path: str, headers: dict[str, str] | None = None, body: Any = None) -> Answer:
    """One raw HTTP call (GET, or POST with a JSON body): the status, headers (lower-case names) and body as
    sent, refusals included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers=headers or {},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return Answer(response.status, {k.lower(): v for k, v in response.headers.items()}, response.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())


SIMPLE_INFER_BODY = {
    "inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
    ]
}


def stream_answer(client: Any, model: str, inputs: list[Any], headers: dict[str, str] | None = None) -> Any:
    """Open a gRPC stream, send one request, and give back what its callback got first: a result, or the error
    that ended the stream. A stream refused at its start may already be closed when the request is sent (the
    server decides once the stream exists, as Triton's own test notes): the client then raises on the send, and
    the refusal is still what the callback got."""
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(lambda result, error: results.put(error or result), headers=headers)
    try:
        try:
            client.async_stream_infer(model, inputs)
        except InferenceServerException as exc:
            if "no longer in valid state" not in exc.message():
                raise
        return results.get(timeout=10)
    finally:
        client.stop_stream()
