"""Silero VAD served as a sequence model with implicit state: 8 concurrent streams at real-time factor.

geserve serves `silero_vad_16k_op15.onnx` from the `silero-vad` package unchanged (tests/support/models.py's
`silero_vad`: the recurrent state kept by the server, `oldest` with a slot for every stream, one instance unless
`--instances`). Each of `--streams` (8) client threads opens its own gRPC stream and sends the recording as one
sequence, one 512-sample chunk (32 ms at 16 kHz, with Silero's 64 samples of context) at a time, the next as soon as
the previous answer is back (closed loop: the fastest it could keep up). The reference is a direct ONNX Runtime loop
over the same chunks on one core (1 intra-op and 1 inter-op thread), the state fed back by hand.

Reported per case, medians over alternating rounds (the order flips each round): the real-time factor (audio seconds
processed per wall second: all streams together, and per stream), p50 / p99 per-chunk latency (the client's round
trip; for the direct loop one `session.run`), and the largest difference between a served stream's probabilities and
the direct loop's. The audio is the locally synthesized speech of tests/support/speech.py (espeak-ng and sox) when
both are installed, else noise-like audio (speech-like bursts), as the table says.
Writes bench/results/vad.md and vad.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from geserve.version import __version__  # noqa: E402
from tests.support import models, speech  # noqa: E402
from tests.support.server import geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CHUNK_SECONDS = speech.WINDOW / speech.RATE


def _audio(folder: Path, seconds: float) -> tuple[np.ndarray, str]:
    """The synthesized speech when espeak-ng and sox are here, else noise-like bursts; and which it is."""
    if speech.tools_missing() is None:
        recording = speech.record(folder)
        audio = recording.audio
        while audio.size < seconds * speech.RATE:
            audio = np.concatenate([audio, recording.audio])
        return audio[: round(seconds * speech.RATE)], "speech synthesized locally (espeak-ng, sox to 16 kHz mono)"
    rng = np.random.default_rng(0)
    t = np.arange(round(seconds * speech.RATE)) / speech.RATE
    voiced = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 12))
    bursts = (np.sin(2 * np.pi * 0.7 * t) > 0) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    audio = 0.3 * voiced * bursts + 0.01 * rng.standard_normal(t.size)
    return audio.astype(np.float32), f"noise-like audio (harmonic bursts in noise; {speech.tools_missing()})"


def _percentiles(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 50)), float(np.percentile(samples, 99))


def _direct(model: Path, chunks: list[np.ndarray]) -> dict[str, Any]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    rate = np.array(speech.RATE, dtype=np.int64)
    state = np.zeros((2, 1, 128), dtype=np.float32)
    for chunk in chunks[:20]:  # warm-up
        session.run(None, {"input": chunk, "state": state, "sr": rate})
    state = np.zeros((2, 1, 128), dtype=np.float32)
    latencies, probabilities = [], []
    began = time.perf_counter()
    for chunk in chunks:
        start = time.perf_counter()
        probability, state = session.run(None, {"input": chunk, "state": state, "sr": rate})
        latencies.append(time.perf_counter() - start)
        probabilities.append(float(probability.ravel()[0]))
    wall = time.perf_counter() - began
    p50, p99 = _percentiles(latencies)
    rtf = len(chunks) * CHUNK_SECONDS / wall
    return {"rtf_total": rtf, "rtf_stream_min": rtf, "rtf_stream_median": rtf, "p50_us": p50 * 1e6,
            "p99_us": p99 * 1e6, "probabilities": probabilities, "max_diff": 0.0}


def _stream(url: str, chunks: list[np.ndarray], sequence_id: int, barrier: threading.Barrier,
            out: dict[str, Any]) -> None:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    rate = grpcclient.InferInput("sr", [1], "INT64")
    rate.set_data_from_numpy(np.array([speech.RATE], dtype=np.int64))
    latencies, probabilities = [], []
    try:
        barrier.wait()
        began = time.perf_counter()
        for index, chunk in enumerate(chunks):
            audio = grpcclient.InferInput("input", list(chunk.shape), "FP32")
            audio.set_data_from_numpy(chunk)
            start = time.perf_counter()
            client.async_stream_infer("silero_vad", [audio, rate], sequence_id=sequence_id,
                                      sequence_start=index == 0, sequence_end=index == len(chunks) - 1)
            result, error = answers.get(timeout=60)
            latencies.append(time.perf_counter() - start)
            if error is not None:
                raise RuntimeError(str(error))
            probabilities.append(float(result.as_numpy("output").ravel()[0]))
        out["began"], out["ended"] = began, time.perf_counter()
        out["latencies"], out["probabilities"] = latencies, probabilities
    except BaseException as failure:  # reported by the main thread
        out["error"] = repr(failure)
        barrier.abort()
    finally:
        client.stop_stream()
        client.close()


def _served(url: str, chunks: list[np.ndarray], streams: int, round_index: int,
            expected: list[float]) -> dict[str, Any]:
    barrier = threading.Barrier(streams)
    outs: list[dict[str, Any]] = [{} for _ in range(streams)]
    threads = [threading.Thread(target=_stream, args=(url, chunks, 1000 * (round_index + 2) + s + 1, barrier, out))
               for s, out in enumerate(outs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [out["error"] for out in outs if "error" in out]
    if errors:
        raise RuntimeError(f"stream failed: {errors[0]}")
    audio_seconds = len(chunks) * CHUNK_SECONDS
    per_stream = [audio_seconds / (out["ended"] - out["began"]) for out in outs]
    wall = max(out["ended"] for out in outs) - min(out["began"] for out in outs)
    p50, p99 = _percentiles([latency for out in outs for latency in out["latencies"]])
    max_diff = max(float(np.max(np.abs(np.subtract(out["probabilities"], expected)))) for out in outs)
    return {"rtf_total": streams * audio_seconds / wall, "rtf_stream_min": min(per_stream),
            "rtf_stream_median": statistics.median(per_stream), "p50_us": p50 * 1e6, "p99_us": p99 * 1e6,
            "max_diff": max_diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="audio per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instances", type=int, default=1, help="model instances on the server")
    parser.add_argument("--quick", action="store_true", help="1 round, 4 s of audio")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds = 1, 4.0
    if importlib.util.find_spec("silero_vad") is None:
        print("silero-vad is missing: run scripts/bootstrap.sh first", file=sys.stderr)
        return 1

    RESULTS.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        audio, source = _audio(folder / "audio", args.seconds)
        chunks = speech.chunks(audio)
        repo = folder / "repo"
        model_dir = models.silero_vad(repo, strategy=f"oldest {{ max_candidate_sequences: {args.streams} }}")
        config = model_dir / "config.pbtxt"
        config.write_text(config.read_text().replace("count: 1", f"count: {args.instances}"))
        model = model_dir / "1" / "model.onnx"
        expected = _direct(model, chunks)["probabilities"]
        samples: dict[str, list[dict[str, Any]]] = {"direct": [], "served": []}
        with geserve([repo], RESULTS / "vad.server.log") as running:
            _served(running.grpc_url, chunks[:20], args.streams, -1, expected[:20])  # warm-up
            for round_index in range(args.rounds):
                order = ["direct", "served"] if round_index % 2 == 0 else ["served", "direct"]
                for case in order:
                    if case == "direct":
                        result = _direct(model, chunks)
                        result.pop("probabilities")
                    else:
                        result = _served(running.grpc_url, chunks, args.streams, round_index, expected)
                    samples[case].append(result)
                    print(f"round {round_index + 1} {case}: RTF {result['rtf_total']:.1f}, "
                          f"p50 {result['p50_us']:.0f} µs, p99 {result['p99_us']:.0f} µs", file=sys.stderr)

    def med(case: str, key: str) -> float:
        return float(statistics.median(sample[key] for sample in samples[case]))

    audio_seconds = len(chunks) * CHUNK_SECONDS
    labels = {"direct": "ONNX Runtime loop, in process, 1 core, 1 stream",
              "served": f"geserve, gRPC streaming, {args.streams} concurrent streams ({args.instances} instance)"}
    lines = [
        f"# Silero VAD streamed: real-time factor with {args.streams} concurrent streams (gRPC) vs a direct loop",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {args.rounds} alternating round(s), medians of the rounds shown; "
        f"{len(chunks)} chunks of 512 samples ({audio_seconds:.1f} s of audio) per stream; audio: {source}.",
        "",
        "| case | RTF total (audio s / wall s) | RTF per stream, median | RTF per stream, slowest | p50 µs / chunk "
        "| p99 µs / chunk | max abs prob diff vs direct |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in ("direct", "served"):
        lines.append(f"| {labels[case]} | {med(case, 'rtf_total'):.1f} | {med(case, 'rtf_stream_median'):.1f} | "
                     f"{med(case, 'rtf_stream_min'):.1f} | {med(case, 'p50_us'):.0f} | {med(case, 'p99_us'):.0f} | "
                     f"{max(s['max_diff'] for s in samples[case]):.1e} |")
    lines += [
        "",
        "- RTF: seconds of audio processed per second of wall time; above 1 keeps up with live audio. Total: all "
        "streams' audio over the wall time from the first chunk sent to the last answer; per stream: that "
        "stream's audio over its own time.",
        "- served: each stream a client thread with its own gRPC stream (tritonclient `start_stream`), one sequence, "
        "one chunk in flight (the next chunk sent when the previous answer is back); latency is the client's round "
        "trip. The client threads run on the same machine as the server.",
        "- direct: `session.run` per chunk with the state fed back by hand, intra-op and inter-op threads 1, "
        "sequential; latency is one `session.run`.",
        f"- geserve {__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs; load average {load_before:.1f} before the run and "
        f"{os.getloadavg()[0]:.1f} after; other processes may have shared the machine",
        f"- command: `.venv/bin/python bench/vad_bench.py{''.join(' ' + a for a in sys.argv[1:])}`",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    (RESULTS / "vad.md").write_text(report)
    (RESULTS / "vad.json").write_text(json.dumps({"args": vars(args), "source": source, "chunks": len(chunks),
                                                  "samples": samples}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
