"""geserve: a Triton-compatible inference server whose GE backend runs compiled graphs on any accelerator.

Glossary: one verb per layer, for the one path a request takes (tests/test_architecture.py states its stages).

- frontends (wire bytes): `decode` / `encode` a message; `begin` an inference from the bytes a connection read (its
  answer now, or a call that withdraws it and a callback later); `respond` to any other request (awaited).
- service (the one front door): `admit` a call; `submit` an inference, its one entry, every step inside it (resolve,
  prepare, deadline, run, account); `infer` is `submit` awaited; `infer_stream` streams a decoupled model's answers.
- scheduling: `enqueue` a request and await its response; `schedule` it with a callback for its outcome; `run_now`
  it on the loop where `runs_now` says it may; `withdraw` what its caller gave up.
- instances and backends: `execute` a batch.
"""

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
