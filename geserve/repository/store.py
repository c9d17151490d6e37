"""What exists on disk: the models of one or more Triton model repositories, their numeric versions, and a
fingerprint of each model folder that tells poll mode what changed since the last scan.

And the private folders of models loaded from the files a load request carried (Triton's model file override):
written under a folder of the server's own (mode 0700, in the system's temporary directory), never in a
repository. While a model has one (until it is unloaded or loaded again without files), `find` answers it instead
of the repository's folder, so every load of that model (an ensemble bringing it up, a reload) reads those files.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from geserve.config.loader import CONFIG_FILENAME, parse_config_json
from geserve.errors import GeserveError, InternalError, InvalidArgumentError

# A file is created only where nothing is: never through a link, never over another file.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o600
_FOLDER_MODE = 0o700


class ModelStore:
    def __init__(self, roots: list[Path]) -> None:
        self.roots = [Path(r) for r in roots]
        self._overrides: dict[str, Path] = {}  # model -> the private folder it loads from instead of a repository's
        self._private: Path | None = None  # the server's folder of private model folders, made on first use

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
        override = self._overrides.get(name)
        if override is not None:
            return override
        for root in self.roots:
            candidate = root / name
            if candidate.is_dir():
                return candidate
        return None

    def snapshot(self) -> dict[str, ModelFingerprint]:
        """Every model folder's fingerprint, by model name (blocking: it walks every folder)."""
        return {name: fingerprint(model_dir) for name, model_dir in self.scan().items()}

    # ---- private folders of models loaded from a request's files ------------------------------------

    def override(self, name: str) -> Path | None:
        """The private folder `name` loads from, if any."""
        return self._overrides.get(name)

    def set_override(self, name: str, model_dir: Path | None) -> None:
        """`name` loads from `model_dir` (a folder `write_override` made) from now on; None: from the repository."""
        if model_dir is None:
            self._overrides.pop(name, None)
        else:
            self._overrides[name] = model_dir

    def write_override(self, name: str, files: Mapping[str, bytes], config_json: str | None) -> Path:
        """A new private model folder for `name` holding `files` (path inside the folder -> content, paths already
        checked by the service) and the config, as config.pbtxt; blocking. Each call makes a folder of its own
        (`<private>/<unique>/<name>`), so a load never writes where a serving version reads."""
        holder = Path(tempfile.mkdtemp(prefix="load-", dir=self._private_root()))  # mode 0700
        model_dir = holder / name
        try:
            model_dir.mkdir(mode=_FOLDER_MODE)
            base = model_dir.resolve()
            for relative, content in files.items():
                _write_file(base, relative, content)
            if config_json is not None:
                _write_config(base, name, config_json)
        except BaseException:
            shutil.rmtree(holder, ignore_errors=True)
            raise
        return model_dir

    def remove_override(self, model_dir: Path) -> None:
        """Delete a private model folder `write_override` made (nothing serves from it any more); blocking."""
        if self._private is not None and model_dir.parent.parent == self._private:
            shutil.rmtree(model_dir.parent, ignore_errors=True)

    def remove_overrides(self) -> None:
        """Delete every private model folder (the server stops); blocking."""
        self._overrides.clear()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    def _private_root(self) -> Path:
        if self._private is None or not self._private.is_dir():
            self._private = Path(tempfile.mkdtemp(prefix="geserve-model-files-"))  # mode 0700, the server's own
        return self._private


def _write_file(base: Path, relative: str, content: bytes) -> None:
    """Write one file at `relative` under `base`, which must hold it: checked again on the resolved path, whatever
    the service checked, and written without following a link, creating only what is not there."""
    key = f"file:{relative}"
    target = base / relative
    resolved = target.resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise InvalidArgumentError(
            f"Invalid file parameter '{key}' with normalized path '{os.path.relpath(resolved, base)}' must stay "
            f"within model directory."
        )
    try:
        os.makedirs(target.parent, mode=_FOLDER_MODE, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # Triton's words: a file of the request is in the way
        raise InvalidArgumentError(f"Invalid file parameter '{key}', directory has been created as a file") from None
    except OSError as exc:
        raise _write_failed(key, exc) from None
    try:
        descriptor = os.open(target, _NEW_FILE, _FILE_MODE)
    except (FileExistsError, IsADirectoryError):
        raise InvalidArgumentError(f"Invalid file parameter '{key}', a directory of that name holds other files") \
            from None
    except OSError as exc:
        raise _write_failed(key, exc) from None
    with os.fdopen(descriptor, "wb") as file:
        file.write(content)


def _write_config(base: Path, name: str, config_json: str) -> None:
    """The request's config, as the folder's config.pbtxt (it overrides a `file:config.pbtxt`, as the load itself
    uses the `config` parameter), so that a later load of the model from its folder reads the same config. One that
    does not parse is left out: the load reports it, as for any load with a bad `config`."""
    try:
        config = parse_config_json(config_json, f"the 'config' parameter of the load request for '{name}'")
    except GeserveError:
        return
    path = base / CONFIG_FILENAME
    if path.is_symlink() or path.is_dir():
        raise InvalidArgumentError(f"Invalid file parameter 'file:{CONFIG_FILENAME}': it is not a file")
    path.write_text(text_format.MessageToString(config))


def _write_failed(key: str, error: OSError) -> GeserveError:
    if error.errno == errno.ENAMETOOLONG:
        return InvalidArgumentError(f"Invalid file parameter '{key}': {error.strerror}")
    return InternalError(f"failed to write the file of parameter '{key}': {error.strerror}")



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
