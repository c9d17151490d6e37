"""The example pipelines (ensembles of Python and GE models) answer correctly, end to end, through tritonclient.

One geserve serves the three pipelines of examples/pipelines/ (built into the example repository by
examples/build.py): raw image bytes -> ImageNet top-5 (HTTP), a rendered page -> its text lines (gRPC),
sentences -> embeddings (HTTP). The same repository, with the GE models as Python-backend ONNX Runtime
models, runs on the real Triton, which must give the same answers.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from PIL import Image
from tritonclient.utils import InferenceServerException

from tests.support.models import EXAMPLES
from tests.support.pipelines import OCR_LINES, load_config, photo_bytes, rendered_page, triton_repository
from tests.support.reference import reference_triton
from tests.support.server import RunningServer, geserve

sys.path.insert(0, str(EXAMPLES))

from build import REPOSITORY
from build import main as build_examples
from build_efficientnet import preprocess
from build_minilm import tokenize

PIPELINES = ("image_pipeline", "ocr_pipeline", "text_embedding")
CATS = {"tiger cat", "Egyptian cat", "tabby, tabby cat"}
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]


def _models(names: tuple[str, ...]) -> list[str]:
    """The ensembles and every model their steps use."""
    found = list(names)
    for name in names:
        found += [step.model_name for step in load_config(REPOSITORY / name).ensemble_scheduling.step]
    return list(dict.fromkeys(found))


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the pipelines' models (links into the example repository): the server loads nothing else."""
    build_examples([f"--only={name}" for name in PIPELINES])  # a no-op when scripts/bootstrap.sh built them
    repo = tmp_path_factory.mktemp("pipelines")
    for name in _models(PIPELINES):
        (repo / name).symlink_to(REPOSITORY / name, target_is_directory=True)
    return repo


@pytest.fixture(scope="module")
def pipelines_server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    with geserve([repository], tmp_path_factory.mktemp("pipelines-log") / "geserve.log") as running:
        yield running


@pytest.fixture
def http(pipelines_server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(pipelines_server.url) as client:
        yield client


@pytest.fixture
def grpc(pipelines_server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(pipelines_server.grpc_url)
    yield client
    client.close()


def _bytes_input(module: ModuleType, name: str, values: list[bytes], shape: list[int]) -> Any:
    """A BYTES input for either client module (tritonclient.http or tritonclient.grpc)."""
    tensor = module.InferInput(name, shape, "BYTES")
    tensor.set_data_from_numpy(np.array(values, dtype=np.object_).reshape(shape))
    return tensor


def _classify(client: httpclient.InferenceServerClient, images: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    result = client.infer("image_pipeline", [_bytes_input(httpclient, "IMAGE", images, [len(images), 1])])
    return result.as_numpy("LABELS"), result.as_numpy("SCORES")


def _read(client: Any, image: bytes, module: ModuleType = grpcclient) -> tuple[list[str], np.ndarray, np.ndarray]:
    result = client.infer("ocr_pipeline", [_bytes_input(module, "IMAGE", [image], [1])])
    texts = [text.decode() for text in result.as_numpy("TEXT")]
    return texts, result.as_numpy("SCORES"), result.as_numpy("BOXES")


def _embed(client: httpclient.InferenceServerClient, texts: list[str]) -> np.ndarray:
    tensor = _bytes_input(httpclient, "TEXT", [text.encode() for text in texts], [len(texts), 1])
    return client.infer("text_embedding", [tensor]).as_numpy("EMBEDDING")


def test_pipelines_and_their_steps_are_ready(http: httpclient.InferenceServerClient) -> None:
    for name in _models(PIPELINES):
        assert http.is_model_ready(name), name
    for name in PIPELINES:
        config = http.get_model_config(name)
        assert config["platform"] == "ensemble", config
        steps = config["ensemble_scheduling"]["step"]
        assert [step["model_name"] for step in steps] == _models((name,))[1:]
    assert http.get_model_config("image_preprocess")["backend"] == "python"
    assert http.get_model_config("ocr_det")["platform"] == "graph_executor"


def test_image_pipeline_sees_the_cat_and_the_coffee(http: httpclient.InferenceServerClient) -> None:
    photos = [photo_bytes("chelsea"), photo_bytes("coffee", "PNG")]
    labels, scores = _classify(http, photos)
    assert labels.shape == scores.shape == (2, 5)
    cat, coffee = ([label.decode() for label in row] for row in labels)
    assert cat[0] in CATS and sum(label in CATS for label in cat[:3]) >= 2, cat
    assert coffee[0] == "espresso", coffee
    assert (np.diff(scores, axis=1) <= 0).all() and (scores > 0).all() and (scores.sum(axis=1) <= 1.0 + 1e-5).all()

    # The same numbers as the GE model called directly on the decoded photo, preprocessed in the test.
    decoded = [np.asarray(Image.open(io.BytesIO(photo)).convert("RGB")) for photo in photos]
    pixels = np.stack([preprocess(image) for image in decoded])
    tensor = httpclient.InferInput("input", pixels.shape, "FP32")
    tensor.set_data_from_numpy(pixels)
    logits = http.infer("efficientnet_lite0", [tensor]).as_numpy("logits")
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(scores, -np.sort(-probabilities, axis=1)[:, :5], rtol=1e-4, atol=1e-6)


def test_image_pipeline_refuses_what_is_not_an_image(http: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="cannot decode image"):
        _classify(http, [b"this is not an image"])


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_ocr_pipeline_reads_the_rendered_lines(grpc: grpcclient.InferenceServerClient) -> None:
    texts, scores, boxes = _read(grpc, rendered_page(OCR_LINES))
    # The recognizer may drop a space (e.g. after a colon): compare the lines without whitespace.
    assert [_squeezed(text) for text in texts] == [_squeezed(line) for line in OCR_LINES], texts
    assert texts[-1] == OCR_LINES[-1]
    assert scores.shape == (3,) and (scores > 0.8).all(), scores
    assert boxes.shape == (3, 4, 2)
    tops = boxes[:, :, 1].min(axis=1)
    assert (np.diff(tops) > 20).all(), boxes  # one box per line, top to bottom


def test_ocr_pipeline_finds_no_text_on_a_blank_page(grpc: grpcclient.InferenceServerClient) -> None:
    texts, scores, boxes = _read(grpc, rendered_page([""]))
    assert texts == [] and scores.shape == (0,) and boxes.shape == (0, 4, 2)


def test_text_embedding_pipeline_ranks_similar_sentences_higher(http: httpclient.InferenceServerClient) -> None:
    embeddings = _embed(http, SENTENCES)
    assert embeddings.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    similar = float(embeddings[0] @ embeddings[1])
    unrelated = max(float(embeddings[0] @ embeddings[2]), float(embeddings[1] @ embeddings[2]))
    assert similar > 0.6 and unrelated < 0.2, (similar, unrelated)
    # The Python tokenizer gives what the GE model gets from the builder's tokenizer.
    ids, mask = tokenize(SENTENCES)
    tensors = [httpclient.InferInput("input_ids", ids.shape, "INT64"),
               httpclient.InferInput("attention_mask", mask.shape, "INT64")]
    tensors[0].set_data_from_numpy(ids)
    tensors[1].set_data_from_numpy(mask)
    np.testing.assert_allclose(http.infer("minilm", tensors).as_numpy("embedding"), embeddings, atol=1e-5)
    np.testing.assert_allclose(_embed(http, SENTENCES[2:])[0], embeddings[2], atol=1e-5)


def _counts(client: httpclient.InferenceServerClient, name: str) -> tuple[int, int, int]:
    """(successful requests, inferences (rows), executions) of a model, as Triton counts them."""
    stats = client.get_inference_statistics(name)["model_stats"][0]
    return stats["inference_stats"]["success"]["count"], stats["inference_count"], stats["execution_count"]


def test_statistics_count_the_ensemble_and_each_step(http: httpclient.InferenceServerClient) -> None:
    names = _models(("image_pipeline",))
    before = {name: _counts(http, name) for name in names}
    fails_before = _fails(http, "image_pipeline")
    photo = photo_bytes("chelsea")
    _classify(http, [photo, photo])
    _classify(http, [photo])
    with pytest.raises(InferenceServerException):
        _classify(http, [b"not an image"])
    after = {name: _counts(http, name) for name in names}
    for name in names[:1] + names[2:]:
        requests, rows, executions = (end - start for end, start in zip(after[name], before[name], strict=True))
        # Two good requests, one after the other (nothing to batch together), three rows; each step once per request.
        assert (requests, rows, executions) == (2, 3, 2), (name, requests, rows, executions)
    # The preprocessing step also ran the refused request (Triton counts its error response as a success).
    assert after["image_preprocess"][1] - before["image_preprocess"][1] == 4
    assert _fails(http, "image_pipeline") > fails_before


def _fails(client: httpclient.InferenceServerClient, name: str) -> int:
    return client.get_inference_statistics(name)["model_stats"][0]["inference_stats"]["fail"]["count"]


@pytest.fixture(scope="module")
def triton(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpclient.InferenceServerClient]:
    """The real Triton on the same pipelines, GE models served as Python-backend ONNX Runtime models."""
    root = tmp_path_factory.mktemp("pipelines-triton")
    repo = triton_repository(REPOSITORY, root / "repo", PIPELINES)
    with reference_triton(repo, root, timeout=180) as url:
        client = httpclient.InferenceServerClient(url.removeprefix("http://"))
        yield client
        client.close()


@pytest.mark.reference
def test_the_real_triton_runs_the_same_pipelines_with_the_same_answers(
    http: httpclient.InferenceServerClient, triton: httpclient.InferenceServerClient
) -> None:
    photos = [photo_bytes("chelsea"), photo_bytes("coffee")]
    (labels, scores), (triton_labels, triton_scores) = _classify(http, photos), _classify(triton, photos)
    assert labels.tolist() == triton_labels.tolist()
    np.testing.assert_allclose(scores, triton_scores, rtol=1e-3, atol=1e-5)

    page = rendered_page(OCR_LINES)
    texts, ocr_scores, boxes = _read(http, page, httpclient)
    triton_texts, triton_ocr_scores, triton_boxes = _read(triton, page, httpclient)
    assert texts == triton_texts
    # The confidences are not bit-equal: the venvs' OpenCV (5.x here, 4.x under Triton's numpy<2) warp the
    # crops a little differently, and the two servers' ONNX Runtime options differ.
    np.testing.assert_allclose(ocr_scores, triton_ocr_scores, atol=0.01)
    np.testing.assert_allclose(boxes, triton_boxes, atol=0.01)

    np.testing.assert_allclose(_embed(http, SENTENCES), _embed(triton, SENTENCES), atol=1e-4)
