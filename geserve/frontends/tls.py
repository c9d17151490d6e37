"""TLS for the frontends: the PEM files each endpoint was given, checked at start with messages naming the flag
and the file; the ssl.SSLContext (HTTP and metrics with ALPN http/1.1, the native gRPC server with ALPN h2) or the
grpc.aio server credentials made from them; the client certificate's subject under mutual TLS; and re-reading the
files on SIGHUP (`reload_tls`).

Rotation never drops a connection. HTTP and native gRPC: a reload builds a new SSLContext that new connections get;
a connection keeps the SSL object (and so the certificate) it was made with. grpc.aio (`--grpc-server grpcio`, or a
host's own grpc server): the credentials are dynamic (`grpc.dynamic_ssl_server_credentials`); gRPC core asks the
fetcher before every new handshake, and the fetcher hands over the configuration a reload prepared, once. A reload
that finds a file missing, unreadable or not matching keeps the current certificate and logs why: an operator
half-way through replacing files, or a typo, must not take the endpoint down.
"""

from __future__ import annotations

import functools
import logging
import ssl
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

logger = logging.getLogger(__name__)

# TLS versions as the ASGI TLS extension numbers them (the wire's protocol version).
_TLS_VERSIONS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


class TlsError(Exception):
    """A TLS setting cannot be used: a flag missing, or a file missing, unreadable or not what it should be. The
    message names the flag and the file (never the file's content)."""


@runtime_checkable
class ReloadsTls(Protocol):
    """A frontend that can serve TLS; when it does (`serves_tls`), the server calls `reload_tls` on SIGHUP to have
    it re-read its certificate files."""

    @property
    def serves_tls(self) -> bool: ...

    def reload_tls(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """One endpoint's TLS settings: its certificate (chain) and private key, PEM files, and under mutual TLS the
    CA certificates a client certificate must be signed by. `flags` is the flags' prefix (`--http`, `--grpc`),
    for messages."""

    cert: str
    key: str
    root: str = ""
    mutual: bool = False
    flags: str = "--http"

    def read(self) -> TlsMaterial:
        """The files' bytes, checked: a certificate, a private key that belongs to it, the CA certificates."""
        cert, key = self._read(self.cert, "server-cert"), self._read(self.key, "server-key")
        try:
            chain = x509.load_pem_x509_certificates(cert)
        except ValueError:
            raise TlsError(f"{self.flags}-server-cert: '{self.cert}' holds no PEM certificate") from None
        try:
            private = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            # TypeError: an encrypted key (no passphrase can be given); ValueError: not a PEM key. The reason
            # is cryptography's (it never quotes the key).
            raise TlsError(f"{self.flags}-server-key: '{self.key}' holds no usable unencrypted PEM private key "
                           f"({_reason(exc)})") from None
        spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if chain[0].public_key().public_bytes(*spki) != private.public_key().public_bytes(*spki):
            raise TlsError(f"{self.flags}-server-key: '{self.key}' is not the private key of the certificate in "
                           f"{self.flags}-server-cert '{self.cert}'")
        root = b""
        if self.mutual:
            root = self._read(self.root, "root-cert")
            try:
                x509.load_pem_x509_certificates(root)
            except ValueError:
                raise TlsError(f"{self.flags}-root-cert: '{self.root}' holds no PEM certificate") from None
        return TlsMaterial(cert, key, root)

    def _read(self, path: str, flag: str) -> bytes:
        try:
            with open(path, "rb") as handle:
                return handle.read()
        except OSError as exc:
            raise TlsError(f"{self.flags}-{flag}: cannot read '{path}': {exc.strerror or exc}") from None


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    """What a TlsFiles held when read: PEM bytes, checked."""

    cert: bytes
    key: bytes
    root: bytes


def tls_files(flags: str, use_ssl: bool, mutual: bool, cert: str, key: str, root: str) -> TlsFiles | None:
    """The endpoint's TLS settings from its flags (`--<flags>-use-ssl[-mutual]`, `-server-cert`, `-server-key`,
    `-root-cert`), read once to check them; None without TLS. Mutual TLS implies TLS (as Triton's flags)."""
    if not use_ssl and not mutual:
        return None
    switch = f"{flags}-use-ssl-mutual" if mutual else f"{flags}-use-ssl"
    missing = [name for name, value in (("server-cert", cert), ("server-key", key)) if not value]
    if mutual and not root:
        missing.append("root-cert")
    if missing:
        needed = " and ".join(f"{flags}-{name}" for name in missing)
        raise TlsError(f"{switch} needs {needed} (PEM files)")
    files = TlsFiles(cert, key, root if mutual else "", mutual, flags)
    ssl_context(files)  # reads and checks every file, then lets OpenSSL load them too
    return files


HTTP1_ALPN = ("http/1.1",)  # HTTPS and metrics
H2_ALPN = ("h2",)  # the native gRPC server: gRPC clients ask for h2 by ALPN (HTTP/2 over TLS, RFC 9113 3.2)
# TLS 1.2 cipher suites HTTP/2 allows (RFC 9113 9.2.2: ephemeral key exchange and AEAD only), the ones gRPC core's
# own server offers and ChaCha20; TLS 1.3's suites all qualify and are not set by this.
_H2_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def ssl_context(files: TlsFiles, alpn: tuple[str, ...] = HTTP1_ALPN) -> ssl.SSLContext:
    """A server SSLContext for the files: TLS 1.2 or later, the protocol by ALPN (`alpn`: HTTP/1.1, or h2 for
    gRPC), client certificates required and verified against the root under mutual TLS."""
    material = files.read()  # clear messages for the usual faults, before OpenSSL's terse ones
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(list(alpn))
    if "h2" in alpn:  # HTTP/2 over TLS 1.2 (RFC 9113 9.2): no renegotiation, no cipher suite it forbids
        context.options |= ssl.OP_NO_RENEGOTIATION
        context.set_ciphers(_H2_TLS12_CIPHERS)
    try:
        context.load_cert_chain(files.cert, files.key)
    except ssl.SSLError as exc:
        raise TlsError(f"{files.flags}-server-cert / {files.flags}-server-key: '{files.cert}' and '{files.key}' "
                       f"cannot be used: {exc.reason or exc}") from None
    except OSError as exc:  # replaced or removed since read() above
        raise TlsError(f"{files.flags}-server-cert / {files.flags}-server-key: cannot read '{files.cert}' or "
                       f"'{files.key}': {exc.strerror or exc}") from None
    if files.mutual:
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_verify_locations(cadata=material.root.decode("ascii", errors="replace"))
        except ssl.SSLError as exc:
            raise TlsError(f"{files.flags}-root-cert: '{files.root}' cannot be used: {exc.reason or exc}") from None
    return context


class ServerTls:
    """An endpoint's TLS on an ssl.SSLContext (HTTP, metrics, the native gRPC server with `alpn` H2_ALPN): the
    context new connections get (`context`), replaced by `reload`.

    A server that takes one context for good (uvicorn and the native gRPC server: loop.create_server) gets
    `fixed_context()`: the first context, whose SNI callback moves each new connection onto the current one before
    its certificate is chosen. OpenSSL calls that callback on every ClientHello, with or without a server name
    (clients connecting to an IP address send none)."""

    def __init__(self, files: TlsFiles, name: str, alpn: tuple[str, ...] = HTTP1_ALPN) -> None:
        self.files = files
        self.name = name
        self.alpn = alpn
        self.context = ssl_context(files, alpn)
        self._first = self.context

    @property
    def mutual(self) -> bool:
        return self.files.mutual

    def reload(self) -> bool:
        """Re-read the files; new connections get the new certificate. False (and logged) when they cannot be
        used: the current certificate stays."""
        try:
            self.context = ssl_context(self.files, self.alpn)
        except TlsError as exc:
            logger.error("%s: TLS certificate not reloaded, the current one stays: %s", self.name, exc)
            return False
        logger.info("%s: TLS certificate reloaded from '%s'", self.name, self.files.cert)
        return True

    def fixed_context(self) -> ssl.SSLContext:
        self._first.sni_callback = self._follow
        return self._first

    def _follow(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        current = self.context
        if current is not context:
            connection.context = current


def asgi_tls_extension(transport: Any, mutual: bool) -> dict[str, Any]:
    """The ASGI TLS extension (scope["extensions"]["tls"]) for a connection, computed once per connection.
    `client_cert_name` is the verified client certificate's subject (RFC 4514) under mutual TLS, else None."""
    ssl_object = transport.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if mutual and ssl_object is not None else None
    return {
        "server_cert": None,
        "client_cert_chain": [ssl.DER_cert_to_PEM_cert(der)] if der else [],
        "client_cert_name": certificate_subject(der, pem=False) if der else None,
        "client_cert_error": None,
        "tls_version": _TLS_VERSIONS.get(ssl_object.version()) if ssl_object is not None else None,
        "cipher_suite": None,
    }


@functools.lru_cache(maxsize=1024)
def certificate_subject(encoded: bytes, pem: bool) -> str:
    """A certificate's subject as an RFC 4514 string (`CN=alice,O=Example`), the same for HTTP and gRPC. Cached:
    the same few client certificates come back on every connection (gRPC: every call)."""
    certificate = x509.load_pem_x509_certificate(encoded) if pem else x509.load_der_x509_certificate(encoded)
    return certificate.subject.rfc4514_string()


def grpc_peer_subject(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """The subject of the client certificate the server verified (mutual TLS), from a call's auth context (gRPC
    core's, or the native server's: `grpc_auth_context`)."""
    for pem in auth_context.get("x509_pem_cert", ()):
        return certificate_subject(pem, pem=True)
    return None


def grpc_auth_context(transport: Any) -> dict[str, list[bytes]]:
    """A native gRPC call's auth context, as gRPC core names its properties: {} on cleartext; over TLS
    `transport_security_type` "ssl", and under mutual TLS the verified client certificate as `x509_pem_cert`
    (what grpc_peer_subject reads). Asked per call, and only while some server verifies client certificates."""
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    if ssl_object is None:
        return {}
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return {"transport_security_type": [b"ssl"]}
    return {"transport_security_type": [b"ssl"], "x509_pem_cert": [_pem_certificate(der)]}


@functools.lru_cache(maxsize=1024)
def _pem_certificate(der: bytes) -> bytes:
    return ssl.DER_cert_to_PEM_cert(der).encode("ascii")


class GrpcTls:
    """A grpc.aio endpoint's TLS (`--grpc-server grpcio`; the native gRPC server uses ServerTls): dynamic server
    credentials whose certificate a reload replaces for the next handshakes (connections already made keep
    theirs)."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._lock = threading.Lock()  # the fetcher runs on gRPC core's threads, a reload on the event loop
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._configuration(), self._fetch, require_client_authentication=files.mutual
        )

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        material = self.files.read()
        ssl_context(self.files)  # OpenSSL's own check too: a pair it would refuse must not reach gRPC core
        return grpc.ssl_server_certificate_configuration(
            [(material.key, material.cert)], root_certificates=material.root or None
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration:
        # Called by gRPC core (any of its threads) before each handshake: None keeps the current configuration.
        with self._lock:
            pending, self._pending = self._pending, None
        return pending  # type: ignore[return-value]  # None is documented as "no change"; the stubs omit it

    def reload(self) -> bool:
        try:
            configuration = self._configuration()
        except TlsError as exc:
            logger.error("grpc: TLS certificate not reloaded, the current one stays: %s", exc)
            return False
        with self._lock:
            self._pending = configuration
        logger.info("grpc: TLS certificate reloaded from '%s'", self.files.cert)
        return True


def _reason(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class TlsEndpoint:
    """What a frontend that may serve TLS shares: whether it does, and re-reading its files on SIGHUP (new
    handshakes use them; open connections keep theirs). Satisfies ReloadsTls."""

    _tls: ServerTls | GrpcTls | None = None

    @property
    def serves_tls(self) -> bool:
        return self._tls is not None

    def reload_tls(self) -> None:
        if self._tls is not None:
            self._tls.reload()
