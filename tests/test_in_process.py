"""The public in-process API: a Server without any frontend, driven through its inference service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from geserve import GeserveError, InferenceRequest, InputTensor, RequestedOutput, Server, ServerSettings


def test_in_process_inference_and_shutdown(good_repo: Path) -> None:
    async def run() -> None:
        server = Server(ServerSettings(model_repositories=[good_repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False))
        await server.start()
        assert server.service.ready()
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        request = InferenceRequest(
            "simple", "", [InputTensor("INPUT1", "INT32", a.shape, a), InputTensor("INPUT0", "INT32", a.shape, a)],
            outputs=[RequestedOutput("OUTPUT1")],
        )
        response = await server.service.infer(request)
        assert [o.name for o in response.outputs] == ["OUTPUT1"] and response.model_version == "1"
        np.testing.assert_array_equal(response.outputs[0].data, np.zeros_like(a))
        with pytest.raises(GeserveError, match="unknown model"):
            await server.service.infer(InferenceRequest("nope", "", []))
        await server.stop()
        assert not server.service.ready()

    asyncio.run(run())


def test_a_server_without_frontends_keeps_batches_to_their_delay(
    good_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process callers report no arrivals: a server with no frontend must not tell the batchers that no request
    can come (early dispatch would send batches before their delay while callers can still add to them)."""
    from geserve import server as server_module
    from geserve.arrivals import Arrivals

    arrivals = Arrivals()
    monkeypatch.setattr(server_module, "ARRIVALS", arrivals)

    async def run() -> None:
        server = Server(ServerSettings(model_repositories=[good_repo], allow_http=False, allow_grpc=False,
                                       allow_metrics=False))
        await server.start()
        try:
            assert arrivals.open_ended == 1 and not arrivals.quiet(0)
        finally:
            await server.stop()

    asyncio.run(run())
