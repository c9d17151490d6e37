"""The `.gem` compiled-model file: a manifest plus optimized ONNX bytes, optionally AES-256-GCM encrypted.

Layout (all integers little-endian):

    magic      b"GEMODEL\\0"            8 bytes
    header_len uint32                  length of the JSON header that follows
    header     UTF-8 JSON              {"manifest": {...}, "encryption": "none"|"aes-256-gcm",
                                        "nonce": hex, "sha256": hex}
    payload    bytes                   ONNX bytes, or AES-256-GCM ciphertext + 16-byte tag

The manifest is always readable (like `atc --mode=6`); when encrypted, the whole header is bound to the
ciphertext as GCM associated data, so editing the manifest fails the load as surely as editing the weights.
Unencrypted payloads carry a SHA-256 of the ONNX bytes. Decrypted bytes only ever live in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geserve.compiler.errors import MissingDependencyError, PackageError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"GEMODEL\0"
FORMAT_VERSION = 1
KEY_ENV = "GESERVE_MODEL_KEY"
_NONCE_BYTES = 12


@dataclass(slots=True)
class Manifest:
    """What a compiled model is and how it was made; stored in clear text at the front of the file."""

    source_hash: str
    compiler_version: str
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"dtype": "FP32", "shape": [...]}
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    batch_gears: list[int] = field(default_factory=list)
    precision: str = "force_fp32"
    quantization: str = "none"
    target: str = "cpu"
    framework: str = "onnx"
    options: dict[str, Any] = field(default_factory=dict)
    node_counts: dict[str, int] = field(default_factory=dict)  # "source" / "compiled"
    # Custom-op libraries the graph needs, relative to the served model's folder (next to config.pbtxt), and the
    # non-standard op domains it uses. Absent from older packages: read as none.
    custom_op_libraries: list[str] = field(default_factory=list)
    custom_op_domains: list[str] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    encrypted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def load_key(key_file: str | Path | None = None, env: str = KEY_ENV) -> bytes | None:
    """A 32-byte key from a file (raw 32 bytes, or 64 hex characters) or from `$GESERVE_MODEL_KEY` (hex)."""
    if key_file:
        try:
            raw = Path(key_file).read_bytes()
        except OSError as exc:
            raise PackageError(f"cannot read key file {key_file}: {exc.strerror}") from None
        return _parse_key(raw, f"key file {key_file}")
    text = os.environ.get(env, "").strip()
    return _parse_key(text.encode(), f"${env}") if text else None


def _parse_key(raw: bytes, where: str) -> bytes:
    if len(raw) == 32:
        return raw
    text = raw.strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 32:
        raise PackageError(f"{where} must hold a 256-bit key: 32 raw bytes or 64 hex characters")
    return key


def _aesgcm(key: bytes) -> AESGCM:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise MissingDependencyError("cryptography", "compiler", "encrypted models") from None
    return AESGCM(key)


def encode_package(manifest: Manifest, onnx_bytes: bytes, key: bytes | None = None) -> bytes:
    manifest.encrypted = key is not None
    header: dict[str, Any] = {"manifest": manifest.to_dict()}
    if key is None:
        header |= {"encryption": "none", "sha256": hashlib.sha256(onnx_bytes).hexdigest()}
        header_bytes = json.dumps(header, sort_keys=True).encode()
        payload = onnx_bytes
    else:
        nonce = os.urandom(_NONCE_BYTES)
        header |= {"encryption": "aes-256-gcm", "nonce": nonce.hex()}
        header_bytes = json.dumps(header, sort_keys=True).encode()
        payload = _aesgcm(key).encrypt(nonce, onnx_bytes, header_bytes)
    return MAGIC + struct.pack("<I", len(header_bytes)) + header_bytes + payload


def write_package(path: str | Path, manifest: Manifest, onnx_bytes: bytes, key: bytes | None = None) -> Path:
    """Write atomically (temporary file + rename), so a reader never sees half a package."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = encode_package(manifest, onnx_bytes, key)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return path


def _split(data: bytes, where: str) -> tuple[dict[str, Any], bytes, bytes]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise PackageError(f"{where} is not a geserve compiled model (.gem)")
    (length,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    header_bytes = data[start:start + length]
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, ValueError):
        raise PackageError(f"{where}: the package header is corrupt") from None
    return header, header_bytes, data[start + length:]


def read_manifest(path: str | Path) -> Manifest:
    """The manifest alone; needs no key."""
    header, _, _ = _split(_read(path), str(path))
    return _manifest(header, str(path))


def read_package(path: str | Path, key: bytes | None = None) -> tuple[Manifest, bytes]:
    """(manifest, ONNX bytes) of a `.gem` file, decrypted and integrity-checked in memory."""
    return decode_package(_read(path), key, str(path))


def decode_package(data: bytes, key: bytes | None = None, where: str = "package") -> tuple[Manifest, bytes]:
    header, header_bytes, payload = _split(data, where)
    manifest = _manifest(header, where)
    encryption = header.get("encryption")
    if encryption == "none":
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise PackageError(
                f"{where}: integrity check failed (SHA-256 mismatch); the file was modified or truncated"
            )
        return manifest, payload
    if encryption != "aes-256-gcm":
        raise PackageError(f"{where}: unknown encryption '{encryption}'")
    if key is None:
        raise PackageError(
            f"{where} is encrypted: give the key with ${KEY_ENV} (hex) or a key file "
            f"(--encrypt-key-file / --backend-config=ge,model-key-file=PATH)"
        )
    from cryptography.exceptions import InvalidTag

    try:
        onnx_bytes = _aesgcm(key).decrypt(bytes.fromhex(header["nonce"]), payload, header_bytes)
    except InvalidTag:
        raise PackageError(
            f"{where}: decryption failed: wrong key, or the file was modified (AES-GCM authentication failed)"
        ) from None
    return manifest, onnx_bytes


def _read(path: str | Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise PackageError(f"cannot read compiled model {path}: {exc.strerror}") from None


def _manifest(header: dict[str, Any], where: str) -> Manifest:
    data = header.get("manifest")
    if not isinstance(data, dict):
        raise PackageError(f"{where}: the package has no manifest")
    version = data.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise PackageError(
            f"{where}: package format version {version} is newer than this geserve reads ({FORMAT_VERSION})"
        )
    try:
        return Manifest.from_dict(data)
    except TypeError as exc:
        raise PackageError(f"{where}: malformed manifest: {exc}") from None


def is_package(path: str | Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(len(MAGIC)) == MAGIC
    except OSError:
        return False
