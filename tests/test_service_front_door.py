"""Every call of every protocol enters through the one service, under Triton's API group, with its call context.

A real in-process server with its real HTTP and gRPC frontends, driven by the real tritonclient (asyncio
flavours, on the server's own loop); a call policy records what the service admits, or refuses a group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc.aio as grpcclient
import tritonclient.http.aio as httpclient
from tritonclient.utils import InferenceServerException

from geserve import Server, ServerSettings
from geserve.errors import UnavailableError
from geserve.service.context import ApiGroup, CallContext, Transport
from tests.support.reference import free_port
from tests.support.security import simple_inputs


class RecordingPolicy:
    """Records each admitted call; refuses the groups in `refused`."""

    def __init__(self) -> None:
        self.calls: list[tuple[ApiGroup, CallContext]] = []
        self.refused: set[ApiGroup] = set()

    def admit(self, group: ApiGroup, context: CallContext) -> None:
        self.calls.append((group, context))
        if group in self.refused:
            raise UnavailableError(f"the {group.value} API is refused by policy")


def _calls(client: Any, module: Any) -> list[tuple[ApiGroup, Callable[[], Awaitable[Any]]]]:
    """One call of each API group, and the group the service must see it under."""
    return [
        (ApiGroup.HEALTH, client.is_server_live),
        (ApiGroup.HEALTH, client.is_server_ready),
        (ApiGroup.HEALTH, lambda: client.is_model_ready("simple")),
        (ApiGroup.METADATA, client.get_server_metadata),
        (ApiGroup.METADATA, lambda: client.get_model_metadata("simple")),
        (ApiGroup.MODEL_CONFIG, lambda: client.get_model_config("simple")),
        (ApiGroup.INFERENCE, lambda: client.infer("simple", simple_inputs(module))),
        (ApiGroup.STATISTICS, lambda: client.get_inference_statistics("simple")),
        (ApiGroup.MODEL_REPOSITORY, client.get_model_repository_index),
        (ApiGroup.SHARED_MEMORY, client.get_system_shared_memory_status),
        (ApiGroup.TRACE, client.get_trace_settings),
        (ApiGroup.LOGGING, client.get_log_settings),
    ]


def test_every_call_enters_through_the_service_under_its_group(good_repo: Path) -> None:
    http_port, grpc_port = free_port(), free_port()
    policy = RecordingPolicy()
    settings = ServerSettings(model_repositories=[good_repo], http_port=http_port, grpc_port=grpc_port,
                              allow_metrics=False, http_address="127.0.0.1", grpc_address="127.0.0.1")

    async def run() -> None:
        server = Server(settings, policies=[policy])
        await server.start()
        http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            for transport, client, module in ((Transport.HTTP, http, httpclient), (Transport.GRPC, grpc, grpcclient)):
                for group, call in _calls(client, module):
                    policy.calls.clear()
                    await call()
                    assert [g for g, _ in policy.calls] == [group], (transport, group, policy.calls)
                    context = policy.calls[0][1]
                    assert context.transport is transport and context.peer, context
                # The headers (gRPC metadata) travel in the context.
                policy.calls.clear()
                await client.get_server_metadata(headers={"x-team": "vision"})
                assert policy.calls[0][1].headers.get("x-team") == "vision"

            policy.refused = {ApiGroup.INFERENCE}
            for client, module in ((http, httpclient), (grpc, grpcclient)):
                with pytest.raises(InferenceServerException, match="refused by policy") as refused:
                    await client.infer("simple", simple_inputs(module))
                assert refused.value.status() in ("503", "StatusCode.UNAVAILABLE")
                assert await client.is_server_live()  # the other groups still answer
        finally:
            await http.close()
            await grpc.close()
            await server.stop()

    asyncio.run(run())
