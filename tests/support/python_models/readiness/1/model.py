"""A model whose readiness is its own: is_ready() answers what the last request set.

The mode lives in a file beside the model, so both instances (each with its own import) agree on it.
"""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.mode_file = f"{args['model_repository']}/mode"

    def execute(self, requests):
        responses = []
        for request in requests:
            wanted = int(pb_utils.get_input_tensor_by_name(request, "READY").as_numpy()[0])
            previous = self._mode()
            with open(self.mode_file, "w") as handle:
                handle.write(str(wanted))
            out = pb_utils.Tensor("PREVIOUS", np.array([previous], dtype=np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses

    def _mode(self):
        try:
            with open(self.mode_file) as handle:
                return int(handle.read())
        except FileNotFoundError:
            return 1

    def is_ready(self):
        mode = self._mode()
        if mode == 2:
            raise RuntimeError("cannot tell")
        return mode == 1
