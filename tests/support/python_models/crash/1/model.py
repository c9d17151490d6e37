"""geserve-only, isolated (its config asks for a process of its own): crashes natively when asked to.

CMD >= 0 sleeps CMD milliseconds and answers the PID of the process that ran it; -1 calls os.abort(), -2 reads
address 0 (SIGSEGV), -3 exits the process with status 3, -4 leaves a file `init_aborts` beside its config, which
makes initialize() abort too (so restarts fail) until someone removes it, then aborts.
"""

import ctypes
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.poison = Path(args["model_repository"]) / "init_aborts"
        if self.poison.exists():
            os.abort()

    def execute(self, requests):
        responses = []
        for request in requests:
            command = int(pb_utils.get_input_tensor_by_name(request, "CMD").as_numpy()[0])
            if command == -1:
                os.abort()
            if command == -2:
                ctypes.string_at(0)
            if command == -3:
                os._exit(3)
            if command == -4:
                self.poison.touch()
                os.abort()
            time.sleep(command / 1000)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))]))
        return responses
