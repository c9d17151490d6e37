"""Echoes a BYTES and an FP32 tensor; REQUESTS tells how many requests the execute() call was handed.

TEXT starting with b"fail" answers that request with an error response; b"raise" makes execute() raise."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            values = pb_utils.get_input_tensor_by_name(request, "VALUES").as_numpy()
            first = text.reshape(-1)[0] if text.size else b""
            if first == b"raise":
                raise ValueError("identity was asked to raise")
            if first == b"fail":
                error = pb_utils.TritonError("identity was asked to fail", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            count = np.full((text.shape[0], 1), len(requests), dtype=np.int32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("TEXT_OUT", text),
                pb_utils.Tensor("VALUES_OUT", values),
                pb_utils.Tensor("REQUESTS", count),
            ]))
        return responses
