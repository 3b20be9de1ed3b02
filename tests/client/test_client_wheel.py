"""The client distribution on its own: `make client-wheel`'s build of services/client/distribution, installed
into an empty venv (no system site-packages), imports as `zeroqueue.client` without torch or the server's
`services` and makes real calls against a fake replica: a refusal retried on its hint, and a chat call with a JSON
Schema and logprobs.

Offline: the wheel's dependencies (grpcio, protobuf, googleapis-common-protos and theirs) are linked into the
new venv from this one's installed copies, file by file from their RECORDs, and pip installs the wheel with
--no-index, so it must find every requirement already met."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import services.client
from tests.client.fakes import FakeReplicas, Reject, Serve

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = ROOT / "services/client/distribution"
BUILD_DIR = ROOT / "build/zeroqueue-client"  # setup.cfg's build_base

CALL = """
import importlib.util, json, sys
from zeroqueue.client import Client, IncompleteOutput, Message, Rejected
from zeroqueue.inference.v1 import inference_pb2, inference_pb2_grpc
from zeroqueue.metering.v1 import metering_pb2, metering_pb2_grpc

with Client([sys.argv[1]], api_key="k") as client:
    (model,) = client.list_models()
    result = client.complete([5, 6, 7], deadline_ms=5_000, max_tokens=2)
    chat = client.complete(
        messages=[Message("system", "be brief"), {"role": "user", "content": "hi"}],
        response_format={"type": "json_schema", "schema": {"type": "object"}},
        logprobs=True,
        top_logprobs=1,
        deadline_ms=5_000,
        max_tokens=2,
    )
try:
    chat.json()
    cut_short = False
except IncompleteOutput:
    cut_short = True
print(json.dumps({
    "sdk": Client.__module__,
    "model": model.name,
    "text": result.text,
    "attempts": result.report.num_attempts,
    "rejections": result.report.num_rejections,
    "chat_logprobs": [[lp.token_id, lp.logprob, [t.token_id for t in lp.top]] for lp in chat.logprobs],
    "compile_us": chat.admission.compile_us,
    "cut_short": cut_short,
    "torch_loaded": "torch" in sys.modules,
    "torch_findable": importlib.util.find_spec("torch") is not None,
    "services_findable": importlib.util.find_spec("services") is not None,
    "billing_findable": importlib.util.find_spec("billing") is not None,
}))
"""


def build_wheel(out_dir: Path) -> Path:
    shutil.rmtree(BUILD_DIR, ignore_errors=True)  # setuptools would ship a module deleted since the last build
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                out_dir,
                DISTRIBUTION,
            ],
            check=True,
            cwd=ROOT,
        )
    finally:
        shutil.rmtree(BUILD_DIR, ignore_errors=True)
    (wheel,) = out_dir.glob("zeroqueue_client-*.whl")
    return wheel


def requirement_closure(wheel: Path) -> set[str]:
    """The installed distributions the wheel needs, its requirements' requirements included."""
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(metadata).decode()
    pending = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    seen: set[str] = set()
    while pending:
        req = Requirement(pending.pop())
        name = canonicalize_name(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        pending += importlib.metadata.distribution(name).requires or []
    return seen


def link_installed(names: set[str], site_packages: Path) -> None:
    """Each distribution's files (its RECORD), symlinked into `site_packages`: only these, nothing beside."""
    for name in names:
        dist = importlib.metadata.distribution(name)
        for file in dist.files or []:
            source = Path(dist.locate_file(file)).resolve()
            target = site_packages / file
            if ".." in file.parts or not source.is_file() or target.exists():
                continue  # scripts installed outside site-packages; files pip recorded but removed
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(source)


def test_the_client_wheel_installs_and_calls_without_the_server(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    sdk_modules = {p.name for p in Path(services.client.__file__).parent.glob("*.py")}
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if ".dist-info/" not in n]
    assert {n.split("/", 1)[0] for n in names} == {"zeroqueue"}  # no generic top-level name
    assert {n.split("/")[-1] for n in names if n.startswith("zeroqueue/client/")} == sdk_modules
    assert {"zeroqueue/inference/v1/inference_pb2_grpc.py", "zeroqueue/metering/v1/metering_pb2_grpc.py"} <= set(names)
    needs = requirement_closure(wheel)
    assert {"grpcio", "protobuf", "googleapis-common-protos"} <= needs and "torch" not in needs

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin/python"
    site_packages = Path(
        subprocess.run(
            [python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    assert site_packages != Path(sysconfig.get_path("purelib"))
    link_installed(needs, site_packages)
    pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", "-q"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env["PIP_CONFIG_FILE"] = os.devnull  # no index, no find-links: the requirements must already be met
    subprocess.run([*pip, "install", "--no-index", wheel], check=True, env=env)
    subprocess.run([*pip, "check"], check=True, env=env)

    with FakeReplicas([[Reject(20), Serve(num_chunks=2)]]) as fakes:
        done = subprocess.run(
            [python, "-I", "-c", CALL, fakes.addresses[0]],
            capture_output=True,
            text=True,
            cwd=tmp_path,  # -I keeps the checkout off sys.path; so does running from elsewhere
            env=env,
            timeout=60,
        )
        calls = fakes[0].calls
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "sdk": "zeroqueue.client.client",
        "model": "fake",
        "text": "t0t1",
        "attempts": 2,
        "rejections": 1,
        "chat_logprobs": [[10, -0.5, [100]], [11, -1.5, [100]]],
        "compile_us": 1500,
        "cut_short": True,  # the fake ends with finish_reason length
        "torch_loaded": False,
        "torch_findable": False,
        "services_findable": False,
        "billing_findable": False,
    }
    assert [c.retry_attempt for c in calls] == [None, "1", None]
    assert [m.role for m in calls[2].request.messages] == [1, 2] and calls[2].request.response_format.json_schema
    assert all(c.metadata["authorization"] == "Bearer k" for c in calls)
