"""OpenAI's embeddings API on geserve's HTTP port, through the official `openai` client (and raw JSON over httpx for
the error shapes), against a real server serving the example `text_embedding` pipeline (tokenizer -> MiniLM).

The vectors must be the KServe v2 path's for the same texts; usage must be the model's own tokenizer's count; every
call goes through the service's one door (statistics, metrics, the response cache, deadlines, bearer tokens and
restricted APIs all apply).
"""

from __future__ import annotations

import base64
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
from tokenizers import Tokenizer

from tests.support.embeddings import PY_DIMENSIONS, embeddings_repository, py_vector
from tests.support.security import AUDIENCE, ISSUER, KeyPair, rsa_key
from tests.support.server import RunningServer, geserve

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The stock market fell sharply today."]
LONG = "the quick brown fox jumps over the lazy dog " * 40  # 360 words: over MiniLM's 256 tokens
RESTRICTED = ("x-embeddings-key", "open-sesame")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return embeddings_repository(tmp_path_factory.mktemp("openai") / "models")


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("openai-log") / "geserve.log"
    with geserve([repository], log, ["--cache-config", "local,size=1048576"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0) as made:
        yield made


@pytest.fixture(scope="module")
def raw(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=30) as made:
        yield made


@pytest.fixture(scope="module")
def kserve(server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    with httpclient.InferenceServerClient(server.url) as made:
        yield made


@pytest.fixture(scope="module")
def tokenizer(repository: Path) -> Tokenizer:
    loaded = Tokenizer.from_file(str(repository / "text_embedding" / "tokenizer.json"))
    loaded.no_truncation()
    loaded.no_padding()
    return loaded


def _v2(kserve: httpclient.InferenceServerClient, texts: list[str], model: str = "text_embedding") -> np.ndarray:
    tensor = httpclient.InferInput("TEXT", [len(texts), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1))
    return kserve.infer(model, [tensor]).as_numpy("EMBEDDING")


def _vectors(response: Any) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _stats(kserve: httpclient.InferenceServerClient, model: str) -> dict[str, Any]:
    return kserve.get_inference_statistics(model)["model_stats"][0]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error body of a refused call, its shape checked."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return body["error"]


def test_one_string_is_the_kserve_vector_and_counts_its_tokens(
    client: openai.OpenAI, kserve: httpclient.InferenceServerClient, tokenizer: Tokenizer
) -> None:
    response = client.embeddings.create(model="text_embedding", input=SENTENCES[0], encoding_format="float")
    assert response.object == "list" and response.model == "text_embedding"
    assert [(item.object, item.index) for item in response.data] == [("embedding", 0)]
    vector = _vectors(response)
    assert vector.shape == (1, 384)
    assert _cosines(vector, _v2(kserve, SENTENCES[:1]))[0] >= 0.9999
    assert abs(np.linalg.norm(vector) - 1) < 1e-5
    tokens = len(tokenizer.encode(SENTENCES[0]).ids)  # [CLS] a man is eating food . [SEP]
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens == 8


def test_a_list_of_64_is_64_rows_of_one_request_in_order(
    client: openai.OpenAI, kserve: httpclient.InferenceServerClient, tokenizer: Tokenizer
) -> None:
    texts = [f"{SENTENCES[i % 3]} Sentence number {i}." for i in range(64)]  # 12 to 16 tokens: one length
    before = _stats(kserve, "text_embedding")
    response = client.embeddings.create(model="text_embedding", input=texts, encoding_format="float")
    after = _stats(kserve, "text_embedding")
    assert [item.index for item in response.data] == list(range(64))
    assert (_cosines(_vectors(response), _v2(kserve, texts)) >= 0.9999).all()
    assert response.usage.prompt_tokens == sum(len(e.ids) for e in tokenizer.encode_batch(texts))
    # One inference of 64 rows (the statistics count the request, and its rows as inferences).
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 1
    assert after["inference_count"] - before["inference_count"] == 64


def test_more_texts_than_a_batch_go_as_several_requests(
    client: openai.OpenAI, kserve: httpclient.InferenceServerClient
) -> None:
    texts = [f"text {i}" for i in range(150)]  # max_batch_size 64: requests of 64, 64 and 22 rows
    before = _stats(kserve, "text_embedding")
    response = client.embeddings.create(model="text_embedding", input=texts, encoding_format="float")
    after = _stats(kserve, "text_embedding")
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 3
    assert after["inference_count"] - before["inference_count"] == 150
    expected = np.concatenate([_v2(kserve, texts[i : i + 64]) for i in range(0, 150, 64)])
    assert (_cosines(_vectors(response), expected) >= 0.9999).all()


def test_texts_of_other_lengths_go_in_requests_of_their_own_in_order(
    client: openai.OpenAI, kserve: httpclient.InferenceServerClient, tokenizer: Tokenizer
) -> None:
    long = "A much longer sentence that goes on and on, about many things, with many more words than the others do."
    texts = ["short one", long, "short two", long + " Again.", "short three"]
    assert len(tokenizer.encode(long).ids) > 16 + len(tokenizer.encode("short three").ids)
    before = _stats(kserve, "text_embedding")
    response = client.embeddings.create(model="text_embedding", input=texts, encoding_format="float")
    after = _stats(kserve, "text_embedding")
    # The short ones in one request, the long ones in another: a request is padded to its longest text.
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 2
    assert after["inference_count"] - before["inference_count"] == 5
    assert [item.index for item in response.data] == list(range(5))
    expected = np.concatenate([_v2(kserve, [text]) for text in texts])
    assert (_cosines(_vectors(response), expected) >= 0.9999).all()


def test_base64_is_the_float_vector(client: openai.OpenAI, raw: httpx.Client) -> None:
    floats = _vectors(client.embeddings.create(model="text_embedding", input=SENTENCES, encoding_format="float"))
    # Asked for by name, the client hands base64 over as it came: little-endian float32.
    encoded = client.embeddings.create(model="text_embedding", input=SENTENCES, encoding_format="base64")
    decoded = np.stack([np.frombuffer(base64.b64decode(item.embedding), dtype="<f4") for item in encoded.data])
    np.testing.assert_array_equal(decoded, floats)
    body = raw.post("/v1/embeddings", json={"model": "text_embedding", "input": SENTENCES,
                                            "encoding_format": "base64"}).json()
    assert [item["embedding"] for item in body["data"]] == [item.embedding for item in encoded.data]
    # The client's default (no encoding_format) asks for base64 and decodes it.
    default = _vectors(client.embeddings.create(model="text_embedding", input=SENTENCES))
    np.testing.assert_array_equal(default, floats)


def test_dimensions_cut_and_renormalize_only_where_the_config_allows(
    client: openai.OpenAI, raw: httpx.Client
) -> None:
    full = _vectors(client.embeddings.create(model="cut_embedding", input=SENTENCES, encoding_format="float"))
    cut = _vectors(client.embeddings.create(model="cut_embedding", input=SENTENCES, dimensions=128,
                                            encoding_format="float"))
    assert cut.shape == (3, 128)
    expected = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(cut, axis=1), 1, atol=1e-5)
    assert len(client.embeddings.create(model="cut_embedding", input="x", dimensions=384).data[0].embedding) == 384
    refused = _error(raw.post("/v1/embeddings", json={"model": "cut_embedding", "input": "x", "dimensions": 100}), 400)
    assert refused["param"] == "dimensions" and "[128, 256, 384]" in refused["message"], refused
    # MiniLM is no Matryoshka model: the example's config allows no cut.
    refused = _error(raw.post("/v1/embeddings", json={"model": "text_embedding", "input": "x", "dimensions": 128}),
                     400)
    assert refused["param"] == "dimensions" and "only 384" in refused["message"], refused
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="text_embedding", input="x", dimensions=128)
    assert len(client.embeddings.create(model="text_embedding", input="x", dimensions=384).data[0].embedding) == 384
    # `"dimensions": "any"`: any size up to the vector's.
    three = _vectors(client.embeddings.create(model="py_embedding", input="x", dimensions=3, encoding_format="float"))
    np.testing.assert_allclose(three[0], py_vector("x")[:3] / np.linalg.norm(py_vector("x")[:3]), atol=1e-6)


def test_an_unknown_model_is_openais_404(client: openai.OpenAI, raw: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="no-such-model", input="x")
    assert caught.value.status_code == 404
    error = _error(raw.post("/v1/embeddings", json={"model": "no-such-model", "input": "x"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`no-such-model` does not exist" in error["message"]
    error = _error(raw.get("/v1/models/no-such-model"), 404)
    assert error["code"] == "model_not_found"


def test_a_model_not_exposed_is_refused_naming_the_parameter(client: openai.OpenAI, raw: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="simple", input="x")
    error = _error(raw.post("/v1/embeddings", json={"model": "simple", "input": "x"}), 404)
    assert error["code"] == "model_not_found" and "'openai.embeddings'" in error["message"], error
    _error(raw.get("/v1/models/simple"), 404)


def test_the_model_list_has_the_exposed_models_only(client: openai.OpenAI, raw: httpx.Client) -> None:
    listed = client.models.list()
    assert sorted(model.id for model in listed.data) == ["cut_embedding", "py_embedding", "text_embedding"]
    assert {(model.object, model.owned_by) for model in listed.data} == {("model", "geserve")}
    one = client.models.retrieve("text_embedding")
    assert one.id == "text_embedding" and abs(one.created - time.time()) < 10 * 365 * 86400
    assert raw.get("/v1/models").json()["object"] == "list"


def test_too_long_input_is_refused_or_truncated_as_configured(
    client: openai.OpenAI, raw: httpx.Client, kserve: httpclient.InferenceServerClient, tokenizer: Tokenizer
) -> None:
    count = len(tokenizer.encode(LONG).ids)
    assert count > 256
    error = _error(raw.post("/v1/embeddings", json={"model": "text_embedding", "input": ["short", LONG]}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "input", error
    assert f"maximum context length is 256 tokens, however you requested {count} tokens in input 1" in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="text_embedding", input=LONG)
    # cut_embedding truncates: the first 256 tokens, as the model's own tokenizer cuts the text on the KServe path.
    response = client.embeddings.create(model="cut_embedding", input=[LONG, "short"], encoding_format="float")
    assert response.usage.prompt_tokens == 256 + len(tokenizer.encode("short").ids)
    assert _cosines(_vectors(response)[:1], _v2(kserve, [LONG], "cut_embedding"))[0] >= 0.9999


def test_token_arrays_are_the_models_own_token_ids(
    client: openai.OpenAI, raw: httpx.Client, kserve: httpclient.InferenceServerClient, tokenizer: Tokenizer
) -> None:
    ids = [tokenizer.encode(text).ids for text in SENTENCES]
    one = _vectors(client.embeddings.create(model="text_embedding", input=ids[0], encoding_format="float"))
    many = client.embeddings.create(model="text_embedding", input=ids, encoding_format="float")
    expected = _v2(kserve, SENTENCES)
    assert _cosines(one, expected[:1])[0] >= 0.9999
    assert (_cosines(_vectors(many), expected) >= 0.9999).all()
    assert many.usage.prompt_tokens == sum(map(len, ids))
    error = _error(raw.post("/v1/embeddings", json={"model": "text_embedding", "input": [101, 99999, 102]}), 400)
    assert error["code"] == "invalid_token_id" and "99999" in error["message"], error
    _error(raw.post("/v1/embeddings", json={"model": "text_embedding", "input": [[101, 102], []]}), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'{"input": "x"}', "model"),
        (b'{"model": "text_embedding"}', "input"),
        (b'{"model": "text_embedding", "input": []}', "input"),
        (b'{"model": "text_embedding", "input": ["x", 1]}', "input"),
        (b'{"model": "text_embedding", "input": [true]}', "input"),
        (b'{"model": "text_embedding", "input": {"text": "x"}}', "input"),
        (b'{"model": "text_embedding", "input": "x", "encoding_format": "int8"}', "encoding_format"),
        (b'{"model": "text_embedding", "input": "x", "dimensions": 0}', "dimensions"),
        (b'{"model": "text_embedding", "input": "x", "dimensions": "128"}', "dimensions"),
    ],
)
def test_bad_requests_get_openais_400(raw: httpx.Client, body: bytes, param: str | None) -> None:
    error = _error(raw.post("/v1/embeddings", content=body, headers={"content-type": "application/json"}), 400)
    assert error["param"] == param, error


def test_too_many_inputs_and_user_is_ignored(raw: httpx.Client) -> None:
    error = _error(raw.post("/v1/embeddings", json={"model": "text_embedding", "input": ["x"] * 2049}), 400)
    assert "at most 2048" in error["message"]
    answer = raw.post("/v1/embeddings", json={"model": "text_embedding", "input": "x", "user": "someone"})
    assert answer.status_code == 200, answer.text


def test_a_python_model_without_batching_answers_each_text_in_order(
    client: openai.OpenAI, kserve: httpclient.InferenceServerClient
) -> None:
    texts = [f"text {i}" for i in range(5)]
    before = _stats(kserve, "py_embedding")["inference_stats"]["success"]["count"]
    response = client.embeddings.create(model="py_embedding", input=texts, encoding_format="float")
    np.testing.assert_allclose(_vectors(response), np.stack([py_vector(t) for t in texts]), atol=1e-7)
    assert _vectors(response).shape == (5, PY_DIMENSIONS)
    assert _stats(kserve, "py_embedding")["inference_stats"]["success"]["count"] - before == 5  # one per text


def test_the_response_cache_answers_a_repeated_call(
    client: openai.OpenAI, kserve: httpclient.InferenceServerClient
) -> None:
    before = _stats(kserve, "cut_embedding")["inference_stats"]["cache_hit"]["count"]
    first = _vectors(client.embeddings.create(model="cut_embedding", input="cache me", encoding_format="float"))
    second = _vectors(client.embeddings.create(model="cut_embedding", input="cache me", encoding_format="float"))
    np.testing.assert_array_equal(first, second)
    assert _stats(kserve, "cut_embedding")["inference_stats"]["cache_hit"]["count"] - before == 1


def test_metrics_count_the_calls(client: openai.OpenAI, server: RunningServer) -> None:
    def successes() -> float:
        with urllib.request.urlopen(server.metrics_url, timeout=10) as answer:
            text = answer.read().decode()
        line = next(ln for ln in text.splitlines()
                    if ln.startswith('nv_inference_request_success{') and 'model="py_embedding"' in ln)
        return float(line.rsplit(" ", 1)[1])

    before = successes()
    client.embeddings.create(model="py_embedding", input=["a", "b"])
    assert successes() - before == 2


def test_a_deadline_is_answered_in_time(raw: httpx.Client, kserve: httpclient.InferenceServerClient) -> None:
    before = _stats(kserve, "py_embedding")["inference_stats"]["fail"]["count"]
    started = time.monotonic()
    answer = raw.post("/v1/embeddings", json={"model": "py_embedding", "input": "slow text"},
                      headers={"x-envoy-expected-rq-timeout-ms": "100"})
    elapsed = time.monotonic() - started
    error = _error(answer, 504)
    assert "Deadline Exceeded" in error["message"] and elapsed < 0.45, (error, elapsed)
    assert _stats(kserve, "py_embedding")["inference_stats"]["fail"]["count"] - before == 1
    time.sleep(0.5)  # the model finishes the sleep it started


# ---- admission: bearer tokens and restricted APIs, as for inference ----

@pytest.fixture(scope="module")
def key() -> KeyPair:
    return rsa_key()


@pytest.fixture(scope="module")
def secured(key: KeyPair, repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("openai-jwt")
    (folder / "public.pem").write_bytes(key.public_pem)
    args = [f"--auth-jwt-public-key={folder / 'public.pem'}", f"--auth-jwt-audience={AUDIENCE}",
            f"--auth-jwt-issuer={ISSUER}", f"--http-restricted-api=inference:{RESTRICTED[0]}={RESTRICTED[1]}"]
    with geserve([repository], folder / "geserve.log", args) as running:
        yield running


def _secured_client(server: RunningServer, token: str, restricted: bool = True) -> openai.OpenAI:
    headers = {RESTRICTED[0]: RESTRICTED[1]} if restricted else {}
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=token, max_retries=0, default_headers=headers)


def test_a_bearer_token_is_refused_or_accepted(secured: RunningServer, key: KeyPair) -> None:
    with _secured_client(secured, key.token(scope="inference")) as client:
        response = client.embeddings.create(model="text_embedding", input="x", encoding_format="float")
        assert len(response.data[0].embedding) == 384
    with _secured_client(secured, rsa_key().token(scope="inference")) as forged, \
            pytest.raises(openai.AuthenticationError) as caught:
        forged.embeddings.create(model="text_embedding", input="x")
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert "signature does not verify" in caught.value.message
    assert caught.value.response.headers["www-authenticate"].startswith("Bearer")
    with _secured_client(secured, key.token(scope="metadata")) as unscoped, \
            pytest.raises(openai.PermissionDeniedError):
        unscoped.embeddings.create(model="text_embedding", input="x")
    # Refused before the model is looked up: an unknown model is no 404 to a caller without a token.
    answer = httpx.post(f"{secured.base}/v1/embeddings", json={"model": "no-such-model", "input": "x"},
                        headers=dict([RESTRICTED]))
    assert _error(answer, 401)["code"] == "invalid_api_key"


def test_the_model_list_needs_the_metadata_scope(secured: RunningServer, key: KeyPair) -> None:
    with _secured_client(secured, key.token(scope="metadata")) as client:
        assert "text_embedding" in [model.id for model in client.models.list().data]
    with _secured_client(secured, key.token(scope="inference")) as client, pytest.raises(openai.PermissionDeniedError):
        client.models.list()


def test_a_restricted_api_needs_its_header(secured: RunningServer, key: KeyPair) -> None:
    with _secured_client(secured, key.token(scope="inference"), restricted=False) as client, \
            pytest.raises(openai.PermissionDeniedError) as caught:
        client.embeddings.create(model="text_embedding", input="x")
    assert f"expecting header '{RESTRICTED[0]}'" in caught.value.message


def test_the_api_can_be_turned_off(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    log = tmp_path_factory.mktemp("openai-off") / "geserve.log"
    with geserve([repository], log, ["--openai-api", "off"]) as off:
        error = _error(httpx.post(f"{off.base}/v1/embeddings", json={"model": "text_embedding", "input": "x"}), 404)
        assert "--openai-api off" in error["message"]
        _error(httpx.get(f"{off.base}/v1/models"), 404)
        assert httpx.get(f"{off.base}/v2/models/text_embedding/ready").status_code == 200


def test_the_asgi_host_serves_the_same_routes(
    repository: Path, tmp_path_factory: pytest.TempPathFactory, client: openai.OpenAI
) -> None:
    # The routes are the ASGI app's (frontends/http/app.py): uvicorn hosts them as the native server does.
    log = tmp_path_factory.mktemp("openai-uvicorn") / "geserve.log"
    with geserve([repository], log, ["--http-server", "uvicorn"]) as hosted, \
            openai.OpenAI(base_url=f"{hosted.base}/v1", api_key="unused", max_retries=0) as other:
        assert [model.id for model in other.models.list().data] == [model.id for model in client.models.list().data]
        response = other.embeddings.create(model="text_embedding", input=SENTENCES, encoding_format="float")
        expected = client.embeddings.create(model="text_embedding", input=SENTENCES, encoding_format="float")
        np.testing.assert_array_equal(_vectors(response), _vectors(expected))
        error = _error(httpx.post(f"{hosted.base}/v1/embeddings", json={"model": "simple", "input": "x"}), 404)
        assert error["code"] == "model_not_found"
