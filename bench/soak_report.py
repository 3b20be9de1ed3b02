"""bench/soak.py's summary of a run: the JSON it writes, the goals it judges, the lines it prints."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from soak_book import Book
from soak_checks import rss_growth

from services.pulse.stats import LAG_WARNING_MS, percentiles

RSS_GROWTH_GOAL, HEALTH_P99_GOAL_MS = 0.05, 50.0


def notes_for(book: Book, capacity: dict | None) -> list[str]:
    """What makes a run's figures less than they seem."""
    notes = (
        [f"the generator sent calls up to {book.max_lag_ms:.0f} ms late: it offered less than claimed"]
        if book.max_lag_ms > LAG_WARNING_MS
        else []
    )
    knee = next((p for p in (capacity or {}).get("probes", ()) if p["qps"] == capacity["capacity_qps"]), None)
    if knee and knee["goodput_rps"] < 0.9 * knee["qps"]:  # pulse counts only OVERLOADED as refused
        notes.append(
            f"capacity suspect: its knee probe completed {knee['goodput_rps']:.1f} of {knee['qps']:.1f} "
            "req/s in deadline (the rest refused otherwise, e.g. DEADLINE_INFEASIBLE)"
        )
    return notes


def summarize(
    args,
    host: dict,
    qps: float,
    capacity: dict | None,
    book: Book,
    end: dict,
    server: dict,
    stopped: dict,
    ledger: dict,
) -> dict:
    tally: dict[str, dict[str, int]] = {}
    for (kind, code, reason), n in sorted(book.tally.items()):
        tally.setdefault(kind, {})[f"{code}/{reason}" if reason else code] = n
    duration_s = args.minutes * 60
    summary = {
        "host": host,
        "config": vars(args),
        "notes": notes_for(book, capacity),
        "rate_qps": round(qps, 3),
        "capacity_qps": (capacity or {}).get("capacity_qps"),
        "saturation_qps": (capacity or {}).get("saturation_qps"),
        "calls": sum(book.tally.values()),
        "tally": tally,
        "by_minute": {m: dict(c) for m, c in book.by_minute.items()},
        "client_latency_ms": asdict(percentiles(book.latency_ms)),
        "cpu_cores": book.cpu_cores,
        "generator_max_lag_ms": round(book.max_lag_ms, 1),
        "generator_loop_lag_ms": asdict(percentiles(book.loop_lag_ms)),
        "health_ms": asdict(percentiles(book.health_ms)),
        "health_failures": dict(book.health_failures),
        "health_slow": book.health_slow,
        "rss": {
            "server": rss_growth(book.rss, 1, duration_s),
            "engine": rss_growth(book.rss, 2, duration_s),
            "series": book.rss,
        },
        "infeasible_at_first_attempt": book.infeasible_first,
        "already_exists_not_in_flight": book.wrong_in_use,
        "end": end,
        "after_stop": stopped,
        "ledger": ledger,
        "bad_input_imprecise": book.num_imprecise,
        "bad_input_examples": book.imprecise,
        "bad_calls": book.bad_log,
        "server": server,
        "loadavg_end": os.getloadavg(),
    }
    summary["goals"] = judge(summary)
    summary["all_goals_met"] = all(summary["goals"].values())
    return summary


def judge(s: dict) -> dict[str, bool]:
    grew, end, box, ledger, p99 = (
        {p: s["rss"][p]["growth"] for p in ("server", "engine")},
        s["end"],
        s["after_stop"]["outbox"],
        s["ledger"],
        s["health_ms"]["p99"],
    )
    return {
        "server_rss_growth_lt_5pct": grew["server"] is not None and grew["server"] < RSS_GROWTH_GOAL,
        "engine_rss_growth_lt_5pct": grew["engine"] is not None and grew["engine"] < RSS_GROWTH_GOAL,
        "kv_slots_all_free": end.get("kv_slots_free") == end.get("max_batch") and end.get("in_flight") == 0,
        "kv_blocks_all_free": end.get("kv_blocks_used") == 0,
        "outbox_empty": box["pending"] == 0 and not box["dead"] and not box["conflicts"],
        "no_lost_or_unbilled": not any(
            ledger[k] for k in ("lost", "duplicated", "unseen_rows", "usage_mismatch", "tenant_mismatch")
        ),
        "bad_input_refused_precisely": s["bad_input_imprecise"] == 0,
        "no_infeasible_verdict_for_a_feasible_call": s["infeasible_at_first_attempt"] == 0,
        "request_ids_scoped_to_tenant": s["already_exists_not_in_flight"] == 0,
        "health_p99_lt_50ms": p99 is not None and p99 < HEALTH_P99_GOAL_MS and not s["health_failures"],
        "replica_stopped_cleanly": s["after_stop"]["returncode"] == 0,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_summary(s: dict, path: Path) -> None:
    h = s["host"]
    print(f"\nhost: {h['cpu']}, {h['cores']} cores, flags {h['flags']}; {h['date_utc']}")
    print(
        f"rate {s['rate_qps']} req/s (capacity {s['capacity_qps']}, saturation {s['saturation_qps']}); "
        f"{s['calls']} calls; generator max lag {s['generator_max_lag_ms']} ms; cores used {s['cpu_cores']}"
    )
    for note in s["notes"]:
        print(f"NOTE: {note}")
    for kind, codes in s["tally"].items():
        print(f"  {kind:<7} " + ", ".join(f"{c} {n}" for c, n in codes.items()))
    for proc in ("server", "engine"):
        r = s["rss"][proc]
        print(f"RSS {proc}: {r.get('start_kb')} -> {r.get('end_kb')} kB (max {r.get('max_kb')}), growth {r['growth']}")
    hm, lag = s["health_ms"], s["generator_loop_lag_ms"]
    print(
        f"health ms: p50 {_ms(hm['p50'])} p99 {_ms(hm['p99'])} max {_ms(hm['max'])} over {hm['count']}, "
        f"failures {s['health_failures']}; generator loop lag p99 {_ms(lag['p99'])} ms"
    )
    print(f"client latency ms (normal calls): {s['client_latency_ms']}")
    print(
        f"judged infeasible with the whole budget: {s['infeasible_at_first_attempt']}; ALREADY_EXISTS with no call "
        f"running: {s['already_exists_not_in_flight']}; codes by minute: {s['by_minute']}; load average "
        f"{[round(x, 2) for x in h['loadavg_start']]} -> {[round(x, 2) for x in s['loadavg_end']]}"
    )
    print(f"end: {s['end']}; after stop: {s['after_stop']}")
    print(f"ledger: { {k: v for k, v in s['ledger'].items() if k != 'examples'} }")
    print(f"bad input not refused precisely: {s['bad_input_imprecise']} {s['bad_input_examples'][:3]}")
    print(f"replica e2e ms: {s['server']['e2e']}; deadline misses {s['server']['deadline_misses']}")
    print("goals: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in s["goals"].items()))
    print(f"wrote {path}")
