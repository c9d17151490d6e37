"""Bearer-token (JWT) authentication and scopes, as one call policy (Triton has none; this is geserve's own).

A call brings `authorization: Bearer <token>` (an HTTP header, or gRPC metadata under the same key). The token is
verified with PyJWT against `--auth-jwt-public-key` (a PEM public key or certificate; RSA: RS256/384/512, EC:
ES256/384/512) or `--auth-jwt-jwks` (a JWK set; the token's `kid` picks the key, and the key's algorithm is the
only one accepted), with `exp` required, and `aud` / `iss` checked when `--auth-jwt-audience` / `--auth-jwt-issuer`
are given (a token that carries an `aud` claim needs `--auth-jwt-audience`: PyJWT refuses an audience it was not
told to expect), all within `--auth-jwt-leeway-secs` of clock skew. Symmetric keys (HS*) and `none` are never
accepted: the algorithms come from the key, not from the token.

- No token, or one that does not verify (malformed, forged, expired, not yet valid, another audience or issuer):
  UnauthenticatedError, HTTP 401 with `WWW-Authenticate: Bearer` (RFC 6750; `error="invalid_token"` when a token
  was sent), gRPC UNAUTHENTICATED. The refusal's words are fixed per cause, never the token or PyJWT's text.
- A valid token whose scopes do not name the call's API group: PermissionDeniedError, HTTP 403 (with
  `WWW-Authenticate: Bearer error="insufficient_scope"`), gRPC PERMISSION_DENIED. Scopes come from the `scope`
  claim (space-separated) or `scp` (a list, or a space-separated string) and are Triton's API group names:
  `inference metadata model-config`, say. Unknown names are ignored.
- Health (server live and ready, model ready) stays open for probes unless `--auth-protect-health`.
- Mutual TLS: a call with no token whose connection verified a client certificate
  (`CallContext.peer_certificate_subject`) is admitted as that subject, for every group. The certificate already
  passed the CA the operator chose, which is the gate mutual TLS is for; a client that should have less presents
  a token (a token, when sent, always decides: a bad one is refused even over mutual TLS).
- In-process calls (BLS, ensemble steps, the in-process API) are not checked: the call that made them was.

The caller's identity is the token's `sub` (or the certificate subject); it goes to `context.identity`, from there
to the audit log and to Python models (`request.identity()`).

Cost per call: verifying a signature takes tens of microseconds (RSA-2048) to a few hundred (ES256), so verified
tokens are cached: a bounded LRU (`CACHE_SIZE` tokens) keyed by the token string, each entry kept until its `exp`
(plus the leeway), after which the token is verified again (and refused as expired). A cached call costs a dict
lookup, a clock read and a set membership test. Refusals are not cached: a forged token costs a verification
each time, as it would without a cache.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from geserve.errors import PermissionDeniedError, UnauthenticatedError
from geserve.service.context import ApiGroup, CallContext, Transport

CACHE_SIZE = 4096
DEFAULT_LEEWAY_S = 30.0
_RSA_ALGORITHMS = ("RS256", "RS384", "RS512")
_EC_ALGORITHMS = ("ES256", "ES384", "ES512")
_OPEN_GROUPS = frozenset({ApiGroup.HEALTH})
_GROUP_BY_NAME = {g.value: g for g in ApiGroup}

_MISSING = "This API requires a bearer token: send 'authorization: Bearer <token>'"
_BEARER = (("www-authenticate", "Bearer"),)
# PyJWT's exception classes, most specific first, and the fixed words each refusal uses.
_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (jwt.ExpiredSignatureError, "the token has expired"),
    (jwt.ImmatureSignatureError, "the token is not valid yet"),
    (jwt.InvalidAudienceError, "the token's audience is not accepted"),
    (jwt.InvalidIssuerError, "the token's issuer is not accepted"),
    (jwt.InvalidSignatureError, "the token's signature does not verify"),
    (jwt.InvalidAlgorithmError, "the token's algorithm is not accepted"),
    (jwt.MissingRequiredClaimError, "the token lacks a required claim (exp)"),
)


class AuthConfigError(ValueError):
    """Token authentication cannot be set up as asked (the server refuses to start)."""


@dataclass(frozen=True, slots=True)
class _Verified:
    identity: str | None
    scopes: frozenset[ApiGroup]
    until: float  # time.time() past which the entry is stale (exp + leeway)


class _Keys:
    """Where a token's verification key and algorithms come from: one PEM key, or a JWK set by key id."""

    def __init__(self, key: Any = None, algorithms: Sequence[str] = (), jwks: dict[str, jwt.PyJWK] | None = None):
        self._key, self._algorithms, self._jwks = key, list(algorithms), jwks

    def for_token(self, token: str) -> tuple[Any, list[str]]:
        if self._jwks is None:
            return self._key, self._algorithms
        kid = jwt.get_unverified_header(token).get("kid")
        if kid is None and len(self._jwks) == 1:
            key = next(iter(self._jwks.values()))  # a set of one key: a token without `kid` means it
        elif not isinstance(kid, str) or kid not in self._jwks:
            raise _Refusal("the token's key id is not known")
        else:
            key = self._jwks[kid]
        return key.key, [key.algorithm_name]


class _Refusal(Exception):
    """A token that does not verify, with the words to refuse it with."""


def load_public_key(path: Path) -> _Keys:
    """A PEM public key or X.509 certificate; its type decides the accepted algorithms."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise AuthConfigError(f"--auth-jwt-public-key: cannot read {path}: {exc.strerror}") from None
    try:
        if b"-----BEGIN CERTIFICATE-----" in data:
            key: Any = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
    except ValueError:
        # no detail: a private key given by mistake must not be quoted back
        raise AuthConfigError(f"--auth-jwt-public-key: {path} holds no PEM public key or certificate") from None
    if isinstance(key, rsa.RSAPublicKey):
        return _Keys(key, _RSA_ALGORITHMS)
    if isinstance(key, ec.EllipticCurvePublicKey):
        return _Keys(key, _EC_ALGORITHMS)
    if isinstance(key, ed25519.Ed25519PublicKey):
        return _Keys(key, ("EdDSA",))
    raise AuthConfigError(f"--auth-jwt-public-key: {path}: unsupported key type (RSA, EC or Ed25519 expected)")


def load_jwks(path: Path) -> _Keys:
    """A JWK set file ({"keys": [...]}) of public keys, each with a `kid` (one key alone may omit it)."""
    entries = _jwks_entries(path)
    keys: dict[str, jwt.PyJWK] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
            continue
        key = _signing_key(path, index, entry)
        kid = entry.get("kid")
        if not isinstance(kid, str) and len(entries) > 1:
            raise AuthConfigError(f"--auth-jwt-jwks: key {index} of {path} has no 'kid'")
        keys[kid if isinstance(kid, str) else ""] = key
    if not keys:
        raise AuthConfigError(f"--auth-jwt-jwks: {path} holds no signing key")
    return _Keys(jwks=keys)


def _jwks_entries(path: Path) -> list[Any]:
    """The non-empty 'keys' list of a JWK set file."""
    try:
        document = json.loads(path.read_text())
    except OSError as exc:
        raise AuthConfigError(f"--auth-jwt-jwks: cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise AuthConfigError(f"--auth-jwt-jwks: {path} is not JSON") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise AuthConfigError(f"--auth-jwt-jwks: {path} holds no 'keys' list")
    return entries


def _signing_key(path: Path, index: int, entry: dict[str, Any]) -> jwt.PyJWK:
    """Key `index` of the set, a public RSA, EC or OKP key."""
    if entry.get("kty") not in ("RSA", "EC", "OKP") or "d" in entry:
        # symmetric keys would let anyone holding them mint tokens; private keys do not belong here
        raise AuthConfigError(f"--auth-jwt-jwks: key {index} of {path} is not a public RSA, EC or OKP key")
    try:
        return jwt.PyJWK(entry)
    except jwt.PyJWTError:  # its words quote the key: not repeated, though public
        raise AuthConfigError(f"--auth-jwt-jwks: key {index} of {path} is not a usable signing key") from None


class JwtAuthentication:
    """The call policy: every call of a protected group needs a valid bearer token whose scopes name the group
    (or, with none, a verified client certificate)."""

    def __init__(
        self,
        keys: _Keys,
        *,
        audience: str = "",
        issuer: str = "",
        leeway_s: float = DEFAULT_LEEWAY_S,
        protect_health: bool = False,
        cache_size: int = CACHE_SIZE,
    ) -> None:
        self._keys = keys
        self._audience = audience or None
        self._issuer = issuer or None
        self._leeway = leeway_s
        self._open = frozenset() if protect_health else _OPEN_GROUPS
        self._cache: OrderedDict[str, _Verified] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the in-process API may call from other threads

    def admit(self, group: ApiGroup, context: CallContext) -> None:
        if context.transport is Transport.IN_PROCESS or group in self._open:
            return
        token = _bearer(context.headers.get("authorization"))
        if token is None:
            subject = context.peer_certificate_subject
            if subject is not None:
                context.identity = subject  # mutual TLS is the gate: every group (see the module docstring)
                return
            raise UnauthenticatedError(_MISSING, headers=_BEARER)
        verified = self._verified(token)
        context.identity = verified.identity
        if group not in verified.scopes:
            raise PermissionDeniedError(
                f"the token's scopes do not include '{group.value}'",
                headers=(("www-authenticate", f'Bearer error="insufficient_scope", scope="{group.value}"'),),
            )

    def _verified(self, token: str) -> _Verified:
        now = time.time()
        with self._lock:
            cached = self._cache.get(token)
            if cached is not None:
                if now < cached.until:
                    self._cache.move_to_end(token)
                    return cached
                del self._cache[token]
        try:
            key, algorithms = self._keys.for_token(token)
            claims = jwt.decode(
                token, key, algorithms=algorithms, audience=self._audience, issuer=self._issuer,
                leeway=self._leeway, options={"require": ["exp"]},
            )
        except _Refusal as exc:
            raise _invalid(str(exc)) from None
        except Exception as exc:  # PyJWT's errors, and anything a malformed token makes the libraries raise
            raise _invalid(_reason(exc)) from None
        subject = claims.get("sub")
        verified = _Verified(
            subject if isinstance(subject, str) else None,
            _scopes(claims),
            float(claims["exp"]) + self._leeway,
        )
        with self._lock:
            self._cache[token] = verified
            self._cache.move_to_end(token)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return verified


def _bearer(header: str | None) -> str | None:
    """The token of an `authorization: Bearer <token>` value; None for no header or another scheme."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _scopes(claims: dict[str, Any]) -> frozenset[ApiGroup]:
    names: Iterable[Any] = ()
    for claim in ("scope", "scp"):
        value = claims.get(claim)
        if isinstance(value, str):
            names = [*names, *value.split()]
        elif isinstance(value, list):
            names = [*names, *value]
    return frozenset(_GROUP_BY_NAME[n] for n in names if isinstance(n, str) and n in _GROUP_BY_NAME)


def _reason(error: Exception) -> str:
    for kind, words in _REASONS:
        if isinstance(error, kind):
            return words
    return "the token is malformed"


def _invalid(reason: str) -> UnauthenticatedError:
    return UnauthenticatedError(
        f"invalid bearer token: {reason}",
        headers=(("www-authenticate", f'Bearer error="invalid_token", error_description="{reason}"'),),
    )

