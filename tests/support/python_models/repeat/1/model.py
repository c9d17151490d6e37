"""Decoupled: one response per element of IN, sent from a thread after execute() returns, then the final flag.

Special elements: -1 sends an error response in the stream; -2 makes execute() raise; -3 (last) attaches the
final flag to the previous response instead of sending it alone; -4 stops without ever sending the final flag;
-5 makes execute() ignore the request altogether.
"""

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise pb_utils.TritonModelException("repeat must be decoupled")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().tolist()
            if -2 in values:
                raise ValueError("repeat was asked to raise")
            if -5 in values:
                continue
            thread = threading.Thread(target=self._send, args=(request.get_response_sender(), values))
            thread.start()
            self.threads.append(thread)
        return None

    def _send(self, sender, values):
        attach_final = bool(values) and values[-1] == -3
        values = values[:-1] if attach_final else values
        for index, value in enumerate(values):
            if value == -4:
                return
            if value == -1:
                error = pb_utils.TritonError(f"element {index} is negative")
                sender.send(pb_utils.InferenceResponse(error=error))
                continue
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
            ])
            last = attach_final and index == len(values) - 1
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
        if not attach_final:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
