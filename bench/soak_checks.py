"""bench/soak.py's readings of the host, the replica's processes, its outbox and its ledger (no load here)."""

from __future__ import annotations

import os
import sqlite3
import statistics
import time
from collections import Counter
from pathlib import Path

from sqlalchemy import create_engine, text

from billing import commands
from services.pulse.scrape import delta, histogram_ms, server_view  # e2e and TTFT, read like the rest


def host_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), []))
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return {
        "cpu": model,
        "flags": {f: f in flags for f in wanted},
        "cores": cpuinfo.count("processor\t:"),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg_start": os.getloadavg(),
    }


def engine_children(pid: int) -> list[int]:
    """tests/inference/test_usage.py's engine_children, not imported: importing that module loads torch and pytest
    into the load generator (340 MB, 9 s of CPU on this host). A child belongs to the thread that started it."""
    tasks = Path(f"/proc/{pid}/task")
    children = [c for task in tasks.iterdir() for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def rss_kb(pid: int | None) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, TypeError, ProcessLookupError):
        return None
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)


def cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (/proc/PID/stat utime, stime)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, TypeError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def outbox_counts(data_dir: Path) -> dict[str, int]:
    """Outbox.counts()'s figures, read with a plain connection: opening an Outbox would start its writer."""
    with sqlite3.connect(data_dir / "outbox.db", timeout=10) as conn:
        pending, delivered, dead = conn.execute(
            "SELECT COUNT(*) FILTER (WHERE delivered_at_us IS NULL AND dead_at_us IS NULL), "
            "COUNT(delivered_at_us), COUNT(dead_at_us) FROM outbox"
        ).fetchone()
        (conflicts,) = conn.execute("SELECT COUNT(*) FROM outbox_conflicts").fetchone()
    return {"pending": pending, "delivered": delivered, "dead": dead, "conflicts": conflicts}


def ledger_rows(url: str, sql: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(sql)).fetchall()
    finally:
        engine.dispose()


def check_ledger(url: str, admitted: dict[str, tuple[int, int | None]], tenant_ids: list[int]) -> dict:
    """Every call seen admitted has exactly one row, with its Final's usage, under its tenant; no row of a soak
    tenant that the client did not see admitted."""
    rows = ledger_rows(
        url,
        "SELECT call_id, COUNT(*), MIN(tenant_id), SUM(unit_us), MIN(outcome) FROM "
        f"usage_records WHERE tenant_id IN ({','.join(map(str, tenant_ids))}) GROUP BY call_id",
    )
    stored = {r[0]: r[1:] for r in rows}
    lost = [cid for cid in admitted if cid not in stored]
    duplicated = [cid for cid, (count, *_) in stored.items() if count != 1]
    unseen = [{"call_id": cid, "outcome": row[3]} for cid, row in stored.items() if cid not in admitted]
    wrong_usage = [
        cid for cid, (_, sm_us) in admitted.items() if sm_us is not None and cid in stored and stored[cid][2] != sm_us
    ]
    wrong_tenant = [
        cid for cid, (tenant, _) in admitted.items() if cid in stored and stored[cid][1] != tenant_ids[tenant]
    ]
    return {
        "seen_admitted": len(admitted),
        "rows": len(stored),
        "lost": len(lost),
        "duplicated": len(duplicated),
        "unseen_rows": len(unseen),
        "usage_mismatch": len(wrong_usage),
        "tenant_mismatch": len(wrong_tenant),
        "rows_by_outcome": dict(Counter(row[3] for row in stored.values())),
        "examples": {"lost": lost[:10], "unseen": unseen[:10], "usage_mismatch": wrong_usage[:10]},
    }


def rss_growth(series: list, column: int, duration_s: float, warmup_share: float = 0.10) -> dict:
    """Median of the last tenth of the samples after warm-up against the median of the first tenth (one sample
    is noise: the allocator breathes)."""
    kept = [s[column] for s in series if s[0] >= warmup_share * duration_s and s[column] is not None]
    if len(kept) < 2:
        return {"samples": len(kept), "growth": None}
    n = max(1, len(kept) // 10)
    start, end = statistics.median(kept[:n]), statistics.median(kept[-n:])
    return {
        "samples": len(kept),
        "start_kb": start,
        "end_kb": end,
        "max_kb": max(kept),
        "growth": round((end - start) / start, 4),
    }


def make_tenants(url: str, count: int, stamp: str) -> tuple[list[str], list[int]]:
    names = [f"soak-{stamp}-{i}" for i in range(count)]
    keys = [commands.create_tenant(url, name) for name in names]
    ids = dict(ledger_rows(url, "SELECT name, id FROM tenants"))
    return keys, [ids[name] for name in names]


def server_figures(before: dict, after: dict) -> dict:
    d = delta(after, before)
    return {
        **server_view(before, after),
        "e2e": histogram_ms(d, "zeroqueue_e2e_seconds"),
        "ttft": histogram_ms(d, "zeroqueue_ttft_seconds"),
    }
