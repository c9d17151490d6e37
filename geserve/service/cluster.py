"""What the service of one worker needs from the other workers of the same server (`--workers N`; geserve/workers
implements it): control calls every worker runs, statistics from all, readiness of all, the sequence held by
another worker, and loads on demand, which the supervisor decides for all."""

from __future__ import annotations

from typing import Any, Protocol

from geserve.types.requests import InferenceRequest
from geserve.types.tensors import InferenceResponse


class Cluster(Protocol):
    @property
    def ready(self) -> bool:
        """Every worker of the server is up and serving (a restarted one is not until its models are back)."""

    async def broadcast(self, method: str, *args: Any) -> Any:
        """Run the control call `method` on every worker, this one included, as one step of the server: its result
        here, or the first error of any worker (this one's first)."""

    async def gather(self, method: str, *args: Any) -> list[Any]:
        """The result of the control call `method` on each worker, in worker order."""

    async def forward_sequence(self, request: InferenceRequest) -> InferenceResponse | None:
        """Run a request of a sequence this worker does not hold on the worker that holds it (its START came in on
        another connection); None when no worker holds it."""

    async def demand(self, name: str) -> None:
        """A request needs `name`, which this worker does not serve: have it loaded on every worker (load on
        demand), the supervisor deciding for the server under its memory budget."""
