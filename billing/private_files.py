"""Files only their owner may read: the data directory (0700), the ledger and outbox databases and API key
files (0600), private from the moment they exist.

A file is created by ``os.open(..., 0o600)`` (the umask can only take bits away), never created with the
umask's mode and narrowed afterwards: between the two a reader could open it and keep the descriptor.  A
SQLite database is created here before SQLite opens it, because SQLite gives its ``-wal`` and ``-shm``
companions the mode of the database file.  A file or directory that an older version made readable to others
is narrowed when it is next opened (only if it is ours; a warning says so). A directory that already exists
is narrowed only when the caller knows it is zeroqueue's own (the default ~/.zeroqueue, which older versions
made 0755): any other (a $ZEROQUEUE_HOME or --data-dir someone chose, maybe shared, maybe /tmp) is left as it
is, with a warning if others may list it; the files in it are private anyway.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)
DIR_MODE = 0o700
FILE_MODE = 0o600
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def private_dir(path: Path, *, narrow_existing: bool = False) -> Path:
    """``path`` as a directory, created 0700 (missing parents get the usual mode). An existing one that
    others may enter is narrowed to 0700 if ``narrow_existing`` (and it is ours), else only warned about."""
    try:
        path.mkdir(mode=DIR_MODE, parents=True)
    except FileExistsError:
        if narrow_existing:
            _narrow(path, DIR_MODE)
        elif stat.S_IMODE(path.stat().st_mode) & 0o077:
            log.warning(
                "directory_open_to_others",
                path=str(path),
                mode=oct(stat.S_IMODE(path.stat().st_mode)),
                hint="the ledger and outbox files in it are 0600; chmod 700 it to hide their names too",
            )
    return path


def private_file(path: Path) -> Path:
    """``path`` exists as a file only its owner can read and write: created 0600, or narrowed to it."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE))
    except FileExistsError:
        _narrow(path, FILE_MODE)
    return path


def private_sqlite(path: Path, *, narrow_dir: bool = False) -> Path:
    """A SQLite database file (and any -wal, -shm or -journal beside it) created or narrowed to 0600, before
    SQLite opens it; its directory is created 0700 when missing (and narrowed if ``narrow_dir``)."""
    private_dir(path.parent, narrow_existing=narrow_dir)
    private_file(path)
    for suffix in SQLITE_COMPANIONS:
        companion = path.with_name(path.name + suffix)
        if companion.exists():
            _narrow(companion, FILE_MODE)
    return path


def write_private(path: Path, text: str) -> Path:
    """Writes ``text`` to ``path``, which is 0600 from its creation (an existing file is narrowed first)."""
    private_file(path)
    descriptor = os.open(path, os.O_WRONLY | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path


def _narrow(path: Path, mode: int) -> None:
    info = path.stat()
    if stat.S_IMODE(info.st_mode) & ~mode and info.st_uid == os.getuid():
        os.chmod(path, stat.S_IMODE(info.st_mode) & mode)
        log.warning("permissions_narrowed", path=str(path), mode=oct(stat.S_IMODE(info.st_mode) & mode))
