"""The GE (graph executor) backend on ONNX Runtime."""

from geserve.backends.ge.backend import GeBackend

__all__ = ["GeBackend"]
