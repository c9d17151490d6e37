"""geserve-only: an `async def execute` that sleeps MS milliseconds and names the instance that ran it.

MS < 0 makes execute() raise; two instances, so two requests can sleep at the same time.
"""

import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        self.kind = args["model_instance_kind"]
        json.loads(args["model_config"])

    async def execute(self, requests):
        responses = []
        for request in requests:
            ms = int(pb_utils.get_input_tensor_by_name(request, "MS").as_numpy()[0])
            if ms < 0:
                raise ValueError(f"negative sleep {ms}")
            await asyncio.sleep(ms / 1000)
            name = np.array([f"{self.name}:{self.kind}".encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("INSTANCE", name)]))
        return responses
