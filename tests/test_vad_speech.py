"""Silero VAD on a real recording: espeak-ng speaks three sentences with pauses, sox makes it 16 kHz mono 16-bit;
streamed chunk by chunk over one gRPC stream as one sequence (implicit state on the server), it gives the same speech
probabilities as a direct ONNX Runtime loop, and the speech falls where the words are."""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.support import models, speech
from tests.support.server import geserve

HANGOVER = round(0.25 * speech.RATE)  # Silero keeps saying speech for a few chunks after the words stop


def _direct(model: Path, chunks: list[np.ndarray]) -> list[float]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 128), dtype=np.float32)
    probabilities = []
    for chunk in chunks:
        probability, state = session.run(None, {"input": chunk, "state": state, "sr": np.array(16000)})
        probabilities.append(float(probability.ravel()[0]))
    return probabilities


def _streamed(url: str, chunks: list[np.ndarray]) -> list[float]:
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    got: dict[int, float] = {}
    try:
        rate = grpcclient.InferInput("sr", [1], "INT64")
        rate.set_data_from_numpy(np.array([speech.RATE], dtype=np.int64))
        for index, chunk in enumerate(chunks):
            audio = grpcclient.InferInput("input", list(chunk.shape), "FP32")
            audio.set_data_from_numpy(chunk)
            client.async_stream_infer("silero_vad", [audio, rate], request_id=str(index), sequence_id=4242,
                                      sequence_start=index == 0, sequence_end=index == len(chunks) - 1)
        for _ in chunks:
            result, error = results.get(timeout=30)
            assert error is None, error
            got[int(result.get_response().id)] = float(result.as_numpy("output").ravel()[0])
    finally:
        client.stop_stream()
        client.close()
    return [got[index] for index in range(len(chunks))]


def _overlaps(chunk: int, ranges: list[tuple[int, int]], after: int = 0) -> bool:
    start, end = chunk * speech.WINDOW, (chunk + 1) * speech.WINDOW
    return any(start < b + after and a < end for a, b in ranges)


def test_silero_vad_on_espeak_speech_streamed_over_grpc(tmp_path: Path) -> None:
    pytest.importorskip("silero_vad")
    if (why := speech.tools_missing()) is not None:
        pytest.skip(why)
    recording = speech.record(tmp_path / "audio")
    chunks = speech.chunks(recording.audio)
    repo = tmp_path / "repo"
    model_dir = models.silero_vad(repo)
    expected = _direct(model_dir / "1" / "model.onnx", chunks)

    with geserve([repo], tmp_path / "server.log") as running:
        got = _streamed(running.grpc_url, chunks)
    assert np.allclose(got, expected, atol=1e-5), np.abs(np.subtract(got, expected)).max()

    speaking = [p > 0.5 for p in got]
    for a, b in recording.words:  # each sentence reads as speech, nearly throughout
        inside = [speaking[i] for i in range(a // speech.WINDOW, (b - 1) // speech.WINDOW + 1)]
        assert sum(inside) >= 0.8 * len(inside), ((a, b), inside)
    for index, is_speech in enumerate(speaking):  # speech only on the words (and just after them)
        if is_speech:
            assert _overlaps(index, recording.words, after=HANGOVER), (index, recording.words)
    for a, b in recording.pauses:  # the pauses are silence, past the hangover
        quiet = range((a + HANGOVER) // speech.WINDOW + 1, b // speech.WINDOW)
        assert len(quiet) > 0 and not any(speaking[i] for i in quiet), ((a, b), [got[i] for i in quiet])
