"""bench/prefix_peers.py's arithmetic on finished rows: the markdown table and the goal (zeroqueue's goodput under
the deadline at 2x >= 1.5x the best peer's). Pure: rows are the dicts prefix_peers.py writes to results.json."""

from __future__ import annotations

ENGINES = ("zq-cache", "zq-nocache", "vllm", "llamacpp")  # the order they run in, and rows are listed in
LABELS = {
    "zq-cache": "zeroqueue, prefix cache on",
    "zq-nocache": "zeroqueue, --no-prefix-cache",
    "vllm": "vLLM CPU, prefix caching",
    "llamacpp": "llama.cpp server, cache_prompt",
}
PEERS = ("vllm", "llamacpp")


def goal(rows: list[dict], load: float = 2.0, factor: float = 1.5) -> dict | None:
    """zeroqueue's (cache on) goodput at `load` over the best peer's there; None without both sides."""
    at = {r["engine"]: r["goodput_rps"] for r in rows if r["load"] == load}
    peers = {e: at[e] for e in PEERS if e in at}
    if "zq-cache" not in at or not peers:
        return None
    best = max(peers, key=peers.get)
    ratio = at["zq-cache"] / peers[best] if peers[best] else None
    return {
        "load": load,
        "zeroqueue_goodput": at["zq-cache"],
        "best_peer": best,
        "best_peer_goodput": peers[best],
        "ratio": ratio,
        "target": factor,
        "met": ratio is None or ratio >= factor,  # None: every peer's goodput was 0
    }


def _num(value, fmt: str = "{:.0f}") -> str:
    return "—" if value is None else fmt.format(value)


def _refused(row: dict) -> str:
    if not row["refused"] and not row["rejection_rate"]:
        return "0"
    causes = ", ".join(f"{cause} {n}" for cause, n in sorted(row["refused_by_cause"].items()))
    first = _num(row["rejection_rate"] and row["rejection_rate"] * 100, "{:.1f} %")
    return f"{first} / {row['refused']}" + (f" ({causes})" if causes else "")


def table(rows: list[dict], knee: float | None, result_goal: dict | None = None) -> str:
    """One line per load and engine, loads ascending, engines in ENGINES order; then the goal, if measured."""
    out = [
        f"Capacity (1×): {_num(knee, '{:g}')} calls/s, zeroqueue's knee with the cache on.",
        "",
        "| load | engine | sent | in deadline | goodput, calls/s | 429 at first attempt / never admitted (why) "
        "| timed out / late | TTFT P50 / P99, ms | latency P50 / P99, ms | device time per call, core·ms "
        "| cached prompt tokens per call | output tokens per call |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {e: i for i, e in enumerate(ENGINES)}
    for r in sorted(rows, key=lambda r: (r["load"], order.get(r["engine"], len(order)))):
        out.append(
            f"| {r['load']:g}× ({r['qps']:.2f}/s) | {LABELS.get(r['engine'], r['engine'])} | {r['sent']:,} "
            f"| {r['in_deadline']:,} | {r['goodput_rps']:.2f} | {_refused(r)} "
            f"| {r['timed_out']} / {r['completed_late']} | {_num(r['ttft_p50_ms'])} / {_num(r['ttft_p99_ms'])} "
            f"| {_num(r['latency_p50_ms'])} / {_num(r['latency_p99_ms'])} | {_num(r['device_ms_per_call'], '{:.1f}')} "
            f"| {_num(r['cached_tokens_per_call'])} | {_num(r['mean_completion_tokens'], '{:.1f}')} |"
        )
    if result_goal:
        g = result_goal
        out += [
            "",
            f"Goal at {g['load']:g}×: zeroqueue {g['zeroqueue_goodput']:.2f} calls/s in deadline vs the best peer "
            f"({LABELS[g['best_peer']]}) {g['best_peer_goodput']:.2f}: {_num(g['ratio'], '{:.2f}')}× "
            f"(target ≥ {g['target']:g}×, {'met' if g['met'] else 'not met'}).",
        ]
    return "\n".join(out)


def warm_table(warm: dict[str, list[dict]]) -> str:
    """The warm-up calls, one engine a line: each sequential call's latency, device time and cached prompt tokens
    on an idle server (the first computes the prefix; with the cache on, the others hit it)."""
    out = [
        "Warm-up calls, sequential on an idle server (latency ms / device core·ms / cached prompt tokens, each call):",
        "",
        "| engine | calls |",
        "|---|---|",
    ]
    order = {e: i for i, e in enumerate(ENGINES)}
    for engine in sorted(warm, key=lambda e: order.get(e, len(order))):
        calls = "; ".join(
            f"{_num(c['latency_ms'])} / {_num(c['device_ms'], '{:.1f}')} / {_num(c['cached_tokens'])}"
            for c in warm[engine]
        )
        out.append(f"| {LABELS.get(engine, engine)} | {calls} |")
    return "\n".join(out)
