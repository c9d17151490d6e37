"""Y = X + 1; X = 99 gets an error response (for ensembles after the decoupled `repeat`)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] == 99:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("inc refuses 99")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
        return responses
