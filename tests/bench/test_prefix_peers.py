"""bench/prefix_peers.py's pure parts: every call is the shared prefix and then tokens of its own (so nothing past
the prefix can be served from a cache), a stream folds into the body a whole reply has, and the table's goal is
zeroqueue's goodput over the best peer's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.pulse.stats import RequestTrace, TraceOutcome

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.setdefault(name, module)
    return module


@pytest.fixture(scope="module")
def peers():
    return load("prefix_peers")


def test_calls_share_exactly_the_prefix_and_differ_right_after_it(peers):
    prefix = tuple(range(100, 164))
    args = SimpleNamespace(
        fresh_tokens=32,
        max_tokens=32,
        prefix_tokens=len(prefix),
        seed=3,
        vocab=49152,
        deadline_ms=2000.0,
        prefix=prefix,
    )
    first_run = peers.schedule(args, 20.0, 10.0, 1)
    calls = first_run + peers.schedule(args, 20.0, 10.0, 2)
    assert len(calls) > 100
    for call in calls:
        assert call.prompt_token_ids[: len(prefix)] == prefix
        assert len(call.prompt_token_ids) == len(prefix) + 32
        assert call.max_tokens == 32 and call.deadline_ms == 2000.0
    # the first token past the prefix already differs between any two calls, across runs too
    firsts = [call.prompt_token_ids[len(prefix)] for call in calls]
    assert len(set(firsts)) == len(calls)
    # the same run is the same calls: every engine gets the same schedule
    assert peers.schedule(args, 20.0, 10.0, 1) == first_run


def test_stamp_spells_the_serial_in_two_tokens_inside_the_vocabulary(peers):
    vocab = 100
    stamps = [peers.stamp(serial, vocab) for serial in range(84 * 84)]
    assert len(set(stamps)) == len(stamps)
    assert all(peers.FIRST_ID <= token < vocab for pair in stamps for token in pair)
    with pytest.raises(ValueError):
        peers.stamp(84 * 84, vocab)


def test_a_stream_folds_into_the_body_of_a_whole_reply():
    sse = load("sse_client")
    events = [
        {"choices": [{"index": 0, "text": "", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
    ]
    usage = {"prompt_tokens": 1056, "completion_tokens": 32, "prompt_tokens_details": {"cached_tokens": 1024}}
    usage["device_time"] = {"unit": "core_us", "amount": 420}
    lines = [f"data: {json.dumps(e)}" for e in events] + ["", f"data: {json.dumps({'choices': [], 'usage': usage})}"]
    body, chunks = sse.fold_events([*lines, "data: [DONE]"], 1056)
    assert chunks == 2
    assert body["choices"][0] == {"index": 0, "text": "abc", "finish_reason": "length"}
    assert body["usage"] == usage
    assert [sse.carries_text(line) for line in lines] == [False, True, True, False, False]
    assert not sse.carries_text("data: [DONE]")
    # no usage in the stream (llama.cpp's timings instead): counted from what it shows
    llama = [f"data: {json.dumps({**events[1], 'timings': {'cache_n': 1024, 'prompt_n': 32}})}", "data: [DONE]"]
    body, _ = sse.fold_events(llama, 1056)
    assert body["usage"] == {
        "prompt_tokens": 1056,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 1024},
    }


def trace(index, outcome, sent_s=0.0, first=None, device_us=None, cause="", error=""):
    t = RequestTrace(index, 0.0, 2000.0, 1056, 32, sent_s=sent_s, outcome=outcome, first_token_s=first)
    t.device_us, t.refusal_cause, t.error = device_us, cause, error
    return t


def test_extra_fields_count_ttft_device_time_cache_hits_and_refusals(peers):
    ok = TraceOutcome.OK
    traces = [
        trace(0, ok, 1.0, 1.1, 400_000),
        trace(1, ok, 2.0, 2.3, 200_000),
        trace(2, TraceOutcome.REJECTED, cause="slots"),
        trace(3, TraceOutcome.INFEASIBLE, error="DEADLINE_EXCEEDED/DEADLINE_INFEASIBLE"),
        trace(4, TraceOutcome.DEADLINE_EXCEEDED),
    ]
    fields = peers.extra_fields(traces, {"p-0": 1024, "p-1": 0}, "p")
    assert fields["ttft_p50_ms"] == pytest.approx(100.0) and fields["ttft_p99_ms"] == pytest.approx(300.0)
    assert fields["device_ms_per_call"] == pytest.approx(300.0)
    assert fields["cached_tokens_per_call"] == 512
    assert fields["refused"] == 2
    assert fields["refused_by_cause"] == {"slots": 1, "DEADLINE_INFEASIBLE": 1}


def row(engine, load, goodput, **more):
    base = dict(engine=engine, load=load, qps=load * 2, goodput_rps=goodput, sent=60, in_deadline=int(goodput * 30))
    base |= dict(refused=0, rejection_rate=0.0, refused_by_cause={}, timed_out=0, completed_late=0)
    base |= dict(ttft_p50_ms=100.0, ttft_p99_ms=150.0, latency_p50_ms=700.0, latency_p99_ms=1100.0)
    base |= dict(device_ms_per_call=None, cached_tokens_per_call=None, mean_completion_tokens=32.0)
    return base | more


def test_goal_is_zeroqueues_goodput_at_2x_over_the_best_peer():
    t = load("prefix_table")
    rows = [row("zq-cache", 2.0, 3.0), row("vllm", 2.0, 1.5), row("llamacpp", 2.0, 1.8), row("vllm", 1.0, 2.5)]
    g = t.goal(rows)
    assert g["best_peer"] == "llamacpp" and g["best_peer_goodput"] == 1.8
    assert g["ratio"] == pytest.approx(3.0 / 1.8) and g["met"]
    assert not t.goal([row("zq-cache", 2.0, 2.0), row("vllm", 2.0, 1.5)])["met"]  # 1.33× < 1.5×
    assert t.goal([row("zq-cache", 2.0, 2.0)]) is None  # no peer ran


def test_table_lists_loads_then_engines_in_run_order():
    t = load("prefix_table")
    refused = dict(refused=3, rejection_rate=0.25, refused_by_cause={"slots": 3})
    rows = [row("vllm", 2.0, 1.5), row("zq-cache", 2.0, 3.0, **refused), row("zq-nocache", 1.0, 0.0)]
    rows.append(row("zq-cache", 1.0, 2.0, device_ms_per_call=420.06, cached_tokens_per_call=1024.0))
    md = t.table(rows, 2.0, t.goal(rows))
    lines = [line for line in md.splitlines() if line.startswith("| 1×") or line.startswith("| 2×")]
    assert [line.split(" | ")[1] for line in lines] == [
        t.LABELS["zq-cache"],
        t.LABELS["zq-nocache"],
        t.LABELS["zq-cache"],
        t.LABELS["vllm"],
    ]
    assert "| 420.1 | 1024 |" in lines[0]
    assert "| 25.0 % / 3 (slots 3) |" in lines[2]
    assert "2.00× (target ≥ 1.5×, met)" in md


def test_warm_up_records_read_zeroqueues_usage_and_llama_cpps_timings(peers):
    zq = {"usage": {"completion_tokens": 32, "device_time": {"unit": "core_us", "amount": 2_400_000}}}
    zq["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
    assert peers.warm_record(zq, 1.5) == {
        "latency_ms": 1500.0,
        "device_ms": 2400.0,
        "cached_tokens": 0,
        "completion_tokens": 32,
    }
    llama = {"usage": {"completion_tokens": 32}, "timings": {"cache_n": 1024}}
    assert peers.warm_record(llama, 0.25)["cached_tokens"] == 1024
    assert peers.warm_record(llama, 0.25)["device_ms"] is None
    t = load("prefix_table")
    md = t.warm_table({"vllm": [peers.warm_record(llama, 0.25)], "zq-cache": [peers.warm_record(zq, 1.5)]})
    lines = md.splitlines()[-2:]
    assert lines == [f"| {t.LABELS['zq-cache']} | 1500 / 2400.0 / 0 |", f"| {t.LABELS['vllm']} | 250 / — / 1024 |"]
