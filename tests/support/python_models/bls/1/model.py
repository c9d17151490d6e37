"""BLS: calls add_sub (exec and async_exec), the ONNX model `simple`, a model that does not exist and the
decoupled `repeat`, from an `async def execute`, and returns what each call gave."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        return [await self._one(request) for request in requests]

    async def _one(self, request):
        in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0")
        in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1")

        add_sub = pb_utils.InferenceRequest(
            model_name="add_sub", requested_output_names=["OUTPUT0"], inputs=[in0, in1]
        )
        summed = add_sub.exec()
        if summed.has_error():
            raise pb_utils.TritonModelException(summed.error().message())
        diff_request = pb_utils.InferenceRequest(
            model_name="add_sub", requested_output_names=["OUTPUT1"],
            inputs=[pb_utils.Tensor("INPUT0", in0.as_numpy()), pb_utils.Tensor("INPUT1", in1.as_numpy())],
        )
        diff = await diff_request.async_exec()

        row = np.tile(in0.as_numpy().astype(np.int32), 4).reshape(1, 16)
        simple = await pb_utils.InferenceRequest(
            model_name="simple", requested_output_names=["OUTPUT0", "OUTPUT1"],
            inputs=[pb_utils.Tensor("INPUT0", row), pb_utils.Tensor("INPUT1", row)],
        ).async_exec()
        if simple.has_error():
            raise pb_utils.TritonModelException(simple.error().message())

        missing = pb_utils.InferenceRequest(
            model_name="no_such_model", requested_output_names=["OUT"],
            inputs=[pb_utils.Tensor("IN", np.zeros(1, np.float32))],
        ).exec()
        missing_text = f"{missing.has_error()}|{missing.error().message() if missing.has_error() else ''}"

        stream = pb_utils.InferenceRequest(
            model_name="repeat", requested_output_names=["OUT", "IDX"],
            inputs=[pb_utils.Tensor("IN", np.array([5, 6, 7], dtype=np.int32))],
        ).exec(decoupled=True)
        repeated, responses = [], 0
        for response in stream:
            responses += 1
            out = pb_utils.get_output_tensor_by_name(response, "OUT")
            if out is not None:
                repeated.append(int(out.as_numpy()[0]))

        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(summed, "OUTPUT0").as_numpy()),
            pb_utils.Tensor("DIFF", pb_utils.get_output_tensor_by_name(diff, "OUTPUT1").as_numpy()),
            pb_utils.Tensor("SIMPLE", pb_utils.get_output_tensor_by_name(simple, "OUTPUT0").as_numpy()[0]),
            pb_utils.Tensor("MISSING", np.array([missing_text.encode()], dtype=np.object_)),
            pb_utils.Tensor("REPEATED", np.array(repeated, dtype=np.int32)),
            pb_utils.Tensor("REPEAT_RESPONSES", np.array([responses], dtype=np.int32)),
        ])
