"""The GE (graph executor) backend on ONNX Runtime."""

from geserve.backends.ge.backend import BACKEND_KIND, GeBackend

__all__ = ["BACKEND_KIND", "GeBackend"]
