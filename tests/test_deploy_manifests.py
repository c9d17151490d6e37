"""deploy/ and the Dockerfiles: the Kubernetes manifests against Kubernetes' schemas (kubernetes-validate), the KServe
resources against KServe's fields (tests/data/kserve-crd-subset.yaml), the kustomizations' references, and one
running geserve started with the Deployment's own arguments, environment and (made-up) Secret files: its probes
answer, its security flags hold, and its /metrics has every family the Grafana dashboard queries.

No cluster, docker daemon or kustomize runs here; the Dockerfiles are read, not built.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from geserve.cli import build_parser
from tests.support import models
from tests.support.certs import Issued, client_context, issue, make_ca
from tests.support.reference import free_port
from tests.support.security import KeyPair, bearer, rsa_key
from tests.support.server import REPO_ROOT, RunningServer, stop_geserve

DEPLOY = REPO_ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KSERVE = DEPLOY / "kserve"
DASHBOARD = DEPLOY / "grafana" / "geserve-dashboard.json"
KSERVE_SCHEMA = REPO_ROOT / "tests" / "data" / "kserve-crd-subset.yaml"
# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default from 1.30) and the newest
# that kubernetes-validate has schemas for.
VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version() + ".0")
LOCAL = ["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
# Labels Prometheus adds when it scrapes a pod (kubernetes_sd relabelling), not geserve.
SCRAPE_LABELS = {"pod", "namespace", "instance", "job"}


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted([*KUBERNETES.rglob("*.yaml"), *KSERVE.rglob("*.yaml")])


def is_kserve(doc: dict[str, Any]) -> bool:
    return str(doc["apiVersion"]).startswith("serving.kserve.io/")


def only(directory: Path, kind: str) -> dict[str, Any]:
    found = [doc for path in sorted(directory.glob("*.yaml")) for doc in documents(path) if doc["kind"] == kind]
    assert len(found) == 1, f"{directory}: {len(found)} {kind}s"
    return found[0]


def deployment() -> dict[str, Any]:
    return only(KUBERNETES / "base", "Deployment")


def container(doc: dict[str, Any]) -> dict[str, Any]:
    (main,) = doc["spec"]["template"]["spec"]["containers"]
    return main


def runtime_container() -> dict[str, Any]:
    (main,) = only(KSERVE, "ServingRuntime")["spec"]["containers"]
    return main


def flags(args: list[str]) -> dict[str, list[str]]:
    """`--flag=value` arguments by flag (the manifests write every flag that way)."""
    found: dict[str, list[str]] = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            found.setdefault(name, []).append(value)
    return found


def workers_from_request(main: dict[str, Any], variable: dict[str, Any]) -> int:
    """The value Kubernetes gives GESERVE_WORKERS: the container's CPU request, rounded up to whole CPUs."""
    field = variable["valueFrom"]["resourceFieldRef"]
    assert variable["name"] == "GESERVE_WORKERS"
    assert (field["containerName"], field["resource"], field["divisor"]) == (main["name"], "requests.cpu", "1")
    request = str(main["resources"]["requests"]["cpu"])
    return math.ceil(int(request[:-1]) / 1000 if request.endswith("m") else float(request))


def k8s_validate(doc: dict[str, Any]) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def as_pod(containers: list[dict[str, Any]], volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Containers and volumes embedded in a KServe resource, in a Pod, for Kubernetes' own schema to check."""
    spec: dict[str, Any] = {"containers": containers}
    if volumes:
        spec["volumes"] = volumes
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "embedded"}, "spec": spec}


# ---- schemas ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_validates(path: Path) -> None:
    """Strict schemas: an unknown or misspelled field fails, as `kubectl apply --validate=strict` would."""
    for doc in documents(path):
        if doc["kind"] == "Kustomization":
            assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
            assert set(doc) <= {"apiVersion", "kind", "resources", "patches", "images", "labels"}, path
        elif is_kserve(doc):
            schema = yaml.safe_load(KSERVE_SCHEMA.read_text())[doc["kind"]]
            jsonschema.validate(doc, schema)
            spec = doc["spec"]
            if doc["kind"] == "ServingRuntime":
                k8s_validate(as_pod(spec["containers"], spec.get("volumes")))
            else:  # the model spec inlines a corev1.Container beside KServe's own fields
                model = dict(spec["predictor"]["model"])
                for own in ("modelFormat", "runtime", "storageUri", "runtimeVersion", "protocolVersion"):
                    model.pop(own, None)
                k8s_validate(as_pod([{"name": "kserve-container", **model}]))
        else:
            k8s_validate(doc)


def test_the_schemas_refuse_a_misspelled_field() -> None:
    """The checks above are not vacuous: a typo fails in the Kubernetes and the KServe schema alike."""
    broken = deployment()
    container(broken)["livenesProbe"] = container(broken).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(broken)
    runtime = only(KSERVE, "ServingRuntime")
    runtime["spec"]["supportedModelFormats"][0]["autoselect"] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(runtime, yaml.safe_load(KSERVE_SCHEMA.read_text())["ServingRuntime"])


# ---- kustomize, by hand ------------------------------------------------------------------------------------


def kustomized(directory: Path) -> list[dict[str, Any]]:
    """The resources a kustomization lists, its bases' included (no patches applied)."""
    kustomization = only(directory, "Kustomization")
    found: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory / 'kustomization.yaml'} names {entry}, which does not exist"
        found += kustomized(target) if target.is_dir() else documents(target)
    return found


@pytest.mark.parametrize("directory", sorted(p.parent for p in KUBERNETES.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_kustomizations_name_files_that_exist_and_patch_what_the_base_has(directory: Path) -> None:
    kustomization = only(directory, "Kustomization")
    resources = kustomized(directory)
    by_name = {(doc["kind"], doc["metadata"]["name"]): doc for doc in resources}
    listed = {directory / p for p in kustomization.get("resources", [])} | {
        directory / p["path"] for p in kustomization.get("patches", [])}
    assert {p for p in directory.glob("*.yaml") if p.name != "kustomization.yaml"} <= listed, \
        "a manifest in the folder that the kustomization does not use"
    for entry in kustomization.get("patches", []):
        path = directory / entry["path"]
        assert path.is_file(), f"{path} does not exist"
        for patch in documents(path):
            target = by_name.get((patch["kind"], patch["metadata"]["name"]))
            assert target is not None, f"{path} patches {patch['kind']}/{patch['metadata']['name']}, not in the base"
            # A strategic merge adds a container whose name is new: every patched container must be one of the base's.
            base_names = {c["name"] for c in target["spec"]["template"]["spec"]["containers"]}
            assert {c["name"] for c in patch["spec"]["template"]["spec"]["containers"]} <= base_names
            assert patch["spec"]["selector"] == target["spec"]["selector"]
    images = {c["image"].split(":")[0] for doc in resources if doc["kind"] == "Deployment"
              for c in doc["spec"]["template"]["spec"]["containers"]}
    assert {i["name"] for i in kustomization.get("images", [])} <= images


@pytest.mark.parametrize(("overlay", "tag", "gpus"), [("cpu", "cpu", None), ("nvidia-gpu", "cuda", "1")])
def test_kubectl_kustomize_builds_each_overlay(overlay: str, tag: str, gpus: str | None) -> None:
    """The real build, where kubectl is installed (the registries here offer no kustomize; the checks above stand
    in without it): the result validates, and the patches merged into the base's one container."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay is checked by hand above")
    built = subprocess.run([kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    docs = [doc for doc in yaml.safe_load_all(built) if doc is not None]
    assert {doc["kind"] for doc in docs} == {doc["kind"] for doc in kustomized(KUBERNETES / "base")}
    for doc in docs:
        k8s_validate(doc)
    (main,) = next(doc for doc in docs if doc["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"]
    assert main["image"] == f"geserve:{tag}"
    assert main["resources"]["limits"].get("nvidia.com/gpu") == gpus
    assert main["args"] == container(deployment())["args"]


def test_the_service_and_the_probes_name_the_ports_geserve_listens_on() -> None:
    main = container(deployment())
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    listening = flags(main["args"])
    assert listening["--http-port"] == ["8000"] and listening["--grpc-port"] == ["8001"]
    assert listening["--metrics-port"] == ["8002"]
    service = only(KUBERNETES / "base", "Service")
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        (name, number, name) for name, number in ports.items()}
    assert service["spec"]["selector"] == deployment()["spec"]["selector"]["matchLabels"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert main[probe]["httpGet"]["port"] in ports
    assert only(KUBERNETES / "base", "PodDisruptionBudget")["spec"]["selector"] == deployment()["spec"]["selector"]


def adapter_rule() -> dict[str, Any]:
    config = yaml.safe_load(only(KUBERNETES / "prometheus-adapter", "ConfigMap")["data"]["config.yaml"])
    (rule,) = config["rules"]
    return rule


def test_the_hpa_scales_on_the_metric_the_adapter_rule_serves() -> None:
    hpa = only(KUBERNETES / "base", "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == adapter_rule()["name"]["as"] == "nv_inference_pending_request_count"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment()["metadata"]["name"]
    assert set(adapter_rule()["resources"]["overrides"]) == {"namespace", "pod"}


def test_the_kserve_runtime_maps_kserves_ports_and_store() -> None:
    runtime = only(KSERVE, "ServingRuntime")
    assert runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    formats = {f["name"]: f for f in runtime["spec"]["supportedModelFormats"]}
    assert set(formats) == {"onnx", "triton"} and all(f["autoSelect"] for f in formats.values())
    args = build_parser().parse_args(runtime_container()["args"])  # geserve's own parser: the flags exist
    assert args.command == "serve"
    assert args.model_repositories == [Path("/mnt/models")]
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8080, 9000, 8002)
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == "8002"
    # --workers follows the CPU request on both ways of deploying (the node's core count otherwise).
    for main in (runtime_container(), container(deployment())):
        (workers,) = [v for v in main["env"] if v["name"] == "GESERVE_WORKERS"]
        assert workers_from_request(main, workers) == 2
        assert "--workers" not in flags(main["args"])
    # The dashboard needs the same metrics switches on both ways of deploying.
    assert flags(runtime_container()["args"])["--metrics-config"] == flags(container(deployment())["args"])[
        "--metrics-config"]
    service = only(KSERVE, "InferenceService")
    assert service["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    assert service["spec"]["predictor"]["model"]["modelFormat"]["name"] in formats


# ---- Dockerfiles -------------------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                           if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


@pytest.mark.parametrize(("name", "switches"), [("Dockerfile", ["GESERVE_SERVE_ONLY=1"]),
                                                ("Dockerfile.cuda", ["GESERVE_CUDA=1", "GESERVE_SERVE_ONLY=1"])])
def test_the_dockerfiles_install_with_the_readme_script(name: str, switches: list[str]) -> None:
    steps = instructions(REPO_ROOT / name)
    runs = [arguments for instruction, arguments in steps if instruction == "RUN"]
    installs = [run for run in runs if "scripts/bootstrap.sh" in run]
    assert len(installs) == 1, "geserve is installed once, by the README's script"
    assert all(switch in installs[0].split("bash scripts/bootstrap.sh")[0] for switch in switches)
    assert not any(re.search(r"\bpip\b", run) for run in runs), "a second way to install"
    assert ("COPY", ". .") in steps
    user = next(arguments for instruction, arguments in steps if instruction == "USER")
    assert user.split(":")[0] == str(deployment()["spec"]["template"]["spec"]["securityContext"]["runAsUser"])
    assert user.split(":")[0] == str(runtime_container()["securityContext"]["runAsUser"])
    assert ("ENTRYPOINT", '["geserve"]') in steps
    # What the install reads must reach the build context.
    ignored = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "scripts/bootstrap.sh", "geserve/cli.py"):
        assert not any(fnmatch.fnmatch(needed, pattern) or needed.startswith(pattern.rstrip("/") + "/")
                       for pattern in ignored), needed


# ---- one geserve started as the Deployment starts it --------------------------------------------------------


@dataclass
class Deployed:
    server: RunningServer
    ca: Issued
    key: KeyPair
    audience: str
    issuer: str
    ports: dict[int, int]  # the container's port -> the port this test's server listens on

    def context(self) -> ssl.SSLContext:
        return client_context(self.ca)

    def token(self) -> str:
        return self.key.token(scope="inference", aud=self.audience, iss=self.issuer)

    def get(self, port: int, path: str, headers: dict[str, str] | None = None, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"https://127.0.0.1:{self.ports[port]}{path}", data=data,
                                         headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10, context=self.context()) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()


def mounted(main: dict[str, Any], volumes: dict[str, Path]) -> dict[str, Path]:
    """Each volume's mount path in the container -> the local folder standing in for it."""
    return {mount["mountPath"]: volumes[mount["name"]] for mount in main["volumeMounts"]}


def rewrite(value: str, mounts: dict[str, Path]) -> str:
    for mount_path, local in mounts.items():
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(local) + value[len(mount_path):]
    return value


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    folder = tmp_path_factory.mktemp("deployed")
    main = container(deployment())
    pod = deployment()["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"tls": "geserve-tls", "jwt": "geserve-jwt"}
    # The Secrets' files, as `kubectl create secret tls` and `--from-file=jwks.json` lay them out (README).
    ca = make_ca()
    server_cert = issue(ca, "geserve", server=True)
    (folder / "tls").mkdir()
    (folder / "tls" / "tls.crt").write_bytes(server_cert.cert_pem)
    (folder / "tls" / "tls.key").write_bytes(server_cert.key_pem)
    key = rsa_key(kid="idp-1")
    (folder / "jwt").mkdir()
    (folder / "jwt" / "jwks.json").write_text(json.dumps({"keys": [key.jwk()]}))
    repo = folder / "models"
    repo.mkdir()
    models.simple(repo, extra="dynamic_batching { max_queue_delay_microseconds: 500 }")
    (folder / "tmp").mkdir()
    mounts = mounted(main, {"models": repo, "tls": folder / "tls", "jwt": folder / "jwt", "tmp": folder / "tmp"})

    # The Deployment's arguments, paths mapped to those folders and its fixed ports to free ones.
    container_ports = {p["containerPort"] for p in main["ports"]}
    ours = {"--http-port": free_port(), "--grpc-port": free_port(), "--metrics-port": free_port()}
    ports: dict[int, int] = {}
    args: list[str] = []
    for arg in main["args"]:
        name, _, value = arg.partition("=")
        if name in ours:
            ports[int(value)] = ours[name]
            continue
        args.append(f"{name}={rewrite(value, mounts)}" if value else arg)
    assert set(ports) == container_ports
    for name, port in ours.items():
        args += [name, str(port)]
    configmap = only(KUBERNETES / "base", "ConfigMap")
    env = dict(os.environ)
    for variable in main["env"]:
        if "value" in variable:
            env[variable["name"]] = rewrite(variable["value"], mounts)
        elif "resourceFieldRef" in variable["valueFrom"]:
            env[variable["name"]] = str(workers_from_request(main, variable))
        else:
            reference = variable["valueFrom"]["configMapKeyRef"]
            assert reference["name"] == configmap["metadata"]["name"]
            env[variable["name"]] = configmap["data"][reference["key"]]

    log = folder / "geserve.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "geserve", *args, *LOCAL], stdout=out,
                                   stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
    server = RunningServer(process, ours["--http-port"], log, ours["--grpc-port"], ours["--metrics-port"])
    found = Deployed(server, ca, key, configmap["data"]["audience"], configmap["data"]["issuer"], ports)
    try:
        deadline = time.monotonic() + 120  # two worker processes importing on a busy 2-core machine: 10-40 s
        while not _ready(found):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"geserve did not become ready (exit {process.poll()}):\n{server.log()[-4000:]}")
            time.sleep(0.1)
        yield found
    finally:
        stop_geserve(server)


def _ready(deployed: Deployed) -> bool:
    try:
        return deployed.get(8000, "/v2/health/ready")[0] == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
        return False


def test_the_probes_answer_on_a_server_started_as_the_deployment_starts_it(deployed: Deployed) -> None:
    main = container(deployment())
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert main["startupProbe"]["httpGet"]["path"] == main["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert main["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        check = main[probe]["httpGet"]
        assert check["scheme"] == "HTTPS"  # the Deployment serves TLS; the kubelet does not verify the certificate
        status, _ = deployed.get(ports[check["port"]], check["path"])  # no token: health stays open to probes
        assert status == 200, probe


def infer_body() -> dict[str, Any]:
    data = list(range(16))
    return {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": data} for n in ("INPUT0", "INPUT1")]}


def test_the_security_flags_from_the_secrets_hold(deployed: Deployed) -> None:
    path = "/v2/models/simple/infer"
    assert deployed.get(8000, path, body=infer_body())[0] == 401
    status, body = deployed.get(8000, path, headers=bearer(deployed.token()), body=infer_body())
    assert status == 200, body
    assert json.loads(body)["outputs"][0]["data"] == [2 * i for i in range(16)]


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses."""
    labels = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in group.split(",") if name.strip()}
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)|\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    metrics = {m.group(1) for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", bare) if not m.group(2)}
    return metrics - {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                      "unless"}, labels


def exposition(text: str) -> list[tuple[str, set[str]]]:
    """(sample name, label names) per sample, names as written: as Prometheus stores them (prometheus_client's
    parser would add `_total` to Triton's counters)."""
    samples = []
    for line in text.splitlines():
        match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s", line)
        if match and not line.startswith("#"):
            samples.append((match.group(1), set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match.group(2) or ""))))
    assert samples
    return samples


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":  # label_values(metric, label): the metric, and the label in a matcher
            metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"]).groups()
            queries.append(f'{metric}{{{label}=""}}')
    return queries


def test_the_dashboard_queries_only_what_a_running_geserve_exports(deployed: Deployed) -> None:
    for _ in range(5):
        assert deployed.get(8000, "/v2/models/simple/infer", headers=bearer(deployed.token()),
                            body=infer_body())[0] == 200
    bad = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}]}
    assert deployed.get(8000, "/v2/models/simple/infer", headers=bearer(deployed.token()), body=bad)[0] == 400
    status, text = deployed.get(8002, "/metrics")
    assert status == 200
    samples = exposition(text.decode())
    exported = {name for name, _ in samples}
    exported_labels = {label for _, labels in samples for label in labels} | SCRAPE_LABELS
    used_metrics: set[str] = set()
    for expr in dashboard_queries():
        metrics, labels = promql_names(expr)
        assert metrics, expr
        assert metrics <= exported, f"{expr}: {sorted(metrics - exported)} not on a running geserve's /metrics"
        assert labels <= exported_labels, f"{expr}: labels {sorted(labels - exported_labels)} not exported"
        used_metrics |= metrics
    # What the issue asks the dashboard to show.
    for needed in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_queue_duration_us",
                   "nv_inference_first_response_histogram_ms_bucket", "ge_batch_size_bucket"):
        assert needed in used_metrics
    series = re.match(r"\s*(\w+)\{", adapter_rule()["seriesQuery"])
    assert series is not None and series.group(1) in exported
