"""The GE model compiler (geserve's `atc`): framework model -> optimized, self-describing `.gem` package."""

from geserve.compiler.errors import CompilerError, PackageError
from geserve.compiler.options import CompileOptions
from geserve.compiler.package import Manifest, read_package, write_package

__all__ = ["CompileOptions", "CompilerError", "Manifest", "PackageError", "read_package", "write_package"]
