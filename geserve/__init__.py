"""geserve: a Triton-compatible inference server whose GE backend runs compiled graphs on any accelerator."""

from geserve.errors import ErrorCode, GeserveError
from geserve.server import Server
from geserve.settings import ServerSettings
from geserve.types import InferenceRequest, InferenceResponse, InputTensor, OutputTensor, RequestedOutput
from geserve.version import __version__

__all__ = [
    "ErrorCode",
    "GeserveError",
    "InferenceRequest",
    "InferenceResponse",
    "InputTensor",
    "OutputTensor",
    "RequestedOutput",
    "Server",
    "ServerSettings",
    "__version__",
]
