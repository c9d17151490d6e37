"""The Python backend: Triton `model.py` models (TritonPythonModel), BLS and decoupled streaming, in-process.

`triton_python_backend_utils` is registered in `sys.modules` under its Triton name here, before any model
file is imported: a model.py needs no install step or path setup, and gets the very module the backend
uses (one Tensor class, so isinstance checks hold), however geserve itself was installed.
"""

import sys

from geserve.backends.python import triton_python_backend_utils

sys.modules["triton_python_backend_utils"] = triton_python_backend_utils

from geserve.backends.python.backend import BACKEND_KIND, PythonBackend  # noqa: E402 - after the alias models need

__all__ = ["BACKEND_KIND", "PythonBackend"]
