"""docs/ARCHITECTURE.md's walk names exactly the files one Generate crosses (tests/tools/walk.py traces them)."""

from __future__ import annotations

import re

import pytest
import structlog

from services.logs import configure_logging
from tests.checkpoints import save_hf_checkpoint
from tests.tools.walk import ROOT, counted, walk

DOC = ROOT / "docs" / "ARCHITECTURE.md"
ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \|")
PIPE = (
    "services/inference/engine/client.py",
    "services/inference/engine/messages.py",
    "services/inference/engine/core.py",
)


def documented() -> list[str]:
    """The files the walk's table names, in its order."""
    text = DOC.read_text()
    section = text[text.index("## The walk") :]
    rows = [ROW.match(line) for line in section.splitlines()]
    files = [m.group(2) for m in rows if m]
    assert [int(m.group(1)) for m in rows if m] == list(range(1, len(files) + 1)), "the rows are numbered in order"
    return files


def test_the_documented_walk_counts_what_it_says():
    files = documented()
    assert len(set(files)) == len(files)
    text = DOC.read_text()
    assert f"**{len(files)} files** with the engine on a thread" in text
    assert f"`engine/core.py`: **{len(files) - 1 + len(PIPE)}**" in text
    for path in (*files, *PIPE):
        assert (ROOT / path).is_file(), path
        assert counted(str(ROOT / path)) == path  # each one is a file the walk would count


def test_the_walk_leaves_out_the_caller_and_the_model_arithmetic():
    assert counted(str(ROOT / "services/client/auth.py")) is None
    assert counted(str(ROOT / "services/inference/device/model.py")) is None
    assert counted(str(ROOT / "tests/tools/walk.py")) is None
    assert counted(str(ROOT / "services/inference/device/executor.py")) == "services/inference/device/executor.py"


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> list[str]:
    # logging as `zeroqueue serve` configures it (walk.main too): with structlog's defaults, which an earlier test
    # may have left, the call's log line would not pass through services/logs.py
    configure_logging()
    try:
        return walk(save_hf_checkpoint(tmp_path_factory.mktemp("walk"), "llama"))
    finally:
        structlog.reset_defaults()


def test_one_generate_crosses_exactly_the_documented_files(traced):
    missing = sorted(set(documented()) - set(traced))
    unlisted = sorted(set(traced) - set(documented()))
    assert (missing, unlisted) == ([], []), "update the walk in docs/ARCHITECTURE.md"
