"""What exists on disk: the models of one or more Triton model repositories and their numeric versions."""

from __future__ import annotations

from pathlib import Path

from tritonclient.grpc import model_config_pb2

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
