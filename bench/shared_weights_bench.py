"""Memory and start time of a server whose CPU sessions map one file of prepacked weights (`share_weights`, the
default) against sessions that each keep a private copy.

Serves resnet50, minilm and mlp from examples/ with 1, 2 and 4 workers, each cell with `share_weights` true and
false, after one request to every model. Memory is the whole process tree's proportional set size (PSS: a page
shared by k processes counts 1/k in each, so the sum is what the server costs the machine). Start time is from
spawn to ready; the first start with sharing on also packs the graphs into a fresh cache (reported apart).
Writes bench/results/shared_weights.md.

Usage: .venv/bin/python bench/shared_weights_bench.py [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import EXAMPLES, RESULTS, link_model_files, load_config, random_inputs
from tests.support.budget_models import tree_pss
from tests.support.server import geserve

MODELS = ("resnet50", "minilm", "mlp")
MIB = 1 << 20


def repository(dest: Path, share: bool) -> Path:
    """The models as in examples/, each with `share_weights` set."""
    for model in MODELS:
        folder = link_model_files(model, dest / model)
        text = (EXAMPLES / model / "config.pbtxt").read_text()
        value = "true" if share else "false"
        (folder / "config.pbtxt").write_text(
            text + f'parameters {{ key: "share_weights", value: {{ string_value: "{value}" }} }}\n')
    return dest


def one_request_each(url: str) -> None:
    client = httpclient.InferenceServerClient(url)
    try:
        for model in MODELS:
            config = load_config(EXAMPLES / model)
            inputs = []
            for name, value in random_inputs_fixed(config).items():
                tensor = httpclient.InferInput(name, list(value.shape), httpclient.np_to_triton_dtype(value.dtype))
                tensor.set_data_from_numpy(value)
                inputs.append(tensor)
            for _ in range(4):  # enough to reach each worker with two
                client.infer(model, inputs)
    finally:
        client.close()


def random_inputs_fixed(config: model_config_pb2.ModelConfig) -> dict[str, np.ndarray]:
    """minilm's token dims are variable: 16 tokens of id 1; the others as harness.random_inputs makes them."""
    if config.name == "minilm":
        return {tensor.name: np.ones((1, 16), dtype=np.int64) for tensor in config.input}
    return random_inputs(config, 1)


def measure(workers: int, share: bool, scratch: Path) -> tuple[float, float]:
    """(MiB of PSS, seconds from spawn to ready) of one server."""
    repo = repository(scratch / f"repo-{workers}-{share}", share)
    started = time.perf_counter()
    with geserve([repo], RESULTS / "shared_weights.geserve.log", ["--workers", str(workers)]) as server:
        ready = time.perf_counter() - started
        one_request_each(f"127.0.0.1:{server.http_port}")
        return tree_pss(server.process.pid) / MIB, ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    counts = [int(part) for part in args.workers.split(",")]
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shared-weights-") as scratch:
        os.environ["GESERVE_CACHE_DIR"] = str(Path(scratch) / "cache")  # a fresh cache: the first start packs
        _, first_start = measure(counts[0], True, Path(scratch) / "first")
        for workers in counts:
            private, private_start = measure(workers, False, Path(scratch))
            shared, shared_start = measure(workers, True, Path(scratch))
            rows.append((workers, private, shared, private_start, shared_start))
    lines = [
        "# Server memory with prepacked weights mapped from one file (`share_weights`) or a copy per session",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {', '.join(MODELS)} from examples/, one CPU instance each, after "
        "4 requests to each model; PSS of the whole process tree; `.venv/bin/python bench/shared_weights_bench.py`",
        "",
        "| workers | private copies: PSS MiB | shared: PSS MiB | saved | start, private (s) | start, shared (s) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for workers, private, shared, private_start, shared_start in rows:
        lines.append(f"| {workers} | {private:.0f} | {shared:.0f} | {private - shared:.0f} MiB "
                     f"({(private - shared) / private:.0%}) | {private_start:.1f} | {shared_start:.1f} |")
    lines += ["", f"First start with sharing on, packing into an empty cache ({counts[0]} worker(s)): "
              f"{first_start:.1f} s."]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "shared_weights.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
