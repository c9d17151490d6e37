"""Python models in processes of their own, when the config asks:
`parameters { key: "isolation" value: { string_value: "process" } }`.

Each instance runs in a child process, as Triton's stub runs each Python model instance: a native crash there fails
only the requests that process held, and the instance restarts; unloading ends the process, and its memory with it.
In-process stays the default, which is what makes geserve's Python models cheap per request (the measured cost of
each is in docs/guide/ensembles-python.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from google.protobuf import json_format

from geserve.backends.base import InferenceHost
from geserve.backends.python.isolation.instance import InstanceSpec, IsolatedInstance
from geserve.backends.python.isolation.process import ModelProcess, how_it_ended
from geserve.backends.python.isolation.session import Session
from geserve.backends.python.isolation.spares import Spares, Started
from geserve.backends.python.metrics import MetricStore
from geserve.config import ModelConfig, message_to_json_dict
from geserve.errors import InvalidArgumentError, UnavailableError
from geserve.ipc.peer import PeerGone

PARAMETER = "isolation"
MODES = {"process": True, "none": False, "": False}
PARAMETER_DESCRIPTIONS = {  # one line each on the site's reference/parameters.md (docs/hooks/reference_parameters.py)
    PARAMETER: "process: each instance of the Python model runs in a process of its own (a native crash fails only "
               "the requests it held and the instance restarts; unloading ends the process); none (default): in "
               "the server's process. See Ensembles and Python models.",
}

__all__ = ["PARAMETER", "InstanceSpec", "IsolatedInstance", "Spares", "complete_config", "start_instance", "wanted"]


def wanted(config: ModelConfig) -> bool:
    """Whether the config asks for the model's instances to run in processes of their own."""
    if PARAMETER not in config.parameters:
        return False
    value = config.parameters[PARAMETER].string_value.strip().lower()
    if value not in MODES:
        raise InvalidArgumentError(
            f"parameter '{PARAMETER}' of Python model '{config.name}' is '{value}'; expected 'process' or 'none'"
        )
    return MODES[value]


def start_instance(spec: InstanceSpec, host: InferenceHost, store: MetricStore, spares: Spares) -> IsolatedInstance:
    """An instance whose process has started and initialized the model (from a thread other than the loop's)."""
    instance = IsolatedInstance(spec, host, store, spares)
    instance.initialize()
    return instance


def complete_config(config: ModelConfig, path: Path, host: InferenceHost, store: MetricStore, spares: Spares) -> None:
    """Run the model's auto_complete_config in a process of its own (from a thread other than the loop's), kept a
    while for the model's first instance, and take the config it completed."""
    loop = host.loop
    if loop is None or loop.is_closed():
        raise UnavailableError(f"Python model '{config.name}' needs a running server to complete its config")
    completed = asyncio.run_coroutine_threadsafe(_complete(config, str(path), host, store, spares), loop).result()
    parsed = ModelConfig()
    json_format.ParseDict(completed, parsed)
    config.CopyFrom(parsed)


async def _complete(
    config: ModelConfig, path: str, host: InferenceHost, store: MetricStore, spares: Spares
) -> dict[str, object]:
    session = Session(config.name, host, store)
    process = await ModelProcess.start(config.name, session.handle)
    session.channel, session.pid = process.channel, process.pid
    started = Started(process, session)
    try:
        completed: dict[str, object] = await process.channel.call("auto_complete", message_to_json_dict(config), path)
    except PeerGone:
        status = await process.wait()
        await started.stop()
        raise InvalidArgumentError(
            f"auto_complete_config of Python model '{config.name}' failed: its process {how_it_ended(status)}"
        ) from None
    except BaseException:
        await started.stop()
        raise
    spares.keep(path, started)
    return completed
