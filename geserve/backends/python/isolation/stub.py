"""The program an isolated Python model instance runs as: `python -m geserve.backends.python.isolation.stub SOCKET
LANE TO_STUB FROM_STUB LEVEL` (descriptors its server passed: its channel, the lane of the batches to execute, the
segment it reads, the segment it writes; the server's log level).

It serves the server's calls (initialize, is_ready, finalize, auto_complete on the channel; execute on the lane) on
the backend's own PythonInstance, whose code runs on threads of its own while this process' event loop carries the
channel. It ends
when the server closes the channel (after finalize, or the server is gone); signals to the server's process group
(Ctrl-C, a service manager's SIGTERM) are the server's to act on, which finalizes the model first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import json_format

from geserve.backends.python import completion, loader, metrics, runtime
from geserve.backends.python.instance import PythonInstance
from geserve.backends.python.isolation.channel import Channel
from geserve.backends.python.isolation.remote import (
    ForwardingHandler,
    RemoteHost,
    RemoteMetricStore,
    RemoteRequest,
    RequestFields,
)
from geserve.config import ModelConfig, message_to_json_dict
from geserve.devices import compute_priority
from geserve.errors import InternalError
from geserve.ipc import lane
from geserve.types import InferenceRequest

_T = TypeVar("_T")


class Stub:
    """One model instance served over one channel."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self.host = RemoteHost(channel)
        self.store = RemoteMetricStore(channel)
        # One thread runs the model's initialize, execute and finalize, as the server's instance thread would.
        self._model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")
        self._instance: PythonInstance | None = None

    async def handle(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "bls_item":
            self.host.stream_item(*args)
            return None
        if method == "hello":
            return os.getpid()
        if method == "initialize":
            return await self._on_model_thread(self._initialize, *args)
        if method == "is_ready":
            return await asyncio.to_thread(self._ready().is_ready)  # as the server asks: while it may execute
        if method == "finalize":
            return await self._on_model_thread(self._finalize)
        if method == "auto_complete":
            return await self._on_model_thread(self._auto_complete, *args)
        raise InternalError(f"unknown call '{method}' to a Python model's process")

    async def _on_model_thread(self, function: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, function, *args)

    def _ready(self) -> PythonInstance:
        if self._instance is None:
            raise InternalError("the Python model's process has no initialized instance")
        return self._instance

    def _initialize(
        self, path: str, model_name: str, name: str, outputs: list[str], decoupled: bool, args: dict[str, str]
    ) -> bool:
        """Import and initialize the instance; whether its readiness asks the model."""
        module, scope = loader.import_for_instance(self.store, Path(path), model_name, name)
        instance = PythonInstance(name, module, self.host, outputs, decoupled, scope)
        instance.initialize(args)
        self._instance = instance
        # What the imports and initialize() made stays out of the collector's sight, as the server does with its heap
        # once started: a full collection would stall the next execution.
        gc.collect()
        gc.freeze()
        return instance.checks_readiness

    def serve_lane(self, sock: socket.socket) -> None:
        """Execute the batches the lane brings, on this (the lane's own) thread."""
        lane.serve(sock, self._channel.codec, self._lane_call)

    def _lane_call(self, method: str, batch: list[RequestFields]) -> list[Any]:
        if method != "execute":
            raise InternalError(f"unknown call '{method}' on a Python model's lane")
        requests: list[InferenceRequest] = [RemoteRequest.adopt(fields, self._channel) for fields in batch]
        return self._ready().execute(requests).results

    def _finalize(self) -> None:
        if self._instance is not None:
            self._instance.finalize()
            self._instance = None

    def _auto_complete(self, config_json: dict[str, Any], path: str) -> dict[str, Any]:
        config = ModelConfig()
        json_format.ParseDict(config_json, config)
        completion.complete(config, Path(path), self.store)
        return message_to_json_dict(config)


async def serve(sock: socket.socket, lane_sock: socket.socket, to_stub: int, from_stub: int) -> None:
    channel = Channel(asyncio.get_running_loop(), out_fd=from_stub, in_fd=to_stub, name="python-model-stub")
    os.close(to_stub)
    os.close(from_stub)
    stub = Stub(channel)
    runtime.set_default_host(stub.host)  # threads the model starts itself reach the server too
    metrics.set_default_store(stub.store)
    logging.getLogger().addHandler(ForwardingHandler(channel))
    await channel.open(sock, stub.handle)
    threading.Thread(target=stub.serve_lane, args=(lane_sock,), name="execute", daemon=True).start()
    await channel.closed.wait()


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sock_fd, lane_fd, to_stub, from_stub, level = (int(value) for value in argv)
    logging.getLogger().setLevel(level)  # the server's level at start; it filters again by its own on arrival
    logging.getLogger("geserve.python_model").setLevel(logging.DEBUG)  # pb_utils.Logger: verbose may be turned on
    compute_priority.configure(0)  # the server started this whole process at its compute threads' priority
    try:
        asyncio.run(serve(socket.socket(fileno=sock_fd), socket.socket(fileno=lane_fd), to_stub, from_stub))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # threads the model left running (a decoupled model's senders) do not hold the exit


if __name__ == "__main__":
    main(sys.argv[1:])
