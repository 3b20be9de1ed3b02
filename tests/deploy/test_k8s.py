"""deploy/k8s: every manifest valid against the Kubernetes schemas (offline, strict: unknown fields fail), the GPU
overlay too, and the manifests consistent with the code they run (CLI flags, health names, ports, drain time)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jsonpatch
import pytest
import yaml
from kubernetes_validate import utils as k8s

from services.cli import build_parser
from services.inference.replica import INFERENCE_SERVICE, LIVENESS, drain_grace_s
from services.metering.link import MeteringLink
from services.metering.server import METERING_SERVICE, MeteringApp

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest and newest minor versions we claim: gRPC probes are GA since 1.27.
VERSIONS = ("1.29.0", "1.37.0")
WORKLOADS = ("Deployment", "Job")


def is_manifest(path: Path) -> bool:
    return path.name != "kustomization.yaml" and not path.name.endswith(".patch.yaml")


MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if is_manifest(p))


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def render(directory: Path) -> list[dict]:
    """What `kubectl apply -k` applies, for the features our kustomizations use: resources (files or
    directories), RFC 6902 patches by target, and the namespace."""
    spec = kustomization(directory)
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load(path)
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        target = patch["target"]
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch target {target} matches {len(hits)} resources"
        docs[docs.index(hits[0])] = jsonpatch.apply_patch(hits[0], ops)
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] != "Namespace":
                doc["metadata"]["namespace"] = spec["namespace"]
    return docs


BASE = render(K8S / "base")
GPU = render(K8S / "overlays" / "gpu")
MIGRATE = render(K8S / "migrate")


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(doc: dict) -> dict:
    (only,) = doc["spec"]["template"]["spec"]["containers"]
    return only


def parse_args(c: dict):
    """The container's args through the real `zeroqueue` parser; $(VAR) must name one of its env vars."""
    env = {e["name"] for e in c.get("env", [])}
    args = []
    for arg in c["args"]:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{c['name']}: $({var}) is not in its env"
        args.append(re.sub(r"\$\((\w+)\)", "postgresql+psycopg://u@db/zq", arg))
    return build_parser().parse_args(args)


def port_named(c: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return port


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_valid(path: Path, version: str) -> None:
    docs = load(path)
    assert docs
    for doc in docs:
        k8s.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_gpu_overlay_renders_valid_manifests(version: str) -> None:
    for doc in GPU:
        k8s.validate(doc, version, strict=True)


def test_kustomizations_take_every_manifest_once() -> None:
    taken: list[Path] = []
    for file in K8S.rglob("kustomization.yaml"):
        spec = kustomization(file.parent)
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            path = (file.parent / entry).resolve()
            assert path.exists(), f"{file}: {entry} does not exist"
            if path.is_file():
                taken.append(path)
    assert sorted(taken) == sorted(
        p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p.name != "secrets.example.yaml"
    )


@pytest.mark.parametrize("docs", [BASE, GPU], ids=["base", "gpu"])
def test_the_replicas_behind_the_service_know_they_have_others_beside_them(docs: list[dict]) -> None:
    """Several replicas behind one Service: a saturated one points retries at the others (`--elsewhere`)."""
    deployment = named(docs, "Deployment", "zeroqueue-inference")
    assert deployment["spec"]["replicas"] > 1 and parse_args(container(deployment)).elsewhere


def test_gpu_overlay_asks_for_a_gpu_and_the_cuda_image() -> None:
    inference = container(named(GPU, "Deployment", "zeroqueue-inference"))
    assert inference["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert inference["image"].endswith("-cuda")
    assert parse_args(inference).device == "cuda"
    assert container(named(GPU, "Deployment", "zeroqueue-metering")) == container(
        named(BASE, "Deployment", "zeroqueue-metering")
    )


@pytest.mark.parametrize("docs", [BASE, GPU, MIGRATE], ids=["base", "gpu", "migrate"])
def test_container_args_parse_with_the_cli(docs: list[dict]) -> None:
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    assert workloads
    for workload in workloads:
        parse_args(container(workload))


@pytest.mark.parametrize("docs", [BASE, GPU], ids=["base", "gpu"])
def test_probes_ask_for_the_names_the_services_register(docs: list[dict]) -> None:
    inference = container(named(docs, "Deployment", "zeroqueue-inference"))
    port = parse_args(inference).port
    assert port == port_named(inference, "grpc")
    for probe, service in (
        ("startupProbe", INFERENCE_SERVICE),
        ("readinessProbe", INFERENCE_SERVICE),
        ("livenessProbe", LIVENESS),
    ):
        assert inference[probe]["grpc"] == {"port": port, "service": service}, probe
    metering = container(named(docs, "Deployment", "zeroqueue-metering"))
    port = parse_args(metering).port
    for probe, service in (
        ("startupProbe", METERING_SERVICE),
        ("readinessProbe", METERING_SERVICE),
        ("livenessProbe", LIVENESS),
    ):
        assert metering[probe]["grpc"] == {"port": port, "service": service}, probe


def test_liveness_gives_up_later_than_readiness() -> None:
    """Readiness takes a replica out of rotation at once; liveness restarts only a process that stopped answering."""
    inference = container(named(BASE, "Deployment", "zeroqueue-inference"))
    ready, live = inference["readinessProbe"], inference["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > ready["periodSeconds"] * ready["failureThreshold"]
    start = inference["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] > live["periodSeconds"] * live["failureThreshold"]


def default(function, parameter: str) -> float:
    return inspect.signature(function).parameters[parameter].default


@pytest.mark.parametrize("docs", [BASE, GPU], ids=["base", "gpu"])
def test_termination_grace_covers_the_drain(docs: list[dict]) -> None:
    deployment = named(docs, "Deployment", "zeroqueue-inference")
    args = parse_args(container(deployment))
    drain_s = drain_grace_s(args.default_deadline_ms)
    assert args.default_deadline_ms / 1000 <= drain_s, "a call admitted with the default deadline must fit the drain"
    needed_s = drain_s + default(MeteringLink.stop, "drain_s")
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed_s
    metering = named(docs, "Deployment", "zeroqueue-metering")
    assert metering["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > default(MeteringApp.stop, "grace_s")


def test_replicas_reach_the_metering_service() -> None:
    address = parse_args(container(named(BASE, "Deployment", "zeroqueue-inference"))).metering
    host, _, port = address.rpartition(":")
    service = named(BASE, "Service", host)
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    metering = container(named(BASE, "Deployment", "zeroqueue-metering"))
    assert parse_args(metering).port == port_named(metering, "grpc")


def test_services_select_one_workload_and_its_ports() -> None:
    for service in (d for d in BASE if d["kind"] == "Service"):
        selector = service["spec"]["selector"].items()
        pods = [
            d
            for d in BASE
            if d["kind"] == "Deployment"
            if selector <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(pods) == 1, service["metadata"]["name"]
        names = {p["name"] for p in container(pods[0])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    assert named(BASE, "Service", "zeroqueue-inference")["spec"]["clusterIP"] == "None", "headless"


def test_pods_run_as_the_images_user() -> None:
    user = [line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    uid = int(user[-1].split(":")[0])
    for workload in (d for d in BASE + MIGRATE if d["kind"] in WORKLOADS):
        security = workload["spec"]["template"]["spec"]["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] == uid


def test_secret_references_match_the_example() -> None:
    example = {(d["metadata"]["name"], key) for d in load(K8S / "secrets.example.yaml") for key in d["stringData"]}
    refs = {
        (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for d in BASE + MIGRATE
        if d["kind"] in WORKLOADS
        for e in container(d).get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == example
