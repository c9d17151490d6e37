"""Custom metrics (pb_utils.MetricFamily): counts requests, keeps the sum of the last VALUES, observes each value.

OP, when sent, first runs `op_<OP>`: a misuse of the API whose TritonModelException fails the request, or a
step of the `custom_scratch` family's life (made, shared, deleted).
"""

import numpy as np
import triton_python_backend_utils as pb_utils

BUCKETS = [1.0, 5.0, 10.0]


def family(name, description, kind):
    # Triton adds MetricFamily to pb_utils after importing model.py: it cannot be read at import time.
    return pb_utils.MetricFamily(name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind))


class TritonPythonModel:
    def initialize(self, args):
        self.labels = {"version": args["model_version"], "model": args["model_name"]}
        self.requests = family("custom_requests", "Requests executed by the model", "COUNTER")
        self.request_count = self.requests.Metric(labels=self.labels)
        self.last = family("custom_last_sum", "Sum of the last request's VALUES", "GAUGE")
        self.last_sum = self.last.Metric(labels=self.labels)
        self.values = family("custom_values", "Every element of VALUES", "HISTOGRAM")
        self.value_histogram = self.values.Metric(labels=self.labels, buckets=BUCKETS)
        self.scratch = self.scratch_metric = None

    def execute(self, requests):
        responses = []
        for request in requests:
            op = pb_utils.get_input_tensor_by_name(request, "OP")
            if op is not None:
                getattr(self, "op_" + op.as_numpy().reshape(-1)[0].decode())()
            values = pb_utils.get_input_tensor_by_name(request, "VALUES").as_numpy()
            self.request_count.increment(1)
            self.last_sum.set(float(values.sum()))
            for value in values.reshape(-1):
                self.value_histogram.observe(float(value))
            count = np.array([self.request_count.value()], dtype=np.float64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("COUNT", count)]))
        return responses

    # ---- misuses: each raises pb_utils.TritonModelException ----------------------------------------

    def op_increment_negative(self):
        self.request_count.increment(-1)

    def op_set_counter(self):
        self.request_count.set(3)

    def op_observe_gauge(self):
        self.last_sum.observe(1)

    def op_value_histogram(self):
        self.value_histogram.value()

    def op_other_kind(self):
        family("custom_requests", "Requests executed by the model", "GAUGE")

    def op_invalid_name(self):
        family("custom-requests", "a dash is not allowed", "COUNTER")

    def op_invalid_label(self):
        self.requests.Metric(labels={"bad-label": "x"})

    def op_labels_not_dict(self):
        self.requests.Metric(labels=[("model", "x")])

    def op_missing_buckets(self):
        self.values.Metric(labels=self.labels)

    def op_unexpected_buckets(self):
        self.requests.Metric(labels=self.labels, buckets=BUCKETS)

    def op_deleted_family(self):
        orphan = family("custom_orphan", "deleted before its metric", "GAUGE")
        metric = orphan.Metric(labels=self.labels)
        del orphan
        metric.set(1)

    # ---- the custom_scratch family ------------------------------------------------------------------

    def op_make_scratch(self):
        self.scratch = family("custom_scratch", "Made and deleted on request", "GAUGE")
        self.scratch_metric = self.scratch.Metric(labels={"step": "made"})
        self.scratch_metric.set(0.25)
        self.scratch.Metric(labels={"step": "second"}).increment(-1.5)  # kept by its family, not by a name

    def op_share_requests(self):
        # Another object for the same family and labels adds to the same series; deleting it keeps the series
        # (geserve only: Triton 2.51 then removes the series and the first object's metric writes freed memory).
        other = family("custom_requests", "another description is ignored", "COUNTER")
        other.Metric(labels=self.labels).increment(10)

    def op_drop_scratch(self):
        self.scratch = None  # the family goes with its object: its series leave /metrics

    def op_use_dropped_scratch(self):
        self.scratch_metric.set(1)
