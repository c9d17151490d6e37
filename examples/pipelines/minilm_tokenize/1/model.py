"""Triton Python model: sentences -> MiniLM input_ids / attention_mask with the `tokenizers` library."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer

MAX_TOKENS = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2
# Requests are padded to a multiple of this many tokens: sentences of about the same length then share a shape, which
# minilm's dynamic batcher needs to run them as one batch, and no batch pads short sentences to the longest one.
PAD_TO = 16


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", pad_to_multiple_of=PAD_TO)

    def execute(self, requests):
        # Each request is padded on its own (its longest sentence, rounded up to PAD_TO): its rows keep the shape a
        # lone request would get.
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            try:
                sentences = [bytes(text).decode("utf-8") for text in texts]
            except UnicodeDecodeError as error:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"TEXT is not UTF-8: {error}")))
                continue
            encodings = self.tokenizer.encode_batch(sentences)
            ids = np.array([encoding.ids for encoding in encodings], dtype=np.int64)
            mask = np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64)
            tensors = [pb_utils.Tensor("INPUT_IDS", ids), pb_utils.Tensor("ATTENTION_MASK", mask)]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
