"""A repository for the OpenAI embeddings tests: the example `text_embedding` pipeline as shipped, a copy of it that
truncates and may be cut (`cut_embedding`, also response-cached), a Python model without batching that exposes
itself (`py_embedding`) and a model that is not exposed (`simple`)."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import numpy as np

from tests.support.models import EXAMPLES, simple

PIPELINE = ("text_embedding", "minilm_tokenize", "minilm")
CUT_PARAMETER = (
    '{"input": "TEXT", "output": "EMBEDDING", "tokenizer": "tokenizer.json", "max_input_tokens": 256, '
    '"truncate": true, "dimensions": [128, 256]}'
)
PY_DIMENSIONS = 8
# Sleeps for texts that start with "slow" (a deadline's test); a text's vector is `py_vector`'s.
PY_MODEL = '''
import hashlib
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = bytes(pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)[0])
            if text.startswith(b"slow"):
                time.sleep(0.5)
            values = np.frombuffer(hashlib.sha256(text).digest(), dtype=np.uint32) / 2.0**32 - 0.5
            vector = (values / np.linalg.norm(values)).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("VECTOR", vector)]))
        return responses
'''
PY_CONFIG = """name: "py_embedding"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "VECTOR" data_type: TYPE_FP32 dims: [ 8 ] } ]
parameters {
  key: "openai.embeddings"
  value: { string_value: '{"input": "TEXT", "output": "VECTOR", "tokenizer": "tokenizer.json", "dimensions": "any"}' }
}
"""


def py_vector(text: str) -> np.ndarray:
    """What `py_embedding` answers for `text`."""
    values = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint32) / 2.0**32 - 0.5
    return (values / np.linalg.norm(values)).astype(np.float32)


def example_repository() -> Path:
    """The example repository, with the text pipeline built (a no-op once scripts/bootstrap.sh built it)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from build import REPOSITORY
    from build import main as build_examples

    build_examples(["--only=text_embedding"])
    return Path(REPOSITORY)


def embeddings_repository(repo: Path) -> Path:
    examples = example_repository()
    repo.mkdir(parents=True, exist_ok=True)
    for name in PIPELINE:
        (repo / name).symlink_to(examples / name, target_is_directory=True)
    tokenizer = examples / "text_embedding" / "tokenizer.json"
    cut = repo / "cut_embedding"
    (cut / "1").mkdir(parents=True)
    shutil.copy(tokenizer, cut / "tokenizer.json")
    config = (examples / "text_embedding" / "config.pbtxt").read_text()
    config = config.replace('name: "text_embedding"', 'name: "cut_embedding"')
    start = config.index("parameters {")
    config = config[:start] + (
        f"response_cache {{ enable: true }}\n"
        f"parameters {{ key: \"openai.embeddings\" value: {{ string_value: '{CUT_PARAMETER}' }} }}\n"
    )
    (cut / "config.pbtxt").write_text(config)
    py = repo / "py_embedding"
    (py / "1").mkdir(parents=True)
    (py / "1" / "model.py").write_text(PY_MODEL)
    (py / "config.pbtxt").write_text(PY_CONFIG)
    shutil.copy(tokenizer, py / "tokenizer.json")
    simple(repo)
    return repo
