"""OUT = MS, answered MS milliseconds after the request arrived, so a test can make requests complete in any order.
Decoupled when its config says so: the response (final flag attached) is then sent from a thread."""

import json
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.threads = []

    def execute(self, requests):
        if not self.decoupled:
            return [self._answer(request) for request in requests]
        for request in requests:
            thread = threading.Thread(target=self._send, args=(request, request.get_response_sender()))
            thread.start()
            self.threads.append(thread)
        return None

    def _answer(self, request):
        ms = pb_utils.get_input_tensor_by_name(request, "MS").as_numpy()
        time.sleep(int(ms[0]) / 1000)
        return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", ms)])

    def _send(self, request, sender):
        sender.send(self._answer(request), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
