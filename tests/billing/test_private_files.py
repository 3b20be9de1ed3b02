"""The data directory is 0700 and the ledger, the outbox and key files 0600, from the moment they exist."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

import migrations
from billing import private_files
from billing.db import make_engine
from services.metering.outbox import Outbox


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(autouse=True)
def loose_umask() -> Iterator[None]:
    """The usual umask, under which a plain open() makes 0644 files and mkdir() 0755 directories."""
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every os.open of billing.private_files, with the mode the file had right after it."""
    calls, real_open = [], os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):  # type: ignore[no-untyped-def]
        descriptor = real_open(path, flags, mode, *args, **kwargs)
        calls.append((str(path), flags, stat.S_IMODE(os.fstat(descriptor).st_mode)))
        return descriptor

    monkeypatch.setattr(private_files.os, "open", spy)
    return calls


def test_a_sqlite_ledger_and_its_wal_are_private_from_creation(tmp_path: Path, opened: list) -> None:
    path = tmp_path / "home" / "ledger.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE t (x INTEGER)"))
            connection.execute(text("INSERT INTO t VALUES (1)"))
            assert {p.name: mode(p) for p in path.parent.iterdir()} == {
                "ledger.db": 0o600,
                "ledger.db-wal": 0o600,
                "ledger.db-shm": 0o600,
            }
    finally:
        engine.dispose()
    assert mode(path.parent) == 0o700
    assert [(name, created_mode) for name, flags, created_mode in opened if flags & os.O_CREAT] == [
        (str(path), 0o600)
    ]  # never a moment at the umask's 0644


def test_a_migrated_ledger_is_private(tmp_path: Path) -> None:
    migrations.upgrade(f"sqlite:///{tmp_path / 'data' / 'ledger.db'}")
    assert mode(tmp_path / "data") == 0o700
    assert {p.name: mode(p) for p in (tmp_path / "data").iterdir()} == {"ledger.db": 0o600}


def test_the_outbox_is_private_and_the_default_data_directory_an_older_version_left_open_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / ".zeroqueue"  # ~/.zeroqueue, made 0755 by an older version
    home.mkdir(mode=0o755)
    (home / "outbox.db").touch(mode=0o644)
    outbox = Outbox(home / "outbox.db")
    try:
        outbox.flush()
        assert mode(home) == 0o700
        assert {p.name: mode(p) for p in home.iterdir()} == {
            "outbox.db": 0o600,
            "outbox.db-wal": 0o600,
            "outbox.db-shm": 0o600,
        }
    finally:
        outbox.close()


def test_a_new_data_directory_and_outbox_are_private_from_creation(tmp_path: Path, opened: list) -> None:
    outbox = Outbox(tmp_path / "chosen" / "outbox.db")
    try:
        outbox.flush()
    finally:
        outbox.close()
    assert mode(tmp_path / "chosen") == 0o700 and mode(tmp_path / "chosen" / "outbox.db") == 0o600
    assert [(name, created) for name, flags, created in opened if flags & os.O_CREAT] == [
        (str(tmp_path / "chosen" / "outbox.db"), 0o600)
    ]


def test_an_existing_ledger_directory_is_left_alone_but_its_files_are_narrowed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    (shared / "ledger.db").touch(mode=0o644)
    (shared / "ledger.db-wal").touch(mode=0o644)
    make_engine(f"sqlite:///{shared / 'ledger.db'}").dispose()
    assert mode(shared) == 0o755  # not ours to close (someone chose it, maybe shared); a warning says so
    assert mode(shared / "ledger.db") == mode(shared / "ledger.db-wal") == 0o600


def test_the_demo_key_file_is_private_from_creation(tmp_path: Path, opened: list) -> None:
    from services.cli_serve import ensure_demo_tenant

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    migrations.upgrade(url)
    ensure_demo_tenant(url, "demo", str(tmp_path / "home"))
    key_file = tmp_path / "home" / "demo.key"
    assert mode(tmp_path / "home") == 0o700 and mode(key_file) == 0o600
    assert key_file.read_text().startswith("zq_")
    assert [
        (name, created_mode) for name, flags, created_mode in opened if flags & os.O_CREAT and name.endswith(".key")
    ] == [(str(key_file), 0o600)]


def test_write_private_narrows_a_file_before_writing_a_secret_into_it(tmp_path: Path) -> None:
    path = tmp_path / "old.key"
    path.write_text("stale\n")
    path.chmod(0o644)
    private_files.write_private(path, "zq_secret\n")
    assert mode(path) == 0o600 and path.read_text() == "zq_secret\n"
