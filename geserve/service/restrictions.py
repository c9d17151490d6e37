"""Triton's restricted APIs: `--http-restricted-api` and `--grpc-restricted-protocol`, as one call policy.

Each flag is `<groups>:<key>=<value>`, repeatable; <groups> a comma-separated list of Triton's API group names
(health, metadata, inference, shared-memory, model-config, model-repository, statistics, trace, logging). A call
of a restricted group must carry the header (gRPC: the metadata key `triton-grpc-protocol-<key>`) with exactly
that value. A group may appear in one restriction per protocol; a second is a start-up error. As in Triton:

- the flag's shape and its errors: `TritonParser::ParseRestrictedFeatureOption` and `ParseGenericConfigOption`
  in triton-inference-server/server src/command_line_parser.cc ("unknown restricted api '<g>'", "restricted
  api '<g>' can not be specified in multiple config groups"; "protocol" for gRPC), the group names from
  src/restricted_features.h (`RESTRICTED_CATEGORY_NAMES`), the gRPC key prefix `triton-grpc-protocol-` from
  src/grpc/ (`kRestrictedProtocolHeaderTemplate`: HTTP/2 wants lower-case header names);
- HTTP: `HTTPAPIServer::RespondIfRestricted` in src/http_server.cc answers 403 with
  `{"error":"This API is restricted, expecting header '<key>'"}` when the header is missing or differs;
- gRPC: `ExecutePrecondition` (src/grpc/grpc_server.cc `CommonCallData`, src/grpc/infer_handler.cc,
  src/grpc/stream_infer_handler.cc) answers UNAVAILABLE, "This protocol is restricted, expecting header
  'triton-grpc-protocol-<key>'"; a stream is refused at its start (the gRPC frontend admits a stream before
  reading it).

Two differences, both deliberate: the value is compared in constant time (`hmac.compare_digest`, Triton uses
`==`), and a start-up error never repeats the value (Triton's format error prints the whole argument).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from geserve.errors import GeserveError, PermissionDeniedError, UnavailableError
from geserve.service.context import ApiGroup, CallContext, Transport

GRPC_KEY_PREFIX = "triton-grpc-protocol-"
_GROUP_NAMES = ", ".join(g.value for g in ApiGroup)


class RestrictionError(ValueError):
    """A restriction flag that cannot be used (the server refuses to start)."""


@dataclass(frozen=True, slots=True)
class Restriction:
    """One protocol's rule for one group: the header to look up, the value it must have, the refusal."""

    header: str  # lower case, as the call context holds header names
    value: bytes
    refusal: GeserveError


def parse_restrictions(specs: Iterable[str], transport: Transport) -> dict[ApiGroup, Restriction]:
    """The rules of one protocol's flags (`--http-restricted-api` for HTTP, `--grpc-restricted-protocol` for
    gRPC), by group; raises RestrictionError with Triton's wording on a malformed flag, an unknown group or a
    group restricted twice."""
    http = transport is Transport.HTTP
    option, kind = ("http-restricted-api", "api") if http else ("grpc-restricted-protocol", "protocol")
    rules: dict[ApiGroup, Restriction] = {}
    for spec in specs:
        names, key, value = _split(spec, option, kind)
        header = key if http else GRPC_KEY_PREFIX + key
        if http:
            refusal: GeserveError = PermissionDeniedError(f"This API is restricted, expecting header '{header}'")
        else:
            refusal = UnavailableError(f"This protocol is restricted, expecting header '{header}'")
        for name in names.split(","):
            group = _group(name, option, kind)
            if group in rules:
                raise RestrictionError(
                    f"restricted {kind} '{name}' can not be specified in multiple config groups (--{option})"
                )
            rules[group] = Restriction(header.lower(), value.encode(), refusal)
    return rules


def _split(spec: str, option: str, kind: str) -> tuple[str, str, str]:
    """A flag's groups, key and value, none of them empty."""
    names, colon, setting = spec.partition(":")
    key, equals, value = setting.partition("=")
    if not names or not key or not equals or not value:
        # the argument's groups and key only: the rest may be the secret (or a key that was meant to be one)
        shown = f"{names}:{key}=..." if equals else f"{names}:..." if colon else "..."
        raise RestrictionError(
            f"--{option} option format is '<{kind}s>:<key>=<value>'. Got '{shown}'"
        )
    return names, key, value


def _group(name: str, option: str, kind: str) -> ApiGroup:
    try:
        return ApiGroup(name)
    except ValueError:
        raise RestrictionError(
            f"unknown restricted {kind} '{name}' (--{option}); allowed: {_GROUP_NAMES}"
        ) from None


class RestrictedApis:
    """The call policy: a restricted group's call passes only with its header and value. In-process calls
    (BLS, ensemble steps, the in-process API) have no rule: the call that started them passed already."""

    def __init__(
        self, http: Mapping[ApiGroup, Restriction], grpc: Mapping[ApiGroup, Restriction]
    ) -> None:
        self._rules: dict[Transport, dict[ApiGroup, Restriction]] = {
            Transport.HTTP: dict(http), Transport.GRPC: dict(grpc), Transport.IN_PROCESS: {},
        }

    def __bool__(self) -> bool:
        return any(self._rules.values())

    def admit(self, group: ApiGroup, context: CallContext) -> None:
        rule = self._rules[context.transport].get(group)
        if rule is None:
            return
        sent = context.headers.get(rule.header)
        if sent is None or not hmac.compare_digest(_raw(sent), rule.value):
            # a fresh error each time: a raised exception carries its traceback, shared state must not
            raise type(rule.refusal)(rule.refusal.message)


def _raw(header: str) -> bytes:
    """A header value as the bytes the client sent: HTTP headers reach the context decoded as latin-1, gRPC
    metadata values are ASCII. Anything else cannot match a value given on the command line as UTF-8 except by
    these bytes, so it is compared as UTF-8."""
    try:
        return header.encode("latin-1")
    except UnicodeEncodeError:
        return header.encode("utf-8", "surrogatepass")
