"""No config.pbtxt: auto_complete_config declares everything. ARGS returns initialize()'s args as JSON."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(4)
        auto_complete_model_config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [3]})
        auto_complete_model_config.add_output({"name": "ARGS", "data_type": "TYPE_STRING", "dims": [1]})
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def initialize(self, args):
        self.args = json.dumps(args, sort_keys=True)

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            args = np.array([[self.args.encode()]] * x.shape[0], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("ARGS", args),
            ]))
        return responses
