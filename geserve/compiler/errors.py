"""The compiler's own errors (the compiler imports no serving code); the CLI and the GE backend map them."""

from __future__ import annotations


class CompilerError(Exception):
    """A model or an option the compiler cannot handle; the message is one line meant for the user."""


class MissingDependencyError(CompilerError):
    """An optional front end or pass needs a package that is not installed."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(f"{purpose} needs the '{package}' package: pip install 'geserve[{extra}]'")


class PackageError(CompilerError):
    """A `.gem` file that cannot be read: not a package, wrong key, missing key, or failed integrity check."""
