"""geserve's gRPC servicer behind Ray Serve's gRPC proxy: one forwarding method per unary RPC of
`inference.GRPCInferenceService`, and the servicer context it expects made from Ray's request context.

Ray's proxy registers the service with tritonclient's `add_GRPCInferenceServiceServicer_to_server` (through
ray_grpc_proto, `grpc_servicer_functions`) and calls the deployment's method named like the RPC with the decoded
request (for the bidirectional `ModelStreamInfer`, an input stream) and a `grpc_context` keyword.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from geserve.frontends.grpc.server import GrpcInferenceServicer
from geserve.integrations.ray_grpc_proto import SERVICER_FUNCTION

__all__ = ["SERVICER_FUNCTION", "UNARY_RPCS", "forwarder", "stream_infer"]


UNARY_RPCS = (
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelConfig",
    "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
    "LogSettings",
)


class RayGrpcContext:
    """The part of grpc.aio.ServicerContext that geserve's servicer uses, over Ray's RayServegRPCContext.

    `abort` sets the status on Ray's context and raises: Ray keeps a status set before an exception and the proxy
    answers the client with it, as a grpc.aio server answers an abort."""

    def __init__(self, ray_context: Any) -> None:
        self._ray = ray_context

    def peer(self) -> str:
        return str(self._ray.peer() or "")

    def invocation_metadata(self) -> Sequence[tuple[str, Any]]:
        return list(self._ray.invocation_metadata() or ())

    def time_remaining(self) -> float | None:
        return None  # Ray's proxy keeps the client's deadline; the replica is not told it

    def cancelled(self) -> bool:
        return False

    def auth_context(self) -> dict[str, Any]:
        return dict(self._ray.auth_context() or {})

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[Any] = ()) -> None:
        self._ray.set_code(code)
        self._ray.set_details(details)
        if trailing_metadata:
            self._ray.set_trailing_metadata(list(trailing_metadata))
        raise grpc.aio.AbortError(details)


Forwarder = Callable[[Any, Any, Any], Awaitable[Any]]


def forwarder(rpc: str) -> Forwarder:
    """The deployment method for `rpc`: geserve's servicer method with Ray's context adapted."""

    async def method(self: Any, request: Any, grpc_context: Any = None) -> Any:
        servicer: GrpcInferenceServicer = self.grpc_servicer
        return await getattr(servicer, rpc)(request, RayGrpcContext(grpc_context))

    method.__name__ = method.__qualname__ = rpc
    return method


class _StreamContext(RayGrpcContext):
    """A stream's context: `write` hands each response to the generator that Ray reads them from."""

    def __init__(self, ray_context: Any, queue: asyncio.Queue[Any]) -> None:
        super().__init__(ray_context)
        self._queue = queue

    async def write(self, message: Any) -> None:
        await self._queue.put(message)


async def stream_infer(self: Any, request_iterator: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
    """ModelStreamInfer (bidirectional; Ray 2.5x+ forwards such RPCs as an input stream and a generator)."""
    servicer: GrpcInferenceServicer = self.grpc_servicer
    queue: asyncio.Queue[Any] = asyncio.Queue()
    context: Any = _StreamContext(grpc_context, queue)  # what the servicer uses of a grpc.aio context
    call = asyncio.ensure_future(servicer.ModelStreamInfer(request_iterator, context))
    call.add_done_callback(lambda _: queue.put_nowait(_END))
    try:
        while (item := await queue.get()) is not _END:
            yield item
        await call  # an abort raises here, with the status already set on Ray's context
    finally:
        call.cancel()


stream_infer.__name__ = stream_infer.__qualname__ = "ModelStreamInfer"
_END = object()
