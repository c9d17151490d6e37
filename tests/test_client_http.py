"""The real tritonclient (sync and asyncio) against a real geserve process: every call a user makes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.utils import InferenceServerException

from tests.support import models
from tests.support.server import RunningServer


@pytest.fixture
def client(server: RunningServer):
    with httpclient.InferenceServerClient(server.url) as c:
        yield c


def _simple_inputs(rows: int = 1, binary: bool = True) -> tuple[list, np.ndarray, np.ndarray]:
    a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    b = np.full((rows, 16), 3, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", a.shape, "INT32"), httpclient.InferInput("INPUT1", b.shape, "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a, b


def test_health_and_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "2") and not client.is_model_ready("missing")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    metadata = client.get_model_metadata("simple")
    assert metadata["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8 and config["input"][1]["dims"] == [16]
    names = {m["name"] for m in client.get_model_repository_index()}
    assert {"simple", "digits", "nobatch", "autocomplete"} <= names


@pytest.mark.parametrize("binary", [True, False])
def test_infer_json_and_binary(client: httpclient.InferenceServerClient, binary: bool) -> None:
    inputs, a, b = _simple_inputs(rows=3, binary=binary)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=not binary)]
    result = client.infer("simple", inputs, outputs=outputs, request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response()["id"] == "req-7"


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(client: httpclient.InferenceServerClient, algorithm: str) -> None:
    inputs, a, b = _simple_inputs(rows=2)
    result = client.infer(
        "simple", inputs, request_compression_algorithm=algorithm, response_compression_algorithm=algorithm
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


@pytest.mark.parametrize(
    ("model", "array"),
    [
        ("identity_fp16", np.array([[1.5, -2.25, 65504]], dtype=np.float16)),
        ("identity_bool", np.array([[True, False, True]])),
        ("identity_bytes", np.array([[b"hello", b"", "\u00e9t\u00e9".encode()]], dtype=object)),
        ("identity_int8", np.array([[-128, 0, 127]], dtype=np.int8)),
        ("identity_uint64", np.array([[0, 2**64 - 1]], dtype=np.uint64)),
        ("identity_fp64", np.array([[1e-300, 3.5]], dtype=np.float64)),
    ],
)
@pytest.mark.parametrize("binary", [True, False])
def test_datatypes_round_trip(
    client: httpclient.InferenceServerClient, model: str, array: np.ndarray, binary: bool
) -> None:
    datatype = client.get_model_metadata(model)["inputs"][0]["datatype"]
    tensor = httpclient.InferInput("INPUT0", array.shape, datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    result = client.infer(model, [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    expected = array
    if model == "identity_bytes" and not binary:  # JSON carries BYTES as text; tritonclient returns str
        expected = np.vectorize(lambda v: v.decode(), otypes=[object])(array)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


def test_bf16_round_trip(server: RunningServer) -> None:
    """BF16 travels as raw 2-byte values (tritonclient has no numpy bfloat16); the backend binds it for ORT."""
    import json
    import urllib.request

    import ml_dtypes

    values = np.array([[1.5, -2.0, 256.0]], dtype=ml_dtypes.bfloat16).tobytes()
    header = json.dumps({
        "inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "BF16", "parameters": {"binary_data_size": 6}}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }).encode()
    request = urllib.request.Request(
        server.base + "/v2/models/identity_bf16/infer", data=header + values,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    with urllib.request.urlopen(request) as response:
        body = response.read()
        length = int(response.headers["Inference-Header-Content-Length"])
    output = json.loads(body[:length])["outputs"][0]
    assert output["datatype"] == "BF16" and output["shape"] == [1, 3]
    assert body[length:] == values


def test_digits_classification_names_the_digit(client: httpclient.InferenceServerClient) -> None:
    pixels, labels = models.digits_test_set()
    batch = pixels[:8]
    tensor = httpclient.InferInput("pixels", batch.shape, "FP32")
    tensor.set_data_from_numpy(batch)
    result = client.infer("digits", [tensor], outputs=[httpclient.InferRequestedOutput("probabilities", class_count=3)])
    top = result.as_numpy("probabilities")
    assert top.shape == (8, 3)
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for row, label in zip(top, labels[:8], strict=True):
        score, index, name = row[0].decode().split(":")
        assert int(index) == label and name == names[label] and 0.5 < float(score) <= 1.0


def test_digits_accuracy_over_held_out_set(client: httpclient.InferenceServerClient) -> None:
    pixels, labels = models.digits_test_set()
    predictions = []
    for start in range(0, len(pixels), 64):
        batch = pixels[start : start + 64]
        tensor = httpclient.InferInput("pixels", batch.shape, "FP32")
        tensor.set_data_from_numpy(batch)
        result = client.infer("digits", [tensor], outputs=[httpclient.InferRequestedOutput("label")])
        predictions.append(result.as_numpy("label").reshape(-1))
    accuracy = float(np.mean(np.concatenate(predictions) == labels))
    assert accuracy > 0.95, accuracy


def test_errors_are_clean_and_server_survives(client: httpclient.InferenceServerClient) -> None:
    inputs, _, _ = _simple_inputs()
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("missing", inputs)
    wrong = httpclient.InferInput("INPUT0", [1, 8], "INT32")
    wrong.set_data_from_numpy(np.zeros((1, 8), dtype=np.int32))
    with pytest.raises(InferenceServerException, match=r"Expected \[-1,16\], got \[1,8\]") as info:
        client.infer("simple", [wrong, inputs[1]])
    assert info.value.status() == "400"
    too_many, _, _ = _simple_inputs(rows=9)
    with pytest.raises(InferenceServerException, match="batch-size must be <= 8"):
        client.infer("simple", too_many)
    with pytest.raises(InferenceServerException, match="reserved"):
        client.infer("simple", inputs, parameters={"triton_x": 1})
    assert client.is_server_live()
    ok, a, b = _simple_inputs()
    np.testing.assert_array_equal(client.infer("simple", ok).as_numpy("OUTPUT0"), a + b)


def test_statistics_count_known_traffic(client: httpclient.InferenceServerClient) -> None:
    before = client.get_inference_statistics("nobatch")["model_stats"][0]
    data = np.array([[-1, 2, -3], [4, -5, 6]], dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", data.shape, "FP32")
    tensor.set_data_from_numpy(data)
    for _ in range(3):
        np.testing.assert_array_equal(client.infer("nobatch", [tensor]).as_numpy("OUTPUT0"), np.maximum(data, 0))
    bad = httpclient.InferInput("INPUT0", [3, 2], "FP32")
    bad.set_data_from_numpy(data.reshape(3, 2))
    with pytest.raises(InferenceServerException):
        client.infer("nobatch", [bad])
    after = client.get_inference_statistics("nobatch")["model_stats"][0]
    stats, old = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - old["success"]["count"] == 3
    assert stats["fail"]["count"] == old["fail"]["count"]  # refused before the model ran: no failure (Triton)
    assert after["execution_count"] - before["execution_count"] == 3
    assert after["inference_count"] - before["inference_count"] == 3
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[key]["count"] - old[key]["count"] == 3 and stats[key]["ns"] > old[key]["ns"]
    assert after["last_inference"] > 0
    assert {s["batch_size"] for s in after["batch_stats"]} == {1}
    all_models = client.get_inference_statistics()["model_stats"]
    assert {"nobatch", "simple"} <= {s["name"] for s in all_models}


def test_asyncio_client_concurrent_requests(server: RunningServer) -> None:
    async def run() -> None:
        async with aiohttpclient.InferenceServerClient(server.url) as client:
            assert await client.is_server_ready()
            assert (await client.get_model_metadata("simple"))["name"] == "simple"

            async def one(i: int) -> None:
                a = np.full((1, 16), i, dtype=np.int32)
                b = np.ones((1, 16), dtype=np.int32)
                tensors = [aiohttpclient.InferInput("INPUT0", a.shape, "INT32"),
                           aiohttpclient.InferInput("INPUT1", b.shape, "INT32")]
                tensors[0].set_data_from_numpy(a)
                tensors[1].set_data_from_numpy(b)
                result = await client.infer("simple", tensors)
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)

            await asyncio.gather(*(one(i) for i in range(64)))
            stats = await client.get_inference_statistics("simple")
            assert stats["model_stats"][0]["inference_stats"]["success"]["count"] >= 64

    asyncio.run(run())
