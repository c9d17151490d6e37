"""What exists on disk: the models of one or more Triton model repositories, their numeric versions, and a
fingerprint of each model folder that tells poll mode what changed since the last scan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from geserve.config.loader import CONFIG_FILENAME
from geserve.errors import InvalidArgumentError


class ModelStore:
    def __init__(self, roots: list[Path]) -> None:
        self.roots = [Path(r) for r in roots]

    def scan(self) -> dict[str, Path]:
        """Every model folder, by name; the same name in two repositories is an error, as in Triton."""
        models: dict[str, Path] = {}
        for root in self.roots:
            if not root.is_dir():
                raise InvalidArgumentError(f"failed to open model repository {root}: not a directory")
            for child in sorted(root.iterdir()):
                if not child.is_dir() or child.name.startswith("."):
                    continue
                if child.name in models:
                    raise InvalidArgumentError(
                        f"model '{child.name}' appears in multiple repositories: {models[child.name]} and {child}"
                    )
                models[child.name] = child
        return models

    def find(self, name: str) -> Path | None:
        for root in self.roots:
            candidate = root / name
            if candidate.is_dir():
                return candidate
        return None

    def snapshot(self) -> dict[str, ModelFingerprint]:
        """Every model folder's fingerprint, by model name (blocking: it walks every folder)."""
        return {name: fingerprint(model_dir) for name, model_dir in self.scan().items()}



@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What a model folder holds, as far as serving it goes: two equal fingerprints mean nothing to reload.

    `files`: (path relative to the folder, size, mtime in ns, inode) of every file in it, version folders and the
    rest alike (labels, warmup data and Python modules change what a load produces, as in Triton). Equality
    rather than Triton's "newest mtime grew": a deleted file, or one moved in with an older mtime, is a change too.
    `config`: the config's text, because a rewrite within the file system's mtime granularity that keeps the
    size (`count: 1` -> `count: 2`) changes no stat.
    """

    files: frozenset[tuple[str, int, int, int]]
    config: bytes | None


def fingerprint(model_dir: Path) -> ModelFingerprint:
    """`model_dir`'s fingerprint. Files that vanish while it is taken are left out: the next scan sees the rest."""
    files: set[tuple[str, int, int, int]] = set()
    visited: set[tuple[int, int]] = set()  # (device, inode) of folders walked: a symlink loop ends here
    for folder, dirs, names in os.walk(model_dir, followlinks=True):
        try:
            info = os.stat(folder)
        except OSError:
            dirs[:] = []
            continue
        if (info.st_dev, info.st_ino) in visited:
            dirs[:] = []
            continue
        visited.add((info.st_dev, info.st_ino))
        dirs[:] = [d for d in dirs if not _ignored(d)]
        for name in names:
            if _ignored(name):
                continue
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue
            files.add((os.path.relpath(path, model_dir), stat.st_size, stat.st_mtime_ns, stat.st_ino))
    try:
        config: bytes | None = (model_dir / CONFIG_FILENAME).read_bytes()
    except OSError:
        config = None
    return ModelFingerprint(frozenset(files), config)


def _ignored(name: str) -> bool:
    """Names that change without the model changing: hidden files (an editor's swap files), backups (`~`), and the
    `__pycache__` a Python model's own load writes beside its module (else every load would call for another)."""
    return name.startswith(".") or name.endswith("~") or name == "__pycache__"


def available_versions(model_dir: Path) -> list[int]:
    """Numeric subfolders, ascending; Triton ignores other names (and versions that are not positive)."""
    versions = []
    for child in model_dir.iterdir():
        if child.is_dir() and child.name.isdigit() and int(child.name) > 0:
            versions.append(int(child.name))
    return sorted(versions)


def select_versions(policy: model_config_pb2.ModelVersionPolicy, available: list[int]) -> list[int]:
    if policy.HasField("all"):
        return list(available)
    if policy.HasField("specific"):
        return sorted(set(policy.specific.versions))
    count = policy.latest.num_versions if policy.HasField("latest") else 1
    return available[-count:] if available else []
