"""What the server asks of a frontend: start serving, and stop. A new protocol is a new frontend beside these."""

from __future__ import annotations

from typing import Protocol


class Frontend(Protocol):
    """One protocol endpoint; it translates wire messages into calls of the service and nothing else."""

    name: str
    reports_arrivals: bool
    """It counts its clients in geserve.arrivals (so a dynamic batcher may dispatch early: see that module)."""

    async def start(self) -> None:
        """Bind and serve; raise when the endpoint cannot be bound (the server then does not start)."""

    async def stop(self) -> None:
        """Stop accepting, finish the calls under way, release the endpoint."""
