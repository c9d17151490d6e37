"""The example repository's real models answer correctly through a real server and the real tritonclient."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.support.models import EXAMPLES
from tests.support.server import RunningServer, geserve

sys.path.insert(0, str(EXAMPLES))

from build import REPOSITORY
from build import main as build_examples
from build_efficientnet import preprocess
from build_minilm import tokenize


@pytest.fixture(scope="module")
def examples_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    build_examples([])  # a no-op when scripts/bootstrap.sh already built them
    with geserve([REPOSITORY], tmp_path_factory.mktemp("examples") / "geserve.log") as server:
        yield server


@pytest.fixture
def client(examples_server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(examples_server.url) as c:
        yield c


def _photo(name: str) -> np.ndarray:
    import skimage.data

    return getattr(skimage.data, name)()


def test_every_example_is_ready_with_its_config(client: httpclient.InferenceServerClient) -> None:
    for name in ("digits", "efficientnet_lite0", "minilm", "resnet50", "mlp"):
        assert client.is_model_ready(name), name
        config = client.get_model_config(name)
        assert config["platform"] == "graph_executor" and config["max_batch_size"] > 0
        assert config["instance_group"][0]["kind"] == "KIND_CPU"


def test_the_cat_comes_back_as_a_cat(client: httpclient.InferenceServerClient) -> None:
    images = np.stack([preprocess(_photo("chelsea")), preprocess(_photo("coffee"))])
    tensor = httpclient.InferInput("input", images.shape, "FP32")
    tensor.set_data_from_numpy(images)
    result = client.infer(
        "efficientnet_lite0", [tensor], outputs=[httpclient.InferRequestedOutput("logits", class_count=5)]
    )
    top = result.as_numpy("logits")
    assert top.shape == (2, 5)
    cat_labels = [entry.decode().split(":", 2)[2] for entry in top[0]]
    assert "cat" in cat_labels[0], cat_labels
    assert sum("cat" in label for label in cat_labels[:3]) >= 2, cat_labels
    coffee_labels = [entry.decode().split(":", 2)[2] for entry in top[1]]
    assert not any("cat" in label for label in coffee_labels[:2]), coffee_labels


def _embed(client: httpclient.InferenceServerClient, texts: list[str]) -> np.ndarray:
    ids, mask = tokenize(texts)
    tensors = [httpclient.InferInput("input_ids", ids.shape, "INT64"),
               httpclient.InferInput("attention_mask", mask.shape, "INT64")]
    tensors[0].set_data_from_numpy(ids)
    tensors[1].set_data_from_numpy(mask)
    return client.infer("minilm", tensors).as_numpy("embedding")


def test_similar_sentences_score_higher(client: httpclient.InferenceServerClient) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]
    embeddings = _embed(client, texts)
    assert embeddings.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    similar = float(embeddings[0] @ embeddings[1])
    unrelated = max(float(embeddings[0] @ embeddings[2]), float(embeddings[1] @ embeddings[2]))
    assert similar > 0.6 and unrelated < 0.2, (similar, unrelated)
    # Padding inside a batch must not change a sentence's embedding.
    np.testing.assert_allclose(_embed(client, texts[:1])[0], embeddings[0], atol=1e-5)


@pytest.mark.parametrize(("model", "shape", "classes"), [("resnet50", (3, 224, 224), 1000), ("mlp", (256,), 10)])
def test_throughput_models_batch_consistently(
    client: httpclient.InferenceServerClient, model: str, shape: tuple[int, ...], classes: int
) -> None:
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((4, *shape), dtype=np.float32)
    tensor = httpclient.InferInput("input", batch.shape, "FP32")
    tensor.set_data_from_numpy(batch)
    logits = client.infer(model, [tensor]).as_numpy("logits")
    assert logits.shape == (4, classes) and np.isfinite(logits).all()
    single = httpclient.InferInput("input", (1, *shape), "FP32")
    single.set_data_from_numpy(batch[2:3])
    np.testing.assert_allclose(client.infer(model, [single]).as_numpy("logits")[0], logits[2], rtol=1e-4, atol=1e-4)


def test_example_builds_are_idempotent_and_fast() -> None:
    import time

    stamps = {p: p.stat().st_mtime_ns for p in Path(REPOSITORY).glob("*/1/model.onnx")}
    started = time.monotonic()
    build_examples([])
    assert time.monotonic() - started < 10
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
