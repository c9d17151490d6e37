"""Triton Python model: ImageNet logits -> top-5 class names (BYTES) and softmax probabilities (FP32)."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils

TOP = 5


def top_classes(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, classes] logits -> ([N, TOP] names, [N, TOP] probabilities), most likely first."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    best = np.argsort(-probabilities, axis=1, kind="stable")[:, :TOP]
    return labels[best], np.take_along_axis(probabilities, best, axis=1).astype(np.float32)


class TritonPythonModel:
    def initialize(self, args):
        with open(os.path.join(args["model_repository"], "labels.txt"), encoding="utf-8") as handle:
            names = [line.rstrip("\n") for line in handle if line.strip()]
        self.labels = np.array([name.encode() for name in names], dtype=np.object_)

    def execute(self, requests):
        # One softmax over every request's rows; the batch is split back afterwards.
        logits = [pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy() for request in requests]
        names, scores = top_classes(np.concatenate(logits), self.labels)
        bounds = np.cumsum([len(rows) for rows in logits])[:-1]
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("LABELS", request_names), pb_utils.Tensor("SCORES", request_scores)]
            )
            for request_names, request_scores in zip(np.split(names, bounds), np.split(scores, bounds), strict=True)
        ]
