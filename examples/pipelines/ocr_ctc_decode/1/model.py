"""Triton Python model: greedy CTC decoding of PP-OCRv4 recognizer output into strings and confidences."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils

BLANK = 0


def ctc_greedy(probs: np.ndarray, characters: list[str]) -> tuple[list[str], np.ndarray]:
    """[N, T, classes] -> N strings and their mean per-character confidence (0 when empty).

    The best class per time step; repeats collapse into one character and blanks separate real repeats.
    """
    best = probs.argmax(axis=2)
    confidence = probs.max(axis=2)
    keep = best != BLANK
    keep[:, 1:] &= best[:, 1:] != best[:, :-1]
    texts, scores = [], np.zeros(len(best), dtype=np.float32)
    for row in range(len(best)):
        texts.append("".join(characters[index] for index in best[row][keep[row]]))
        if keep[row].any():
            scores[row] = confidence[row][keep[row]].mean()
    return texts, scores


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "characters.txt")
        with open(path, encoding="utf-8") as handle:
            dictionary = handle.read().split("\n")
        # Class 0 is the CTC blank; the model's last class is the space character.
        self.characters = ["", *dictionary, " "]

    def execute(self, requests):
        responses = []
        for request in requests:
            probs = pb_utils.get_input_tensor_by_name(request, "PROBS").as_numpy()
            lines = len(pb_utils.get_input_tensor_by_name(request, "BOXES").as_numpy())
            if probs.shape[2] != len(self.characters):
                message = f"PROBS has {probs.shape[2]} classes, the dictionary {len(self.characters)}"
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
                continue
            # ocr_boxes sends one blank crop when it finds no text: decode only the rows that are boxes.
            texts, scores = ctc_greedy(probs[:lines], self.characters)
            tensors = [
                pb_utils.Tensor("TEXT", np.array([text.encode("utf-8") for text in texts], dtype=np.object_)),
                pb_utils.Tensor("SCORES", scores),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
