"""One isolated Python model instance's process, as the server holds it: started (a fresh interpreter running
isolation/stub.py, never a fork of the server's threads), connected, watched until it ends, and ended.

It gets two socket pairs (its channel, and the lane batches to execute take) and two sparse shared memory segments at
start (inherited descriptors), runs in a session of
its own (a terminal's Ctrl-C is the server's to act on) and ends when its channel closes, so a server killed outright
takes its model processes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import geserve.errors
from geserve.backends.python.isolation.channel import Channel, Handler
from geserve.devices import compute_priority
from geserve.errors import GeserveError, UnavailableError
from geserve.ipc.arena import create_segment
from geserve.ipc.lane import Lane

logger = logging.getLogger(__name__)

STUB_MODULE = "geserve.backends.python.isolation.stub"
START_TIMEOUT_S = 120.0  # a fresh interpreter importing numpy and the backend: ~1-2 s here, far more on a busy host
STOP_TIMEOUT_S = 10.0  # after its channel closes, the time a process has to exit before it is killed
# Where geserve itself was imported from, so the process imports the same code whatever the server's sys.path was.
_PACKAGE_ROOT = str(Path(geserve.errors.__file__).resolve().parents[1])


def _environment() -> dict[str, str]:
    environment = dict(os.environ)
    paths = [_PACKAGE_ROOT, *filter(None, environment.get("PYTHONPATH", "").split(os.pathsep))]
    environment["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return environment


def how_it_ended(returncode: int | None) -> str:
    """'killed by SIGABRT', 'exited with status 3', or 'lost' while the exit status is not known yet."""
    if returncode is None:
        return "lost its connection"
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class ModelProcess:
    """A started process and its channel; `ended` is set once the channel closed (the process exited, or is about
    to: `wait` has its exit status)."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], channel: Channel, lane: socket.socket) -> None:
        self.name = name
        self.process = process
        self.channel = channel
        self.lane = Lane(lane, channel.codec)  # execute(): from the instance's thread straight to the model's
        # Its exit, seen on the loop through a pidfd: waiting takes no thread (the loads that start processes may
        # hold every thread of the loop's default executor, waiting on this very loop).
        self._exited = asyncio.Event()
        self._exited_now = threading.Event()  # the same, for other threads
        self._pidfd = os.pidfd_open(process.pid)
        channel.loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        if self.process.poll() is not None:
            self.channel.loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._exited.set()
            self._exited_now.set()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def ended(self) -> asyncio.Event:
        return self.channel.closed

    @classmethod
    async def start(cls, name: str, handler: Handler) -> ModelProcess:
        """Start the process and wait until it answers (it has imported the backend); UnavailableError if it
        exits first."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        lane, their_lane = socket.socketpair()
        to_stub, from_stub = create_segment(name=f"{name}-in"), create_segment(name=f"{name}-out")
        passed = (theirs.fileno(), their_lane.fileno(), to_stub, from_stub)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", STUB_MODULE, *map(str, passed), str(logging.getLogger().getEffectiveLevel())],
                pass_fds=passed, start_new_session=True, stdin=subprocess.DEVNULL, env=_environment(),
            )
            compute_priority.lower_process(process.pid)  # all of it compute: below the event loop
            channel = Channel(loop, out_fd=to_stub, in_fd=from_stub, name=f"python-model-{name}")
        finally:
            theirs.close()
            their_lane.close()
            os.close(to_stub)
            os.close(from_stub)
        started = cls(name, process, channel, lane)
        try:
            await channel.open(ours, handler)
            await asyncio.wait_for(channel.call("hello"), START_TIMEOUT_S)
        except BaseException as exc:  # cancelled (an unload during a restart) too: the process must not stay
            status = await started.stop()
            if isinstance(exc, GeserveError | TimeoutError):
                raise UnavailableError(
                    f"the process of Python model instance '{name}' {how_it_ended(status)} before it started"
                ) from None
            raise
        return started

    def poll(self, timeout: float) -> int | None:
        """The exit status, waiting up to `timeout` on this thread (not the loop's) for the process to exit (None if
        it has not)."""
        self._exited_now.wait(timeout)
        return self.process.returncode

    async def wait(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """The exit status, once the process exited within `timeout` (None if it has not)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._exited.wait(), timeout)
        return self.process.returncode

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Close the channel (the process exits on its own), killing it if it has not within `timeout`."""
        self.lane.close()
        await self.channel.close()
        status = await self.wait(timeout)
        if status is None:
            logger.warning("the process of Python model instance '%s' (pid %d) did not exit within %.0f s after "
                           "its server let go of it: killing it", self.name, self.pid, timeout)
            self.kill()
            status = await self.wait()
        return status if status is not None else -signal.SIGKILL

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
