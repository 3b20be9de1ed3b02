"""bench/http_door.py's arithmetic and tables: its rounds summed up per door (medians, ranges, each HTTP row against
the gRPC call that asks the same), a refusal histogram's delta read as histogram_quantile reads it, and the report
on stdout."""

from __future__ import annotations

import statistics

from services.pulse.scrape import quantile_upper_bound
from services.pulse.stats import percentile

DOORS = ("grpc", "http", "grpc-chat", "http-chat-sse")
PAIRS = {"http": "grpc", "http-chat-sse": "grpc-chat"}  # each HTTP row against the gRPC call that asks the same
REFUSAL_HISTOGRAM = {"grpc": "zeroqueue_refusal_reply_seconds", "http": "zeroqueue_http_refusal_reply_seconds"}


def histogram(samples, name: str) -> dict:
    """A histogram delta's count, interpolated P50/P99 (as histogram_quantile), the bucket bounds holding them, and the
    share of observations at most 2 ms."""
    buckets = sorted((float(dict(labels)["le"]), v) for (n, labels), v in samples.items() if n == f"{name}_bucket")
    total = buckets[-1][1] if buckets else 0.0

    def interpolated(q: float) -> float | None:
        if not total:
            return None
        rank, prev_le, prev = q * total, 0.0, 0.0
        for le, cum in buckets:
            if cum >= rank:
                return (prev_le + (le - prev_le) * (rank - prev) / max(cum - prev, 1e-9)) * 1000
            prev_le, prev = le, cum
        return None

    at_2ms = next((cum for le, cum in buckets if le >= 0.002 - 1e-12), 0.0)
    return {
        "count": int(total),
        "p50_ms": interpolated(0.5),
        "p99_ms": interpolated(0.99),
        "p50_bucket_le_ms": (quantile_upper_bound(buckets, 0.5) or 0) * 1000,
        "p99_bucket_le_ms": (quantile_upper_bound(buckets, 0.99) or 0) * 1000,
        "share_le_2ms": at_2ms / total if total else None,
        "buckets": buckets,
    }


_RANGED = ("tree_us_per_call", "server_us_per_call")


def summarize_cpu(rounds: list[dict]) -> dict:
    keys = ("tree_us_per_call", "server_us_per_call", "engine_us_per_call", "device_us_per_call")
    keys += ("client_p50_ms", "wall_s")
    out = {}
    for door in DOORS:
        mine = [r for r in rounds if r.get("door") == door]
        out[door] = {k: round(statistics.median(r[k] for r in mine), 2) for k in keys} | {"rounds": len(mine)}
        out[door] |= {f"{k}_range": (min(r[k] for r in mine), max(r[k] for r in mine)) for k in _RANGED}
    for door, pair in PAIRS.items():
        for k in ("tree_us_per_call", "server_us_per_call"):
            g, h = out[pair][k], out[door][k]
            out[door][f"{k}_minus_grpc"] = round(h - g, 1)
            out[door][f"{k}_vs_grpc_pct"] = round((h / g - 1) * 100, 1)
    return out


def summarize_refusals(rounds: list[dict]) -> dict:
    out = {}
    for door, name in REFUSAL_HISTOGRAM.items():
        mine = [r for r in rounds if r["door"] == door]
        server: dict = {}
        for r in mine:
            for key, value in r["server"].items():
                server[key] = server.get(key, 0.0) + value
        client = [ms for r in mine for ms in r["client_ms"]]
        out[door] = {
            "refused": len(client),
            "admitted": sum(r["admitted"] for r in mine),
            "server": histogram(server, name),
            "client_p50_ms": round(percentile(client, 50), 3) if client else None,
            "client_p99_ms": round(percentile(client, 99), 3) if client else None,
        }
    return out


def fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def print_tables(cpu: dict, refusals: dict) -> None:
    print(
        "| door | replica tree µs/call (range) | server process µs/call (range) | engine process µs/call "
        "| billed device µs/call | Δ tree vs gRPC pair | Δ server process vs gRPC pair | client P50 ms | round s |"
    )
    print("|---|" + "---:|" * 8)
    for door, s in cpu.items():
        deltas = [
            f"{s[f'{k}_minus_grpc']:+.0f} µs ({s[f'{k}_vs_grpc_pct']:+.1f} %)" if door in PAIRS else "–"
            for k in ("tree_us_per_call", "server_us_per_call")
        ]
        tree, server = (f"{s[k]:.0f} ({s[k + '_range'][0]:.0f}–{s[k + '_range'][1]:.0f})" for k in _RANGED)
        print(
            f"| {door} | {tree} | {server} | {s['engine_us_per_call']:.0f} | {s['device_us_per_call']:.0f} "
            f"| {' | '.join(deltas)} | {s['client_p50_ms']:.2f} | {s['wall_s']:.2f} |"
        )
    print(
        "\n| door | refused / admitted | server histogram count | server P50 / P99 ms (interpolated) "
        "| bucket holding P50 / P99 (≤ ms) | share ≤ 2 ms | client P50 / P99 ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for door, s in refusals.items():
        h = s["server"]
        print(
            f"| {door} | {s['refused']} / {s['admitted']} | {h['count']} | {fmt(h['p50_ms'], '.3f')} / "
            f"{fmt(h['p99_ms'], '.3f')} | {fmt(h['p50_bucket_le_ms'], '.2f')} / {fmt(h['p99_bucket_le_ms'], '.2f')} "
            f"| {fmt(h['share_le_2ms'] and h['share_le_2ms'] * 100, '.2f')} % "
            f"| {fmt(s['client_p50_ms'])} / {fmt(s['client_p99_ms'])} |"
        )
