"""A model's instances: each batch goes to the first free instance, on that instance's own worker thread."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from geserve.backends.base import ModelInstance
from geserve.core.statistics import ModelStatistics
from geserve.errors import GeserveError, InternalError
from geserve.types import InferenceRequest, InferenceResponse

Results = list[InferenceResponse | GeserveError]


class InstancePool:
    def __init__(self, model_name: str, instances: list[ModelInstance], statistics: ModelStatistics) -> None:
        if not instances:
            raise InternalError(f"model '{model_name}' has no instances to execute on")
        self._instances = instances
        self._statistics = statistics
        self._free: asyncio.Queue[ModelInstance] = asyncio.Queue()
        for instance in instances:
            self._free.put_nowait(instance)
        # One thread per instance: N instances really execute N batches at once (ONNX Runtime drops the GIL).
        self._executor = ThreadPoolExecutor(max_workers=len(instances), thread_name_prefix=f"ge-{model_name}")

    @property
    def size(self) -> int:
        return len(self._instances)

    async def execute(self, requests: list[InferenceRequest], enqueued_ns: list[int]) -> Results:
        instance = await self._free.get()
        try:
            started = time.monotonic_ns()
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._executor, _timed_execute, instance, requests)
        finally:
            self._free.put_nowait(instance)
        responses, (input_ns, infer_ns, output_ns) = results
        rows = sum(r.batch_size for r in requests)
        self._statistics.record_execution(
            len(requests), rows, [started - t for t in enqueued_ns], input_ns, infer_ns, output_ns
        )
        return responses

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for instance in self._instances:
            instance.finalize()


def _timed_execute(instance: ModelInstance, requests: list[InferenceRequest]) -> tuple[Results, tuple[int, int, int]]:
    start = time.monotonic_ns()
    responses = instance.execute(requests)
    elapsed = time.monotonic_ns() - start
    phases = getattr(instance, "last_phase_ns", None)
    return responses, (phases if phases is not None else (0, elapsed, 0))
