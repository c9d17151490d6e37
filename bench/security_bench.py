"""What security costs a request: the example MLP at concurrency 16 (and 1) over plain HTTP, HTTPS, HTTPS with
mutual TLS, and plain HTTP with bearer-token (JWT) verification on, each driven by perf_analyzer in alternating
rounds.

One geserve process per configuration, all started once and all serving the same MLP; only one is driven at a
time, and the order rotates each round. perf_analyzer speaks HTTPS itself (`-u https://...` with its
`--ssl-https-*` options; its connections are kept alive, so a handshake is paid once per connection, and what is
measured is the per-request cost of TLS records). The JWT configuration sends one RS256 token on every request
(`-H "authorization: Bearer ..."`): verified once, then served from geserve's token cache. Certificates and keys
are made for the run (tests/support/certs.py). Writes bench/results/security.md and security.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402
import jwt  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: E402

from tests.support import models  # noqa: E402
from tests.support.certs import Issued, client_context, issue, make_ca  # noqa: E402
from tests.support.reference import free_port, run_perf_analyzer  # noqa: E402
from tests.support.server import RunningServer, stop_geserve  # noqa: E402

MODEL = "mlp"
AUDIENCE = "geserve-bench"
# (label, perf_analyzer concurrency, what the cell reports)
CELLS = (
    ("c=16 (infer/s)", 16, "throughput"),
    ("c=16 p50 (µs)", 16, "p50"),
    ("c=16 server CPU / request (µs)", 16, "cpu"),
    ("c=1 p50 (µs)", 1, "p50"),
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Pki:
    folder: Path
    ca: Issued
    server: Issued
    client: Issued
    token: str
    public_key: Path


@dataclass
class Config:
    """One server configuration: its flags, and what perf_analyzer needs to reach it."""

    name: str
    server_args: list[str]
    https: bool = False
    client_certificate: bool = False
    token: bool = False
    server: RunningServer | None = None
    samples: list[dict[str, float | None]] = field(default_factory=list)

    def url(self) -> str:
        assert self.server is not None
        return f"{'https://' if self.https else ''}127.0.0.1:{self.server.http_port}"

    def get(self, pki: Pki, path: str) -> bytes:
        """One GET to this server, with the configuration's certificate and token."""
        context = client_context(pki.ca, pki.client if self.client_certificate else None) if self.https else None
        headers = {"authorization": f"Bearer {pki.token}"} if self.token else {}
        scheme = "https" if self.https else "http"
        assert self.server is not None
        request = urllib.request.Request(f"{scheme}://127.0.0.1:{self.server.http_port}{path}", headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            data: bytes = answer.read()
            return data

    def perf_args(self, pki: Pki) -> list[str]:
        args: list[str] = []
        if self.https:
            args += ["--ssl-https-ca-certificates-file", str(pki.ca.cert_path), "--ssl-https-verify-peer", "1",
                     "--ssl-https-verify-host", "2"]
        if self.client_certificate:
            args += ["--ssl-https-client-certificate-file", str(pki.client.cert_path),
                     "--ssl-https-private-key-file", str(pki.client.key_path)]
        if self.token:
            args += ["-H", f"authorization: Bearer {pki.token}"]
        return args


def make_pki(folder: Path) -> Pki:
    ca = make_ca("geserve bench CA").write(folder, "ca")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = folder / "jwt.pem"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    now = int(time.time())
    # perf_analyzer reads the model's metadata and config (and statistics) before it infers.
    claims = {"sub": "bench", "aud": AUDIENCE, "iat": now, "exp": now + 6 * 3600,
              "scope": "inference metadata model-config statistics"}
    return Pki(folder, ca, issue(ca, "geserve bench server", server=True).write(folder, "server"),
               issue(ca, "bench client", server=False).write(folder, "client"),
               jwt.encode(claims, key, algorithm="RS256"), public)


def configs(pki: Pki) -> list[Config]:
    tls = ["--http-use-ssl", f"--http-server-cert={pki.server.cert_path}", f"--http-server-key={pki.server.key_path}"]
    return [
        Config("HTTP", []),
        Config("HTTPS", tls, https=True),
        Config("HTTPS, mutual TLS", [*tls, "--http-use-ssl-mutual", f"--http-root-cert={pki.ca.cert_path}"],
               https=True, client_certificate=True),
        Config("HTTP + JWT", [f"--auth-jwt-public-key={pki.public_key}", f"--auth-jwt-audience={AUDIENCE}"],
               token=True),
    ]


@contextmanager
def serve(config: Config, pki: Pki, repo: Path, log_path: Path) -> Iterator[RunningServer]:
    http_port = free_port()
    command = [sys.executable, "-m", "geserve", "serve", "--model-repository", str(repo), "--http-address",
               "127.0.0.1", "--http-port", str(http_port), "--allow-grpc=false", "--allow-metrics=false",
               *config.server_args]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))
    server = RunningServer(process, http_port, log_path)
    context = client_context(pki.ca, pki.client if config.client_certificate else None)
    url = f"{'https' if config.https else 'http'}://127.0.0.1:{http_port}/v2/health/ready"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{config.name}: geserve did not come up:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=1, context=context if config.https else None) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.1)
        yield server
    finally:
        stop_geserve(server)


def server_cpu_s(pid: int) -> float:
    """CPU seconds the server process (all its threads) has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def served_count(config: Config, pki: Pki) -> int:
    """Requests the MLP has answered successfully so far (the server's own statistics)."""
    statistics_ = json.loads(config.get(pki, f"/v2/models/{MODEL}/stats"))
    return int(statistics_["model_stats"][0]["inference_stats"]["success"]["count"])


def measure(config: Config, pki: Pki, mode: harness.Mode) -> dict[str, float | None]:
    """The cells for one configuration. The server's CPU per request (its CPU time over the requests it answered
    during the run) is the steadiest of them: other processes on the machine slow the server down, but they do
    not make it spend more CPU on each request."""
    assert config.server is not None
    values: dict[str, float | None] = {}
    points: dict[int, tuple[harness.Point | None, float | None, float]] = {}
    for label, concurrency, kind in CELLS:
        if concurrency not in points:
            cpu0, count0 = server_cpu_s(config.server.process.pid), served_count(config, pki)
            with harness.others_share() as others:
                point = perf_analyzer(config, pki, concurrency, mode)
            cpu1, count1 = server_cpu_s(config.server.process.pid), served_count(config, pki)
            per_request = (cpu1 - cpu0) / (count1 - count0) * 1e6 if count1 > count0 else None
            points[concurrency] = (point, per_request, others[0])
        point, per_request, share = points[concurrency]
        if kind == "cpu":
            values[label] = per_request
        else:
            values[label] = None if point is None else (point.throughput if kind == "throughput" else point.p50_us)
        values[f"others c={concurrency}"] = share
    return values


def perf_analyzer(config: Config, pki: Pki, concurrency: int, mode: harness.Mode) -> harness.Point | None:
    """One perf_analyzer run (harness.py's settings); retried once at stability 100% and 3x the window."""
    output = ""
    for stability, window in ((mode.stability, mode.window_ms), (100, 3 * mode.window_ms)):
        with tempfile.TemporaryDirectory(prefix="security-pa-") as tmp:
            csv_path = Path(tmp) / "pa.csv"
            args = ["-m", MODEL, "-u", config.url(), "-i", "http", "--concurrency-range", str(concurrency),
                    "--measurement-interval", str(window), "--stability-percentage", str(stability),
                    "--max-trials", str(mode.max_trials), *config.perf_args(pki), "-f", str(csv_path)]
            result = run_perf_analyzer(args, timeout=60 + mode.max_trials * window / 1000 * 2)
            point = harness.read_csv_point(csv_path)
            output = result.stdout + result.stderr
        if point is not None:
            return point
    print(f"  {config.name} c={concurrency}: perf_analyzer gave no result: {output[-800:]}", file=sys.stderr)
    return None


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def rounds_of(config: Config, label: str) -> str:
    return ", ".join("-" if s[label] is None else f"{s[label]:.0f}" for s in config.samples)


def report(all_configs: list[Config], mode: harness.Mode, rounds: int) -> str:
    base = all_configs[0]
    lines = [
        "# Security cost: MLP over HTTP, HTTPS, mutual TLS and with JWT verification (perf_analyzer)",
        "",
        f"{rounds} alternating rounds, median per cell; perf_analyzer window {mode.window_ms} ms, stability "
        f"{mode.stability}%, binary tensors and keep-alive connections (perf_analyzer's defaults). "
        f"Date: {time.strftime('%Y-%m-%d')}. Machine: {harness.machine()}.",
        "",
        "| configuration | " + " | ".join(label for label, *_ in CELLS)
        + " | CPU / request vs HTTP | rounds (c=16 infer/s) | rounds (CPU / request) | others' CPU (c=16) |",
        "|---|" + "---:|" * len(CELLS) + "---:|---|---|---:|",
    ]
    cpu_label = CELLS[2][0]
    base_cpu = median([s[cpu_label] for s in base.samples])
    for config in all_configs:
        cells = [median([s[label] for s in config.samples]) for label, *_ in CELLS]
        cpu = cells[2]
        extra = f"{cpu - base_cpu:+.0f} µs" if cpu is not None and base_cpu is not None else "n/a"
        shown = " | ".join("n/a" if value is None else f"{value:.0f}" for value in cells)
        others = median([s["others c=16"] for s in config.samples]) or 0.0
        lines.append(f"| {config.name} | {shown} | {extra} | {rounds_of(config, CELLS[0][0])} | "
                     f"{rounds_of(config, cpu_label)} | {others:.0%} |")
    lines += [
        "",
        "CPU / request: the server process's CPU time during the c=16 run over the requests it answered then (its "
        "own statistics). Other processes on the machine slow the server down more than they change this, so it "
        "is the steadier column to read a cost from, though contention moves it too (shared caches and cores). "
        "`others' CPU`: the share of the machine used by processes outside the benchmark during the c=16 run; "
        "above ~15% every column is disturbed.",
        "",
        "HTTPS: TLS 1.3 (ECDSA P-256 server certificate), the handshake paid once per perf_analyzer connection; "
        "mutual TLS adds the client certificate's check to that handshake and nothing per request (the subject is "
        "read once per connection). JWT: RS256, verified once and then found in the token cache on every request. "
        "This VM moves ±15-30% between runs: differences within that are noise.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="short perf_analyzer windows, one round")
    args = parser.parse_args()
    mode = harness.QUICK if args.quick else harness.FULL
    rounds = args.rounds or mode.rounds
    models.example_onnx(MODEL)  # builds the example MLP if it is not built yet
    if not harness.reference.perf_analyzer_path().is_file():
        print("perf_analyzer is missing: run scripts/install_reference.sh first", file=sys.stderr)
        return 1
    harness.RESULTS.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="security-bench-") as tmp:
        pki = make_pki(Path(tmp) / "pki")
        repo = harness.model_repository([MODEL], Path(tmp) / "repo")
        all_configs = configs(pki)
        for index, config in enumerate(all_configs):
            log = harness.RESULTS / f"security.{index}.log"
            config.server = stack.enter_context(serve(config, pki, repo, log))
        for index in range(rounds):
            order = all_configs[index % len(all_configs):] + all_configs[:index % len(all_configs)]
            for config in order:
                print(f"round {index + 1}: {config.name}", file=sys.stderr)
                harness.wait_for_quiet(10)
                config.samples.append(measure(config, pki, mode))
    text = report(all_configs, mode, rounds)
    print(text)
    (harness.RESULTS / "security.md").write_text(text)
    (harness.RESULTS / "security.json").write_text(json.dumps(
        {config.name: {"server_args": config.server_args, "rounds": config.samples} for config in all_configs},
        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
