"""Issue 35: OpenAI embeddings, geserve's `/v1/embeddings` against infinity-emb, a dedicated embedding server, on the
same all-MiniLM-L6-v2 weights, the same cores and the same ONNX Runtime thread count.

geserve serves the example `text_embedding` pipeline (tokenizer -> MiniLM on the GE backend). infinity (0.0.78, its
own venv .venv-infinity from locks/infinity-py3.11.txt, installed here by scripts/install_infinity.sh) serves the same
weights offline with its ONNX Runtime engine (`--engine optimum`, mean pooling, batch size 32). What it takes to get
there, each step said where it is done: infinity's ONNX engine wants an ONNX file of token embeddings beside the
weights, which the weights' package does not ship, so one is exported here with the main venv's torch from the same
safetensors through examples/build_minilm.py's BERT, without its pooling (infinity pools and normalizes itself);
infinity lists a local folder's ONNX file by its absolute path, which optimum then refuses ("Could not find any ONNX
files with target file name /.../model.onnx, only found: [model.onnx]"), so it runs in the folder with
`--model-id .`; its graph optimization fails with optimum 2 (`fuse_for_infinity` says why), so its result is put in
infinity's cache; and HF_HUB_OFFLINE=1 keeps it off the network. Its `auto` pooling took CLS on this folder:
`--pooling-method mean` is the model's. The report's agreement line checks that both serve the same vectors.

Load: closed-loop clients on keep-alive connections from a generator process of its own (bench/overload_bench.py's),
batch-1 requests at concurrency 1, 8 and 32, and lists of 32 sentences at 1 and 4; real sentences (the MiniLM model
card's), float vectors, JSON. Each cell alternates the systems over the rounds; the report gives medians of sentences
per second, p50 and p99, and the servers' CPU per sentence. Targets: geserve >= 1.5x infinity's throughput at c=32,
and a lower p99 at c=1. Writes bench/results/embeddings.md and embeddings.json.

    .venv/bin/python bench/embeddings_bench.py [--quick] [--rounds N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from bench.overload_bench import ClosedLoop, Generator  # noqa: E402
from geserve.tune.machine import others_share, tree_cpu_s  # noqa: E402
from tests.support.embeddings import PIPELINE, example_repository  # noqa: E402
from tests.support.reference import free_port  # noqa: E402
from tests.support.server import start_geserve, stop_geserve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "bench" / ".work" / "embeddings"
INFINITY_VENV = ROOT / ".venv-infinity"
HF_HOME = WORK / "hf-home"
OPTIMIZED = HF_HOME / "hub" / "infinity_onnx" / "CPUExecutionProvider"  # infinity's cache for `--model-id .`
CELLS = (("single", 1), ("single", 8), ("single", 32), ("list32", 1), ("list32", 4))
LIST = 32
SYSTEMS = ("geserve", "infinity")


@dataclass
class Endpoint:
    system: str
    port: int
    pid: int
    path: str
    model: str


def sentences() -> list[str]:
    """The MiniLM model card's sentences of 5 to 40 words: real text of the lengths people embed."""
    from build_minilm import model_files

    text = re.sub(r"[`#*|\[\]()<>]", " ", (model_files() / "README.md").read_text())
    found = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+|\n\s*\n", text)]
    chosen = list(dict.fromkeys(s for s in found if 5 <= len(s.split()) <= 40))
    if len(chosen) < 16:
        raise SystemExit(f"only {len(chosen)} sentences found in the model card")
    return chosen


def request_bodies(endpoint: Endpoint, texts: list[str], per_request: int) -> tuple[bytes, ...]:
    bodies = []
    for start in range(0, len(texts), per_request):
        chunk = texts[start : start + per_request]
        if len(chunk) < per_request:
            break
        payload = json.dumps({"model": endpoint.model, "input": chunk[0] if per_request == 1 else chunk,
                              "encoding_format": "float"}).encode()
        head = (f"POST {endpoint.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        bodies.append(head + payload)
    return tuple(bodies)


def post(endpoint: Endpoint, texts: list[str]) -> np.ndarray:
    body = json.dumps({"model": endpoint.model, "input": texts}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{endpoint.port}{endpoint.path}", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        data = json.loads(answer.read())["data"]
    return np.array([item["embedding"] for item in sorted(data, key=lambda d: d["index"])], dtype=np.float32)


# ---- infinity: its venv, its model folder, its server ----

def infinity_model() -> Path:
    """The weights' folder with an ONNX export of its BERT (token embeddings out) for infinity's ONNX engine."""
    import torch
    from _build_common import source_digest
    from build_minilm import _bert, _load, model_files, tokenize

    folder = WORK / "infinity-minilm"
    digest = source_digest(__file__)
    if (folder / ".stamp").is_file() and (folder / ".stamp").read_text() == digest:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    weights = model_files()
    for item in weights.iterdir():  # the tokenizer, configs and 1_Pooling (mean pooling), not the weights
        if item.is_dir():
            shutil.copytree(item, folder / item.name)
        elif item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    bert = _bert(json.loads((weights / "config.json").read_text()))
    _load(bert, weights / "model.safetensors")
    bert.eval()

    class Tokens(torch.nn.Module):  # SentenceBert.forward without its pooling and normalization
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            b = self.bert
            x = b.norm(b.words(input_ids) + b.positions.weight[: input_ids.shape[1]] + b.token_type.weight[0])
            bias = (1.0 - attention_mask.to(x.dtype))[:, None, None, :] * torch.finfo(x.dtype).min
            for layer in b.layers:
                x = layer(x, bias)
            return x

    ids, mask = tokenize(["A man is eating food.", "Hello"])
    axes = {name: {0: "batch", 1: "sequence"} for name in ("input_ids", "attention_mask", "last_hidden_state")}
    torch.onnx.export(Tokens(), (torch.from_numpy(ids), torch.from_numpy(mask)), str(folder / "model.onnx"),
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_axes=axes, opset_version=17, dynamo=False)
    optimized = OPTIMIZED / "model_optimized.onnx"
    optimized.parent.mkdir(parents=True, exist_ok=True)
    fuse_for_infinity(folder / "model.onnx", optimized)
    shutil.copy(folder / "config.json", optimized.parent / "config.json")
    (folder / ".stamp").write_text(digest)
    return folder


def fuse_for_infinity(source: Path, target: Path) -> None:
    """What infinity's own optimizer writes (optimum's ORTOptimizer, level 99, CPU: onnxruntime's BERT fusions). It
    runs that step itself at start, and skips it when its cache holds the result; with optimum 2 its call fails
    (`OptimizationConfig` no longer takes `optimize_with_onnxruntime_only`) and it would serve the unfused graph, so
    the result is put in its cache here, where it looks first ("Optimized model found ..., skipping optimization")."""
    from onnxruntime.transformers.optimizer import optimize_model

    fused = optimize_model(str(source), model_type="bert", num_heads=12, hidden_size=384, opt_level=99,
                           use_gpu=False)
    fused.save_model_to_file(str(target))


def infinity_version() -> str:
    out = subprocess.run([str(INFINITY_VENV / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('infinity-emb'), m.version('optimum'), "
                          "m.version('onnxruntime'))"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@contextmanager
def infinity(folder: Path, log: Path) -> Iterator[Endpoint]:
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(HF_HOME), INFINITY_ANONYMOUS_USAGE_STATS="0",
               DO_NOT_TRACK="1")
    command = [str(INFINITY_VENV / "bin" / "infinity_emb"), "v2", "--model-id", ".", "--served-model-name", "minilm",
               "--engine", "optimum", "--device", "cpu", "--port", str(port), "--batch-size", "32",
               "--pooling-method", "mean"]  # the model's (1_Pooling); infinity's `auto` took CLS here
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise SystemExit(f"infinity exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"infinity did not come up:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield Endpoint("infinity", port, process.pid, "/embeddings", "minilm")
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def geserve_server(log: Path) -> Iterator[Endpoint]:
    examples = example_repository()
    repo = WORK / "repository"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    for name in PIPELINE:
        (repo / name).symlink_to(examples / name, target_is_directory=True)
    running = start_geserve([repo], log)
    try:
        yield Endpoint("geserve", running.http_port, running.process.pid, "/v1/embeddings", "text_embedding")
    finally:
        stop_geserve(running)


# ---- measuring ----

def cell(generator: Generator, endpoint: Endpoint, kind: str, concurrency: int, texts: list[str],
         seconds: float) -> dict[str, float]:
    per_request = LIST if kind == "list32" else 1
    warm = 4.0 if per_request > 1 else 2.0  # a list's answer takes seconds under load: every client answered once
    job = ClosedLoop("127.0.0.1", endpoint.port, request_bodies(endpoint, texts, per_request), concurrency,
                     warm_s=warm, duration_s=seconds)
    cpu_before = tree_cpu_s(endpoint.pid)
    with others_share() as others:
        result = generator.run(job)
    cpu = tree_cpu_s(endpoint.pid) - cpu_before
    if result["failures"]:
        raise SystemExit(f"{endpoint.system} {kind} c={concurrency} failed: {result['failures']}")
    rate = result["throughput"] * per_request
    return {"sentences_s": rate, "p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"],
            "cpu_ms_per_sentence": 1e3 * cpu / max(1.0, result["count"] * per_request * (seconds + warm) / seconds),
            "others_cpu": others[0] if others else 0.0}


def agreement(endpoints: dict[str, Endpoint], texts: list[str]) -> float:
    """The lowest cosine between the two systems' vectors of the same sentences."""
    a, b = (post(endpoints[s], texts) for s in SYSTEMS)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def median(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def report(samples: dict[tuple[str, str, int], list[dict[str, float]]], meta: dict[str, Any]) -> tuple[str, bool]:
    lines = ["# OpenAI embeddings: geserve vs infinity-emb", "", f"{meta['date']}, {meta['machine']}; "
             f"{meta['rounds']} rounds of {meta['seconds']:g} s per cell (medians), {meta['sentences']} distinct "
             f"sentences (MiniLM's model card, 5-40 words). geserve {meta['geserve']}: `text_embedding` "
             f"(`/v1/embeddings`); infinity-emb / optimum / onnxruntime {meta['infinity']}: `--engine optimum` "
             f"(ONNX Runtime), batch size 32. Both on the same {meta['cores']} cores. Lowest cosine between the two "
             f"systems' vectors: {meta['agreement']:.6f}.", "",
             "| requests | clients | geserve sentences/s | infinity sentences/s | ratio | geserve p50 / p99 ms | "
             "infinity p50 / p99 ms | CPU ms per sentence (geserve / infinity) | others' CPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind, concurrency in CELLS:
        g, i = samples[("geserve", kind, concurrency)], samples[("infinity", kind, concurrency)]
        ratio = median(g, "sentences_s") / median(i, "sentences_s")
        label = "1 sentence" if kind == "single" else f"{LIST} sentences"
        lines.append(
            f"| {label} | {concurrency} | {median(g, 'sentences_s'):.0f} | {median(i, 'sentences_s'):.0f} | "
            f"{ratio:.2f}x | {median(g, 'p50_ms'):.1f} / {median(g, 'p99_ms'):.1f} | "
            f"{median(i, 'p50_ms'):.1f} / {median(i, 'p99_ms'):.1f} | "
            f"{median(g, 'cpu_ms_per_sentence'):.2f} / {median(i, 'cpu_ms_per_sentence'):.2f} | "
            f"{max(s['others_cpu'] for s in g + i):.0%} |")
    throughput = (median(samples[("geserve", "single", 32)], "sentences_s")
                  / median(samples[("infinity", "single", 32)], "sentences_s"))
    p99 = median(samples[("geserve", "single", 1)], "p99_ms"), median(samples[("infinity", "single", 1)], "p99_ms")
    targets = [(f"geserve >= 1.5x infinity's throughput at c=32: {throughput:.2f}x", throughput >= 1.5),
               (f"geserve's p99 at c=1 lower: {p99[0]:.1f} vs {p99[1]:.1f} ms", p99[0] < p99[1])]
    lines += ["", "Targets:", ""] + [f"- {'PASS' if ok else 'FAIL'}: {text}" for text, ok in targets]
    lines += ["", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines), all(ok for _, ok in targets)


def measure(generator: Generator, endpoints: dict[str, Endpoint], texts: list[str], rounds: int,
            seconds: float) -> dict[tuple[str, str, int], list[dict[str, float]]]:
    """Every cell, each round, the systems alternating which goes first."""
    for system in SYSTEMS:  # warm both: first calls load the tokenizer, fill the arenas
        cell(generator, endpoints[system], "single", 8, texts, 2.0)
    samples: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for round_index in range(rounds):
        for kind, concurrency in CELLS:
            for system in SYSTEMS if round_index % 2 == 0 else SYSTEMS[::-1]:
                measured = cell(generator, endpoints[system], kind, concurrency, texts, seconds)
                samples.setdefault((system, kind, concurrency), []).append(measured)
                print(f"round {round_index + 1} {system:8} {kind:6} c={concurrency:<2} "
                      f"{measured['sentences_s']:7.0f} sentences/s  p50 {measured['p50_ms']:6.1f} ms  "
                      f"p99 {measured['p99_ms']:6.1f} ms  others' CPU {measured['others_cpu']:.0%}", flush=True)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 5 s cells")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=0.0)
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (5.0 if args.quick else 10.0)
    generator = Generator(None)  # forked first, before any thread or server
    subprocess.run(["bash", str(ROOT / "scripts" / "install_infinity.sh")], check=True)
    texts = sentences()
    RESULTS.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        stack.callback(generator.stop)
        endpoints = {
            "geserve": stack.enter_context(geserve_server(RESULTS / "embeddings.geserve.log")),
            "infinity": stack.enter_context(infinity(infinity_model(), RESULTS / "embeddings.infinity.log")),
        }
        similarity = agreement(endpoints, texts[:64])
        samples = measure(generator, endpoints, texts, rounds, seconds)
    from geserve.version import __version__

    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} vCPUs",
        "rounds": rounds, "seconds": seconds, "sentences": len(texts), "geserve": __version__,
        "infinity": infinity_version(), "cores": os.cpu_count(), "agreement": similarity,
        "command": " ".join([".venv/bin/python bench/embeddings_bench.py", *sys.argv[1:]]),
    }
    text, met = report(samples, meta)
    (RESULTS / "embeddings.md").write_text(text)
    (RESULTS / "embeddings.json").write_text(json.dumps(
        {"meta": meta, "samples": {f"{s} {k} c={c}": v for (s, k, c), v in samples.items()}}, indent=1))
    print(text)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
