"""The security settings made into what the service runs: its call policies (restricted APIs, then token
authentication) and its audit log. The server calls `build_security` once; a setting that cannot work is a
SecurityConfigError, which stops the start with its message (never with a secret in it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from geserve.service.audit import AuditLog
from geserve.service.auth import AuthConfigError, JwtAuthentication, load_jwks, load_public_key
from geserve.service.context import CallPolicy, Transport
from geserve.service.restrictions import RestrictedApis, RestrictionError, parse_restrictions
from geserve.settings import ServerSettings

logger = logging.getLogger(__name__)


class SecurityConfigError(ValueError):
    """The security settings cannot be used as given."""


@dataclass
class Security:
    policies: list[CallPolicy] = field(default_factory=list)
    audit: AuditLog | None = None


def build_security(settings: ServerSettings) -> Security:
    """Policies in the order they run: Triton's restricted APIs (a header, before anything else), then bearer
    tokens (which set the caller's identity); the audit log when asked for."""
    security = Security()
    try:
        restricted = RestrictedApis(
            parse_restrictions(settings.http_restricted_api, Transport.HTTP),
            parse_restrictions(settings.grpc_restricted_protocol, Transport.GRPC),
        )
    except RestrictionError as exc:
        raise SecurityConfigError(str(exc)) from None
    if restricted:
        security.policies.append(restricted)
    try:
        authentication = _jwt(settings)
    except AuthConfigError as exc:
        raise SecurityConfigError(str(exc)) from None
    if authentication is not None:
        security.policies.append(authentication)
    if settings.audit_log:
        try:
            security.audit = AuditLog(settings.audit_log)
        except OSError as exc:
            raise SecurityConfigError(f"--audit-log: cannot open {settings.audit_log}: {exc.strerror}") from None
    return security


def _jwt(settings: ServerSettings) -> JwtAuthentication | None:
    if settings.auth_jwt_public_key and settings.auth_jwt_jwks:
        raise AuthConfigError("give --auth-jwt-public-key or --auth-jwt-jwks, not both")
    if settings.auth_jwt_public_key:
        keys = load_public_key(Path(settings.auth_jwt_public_key))
    elif settings.auth_jwt_jwks:
        keys = load_jwks(Path(settings.auth_jwt_jwks))
    else:
        needing_keys = ("auth_jwt_audience", "auth_jwt_issuer", "auth_protect_health")
        given = [f"--{name.replace('_', '-')}" for name in needing_keys if getattr(settings, name)]
        if given:
            raise AuthConfigError(f"{', '.join(given)} need --auth-jwt-public-key or --auth-jwt-jwks")
        return None
    if settings.auth_jwt_leeway_secs < 0:
        raise AuthConfigError("--auth-jwt-leeway-secs must not be negative")
    if not settings.auth_jwt_audience:
        logger.warning("token authentication without --auth-jwt-audience: a token minted for another service by "
                       "the same issuer, without an 'aud' claim, is accepted here")
    return JwtAuthentication(
        keys,
        audience=settings.auth_jwt_audience,
        issuer=settings.auth_jwt_issuer,
        leeway_s=settings.auth_jwt_leeway_secs,
        protect_health=settings.auth_protect_health,
    )
