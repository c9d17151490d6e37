"""Certificates for the TLS tests and benchmark, made with `cryptography`: CAs, a server certificate for
127.0.0.1 and localhost, client certificates. Nothing is fixed in the tree; every run makes its own.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass
class Issued:
    """A certificate and its key, as objects and as PEM files (written by `write`)."""

    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path | None = None
    key_path: Path | None = None

    @property
    def cert_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @property
    def subject(self) -> str:
        return self.certificate.subject.rfc4514_string()

    def write(self, directory: Path, stem: str) -> Issued:
        directory.mkdir(parents=True, exist_ok=True)
        self.cert_path, self.key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        self.cert_path.write_bytes(self.cert_pem)
        self.key_path.write_bytes(self.key_pem)
        return self


def _name(common_name: str, organization: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_ca(common_name: str = "geserve test CA") -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name, "geserve tests")
    certificate = (
        _builder(name, name, key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(certificate, key)


def issue(ca: Issued, common_name: str, server: bool, organization: str = "geserve tests") -> Issued:
    """A leaf certificate signed by `ca`: for a server (SAN 127.0.0.1 and localhost) or a client."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        _builder(_name(common_name, organization), ca.certificate.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                              else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]), critical=False)
    return Issued(builder.sign(ca.key, hashes.SHA256()), key)


def client_context(ca: Issued | None, client: Issued | None = None) -> ssl.SSLContext:
    """A client SSLContext trusting `ca` (None: the system's CAs), presenting `client`'s certificate if given."""
    context = ssl.create_default_context(cadata=ca.cert_pem.decode() if ca is not None else None)
    if client is not None:
        assert client.cert_path is not None and client.key_path is not None
        context.load_cert_chain(client.cert_path, client.key_path)
    return context
