"""`zeroqueue pulse --tenant`: the tenants' CLI, each tenant's figures worked out by hand on synthetic traces and
scrapes, the table, and a run end to end against a fake replica that tells the tenants apart by their keys."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import grpc
import pytest
from rich.console import Console

from services.cli import main
from services.pulse.scrape import nested_counts, server_view
from services.pulse.stats import RequestTrace
from services.pulse.tenant_report import columns, print_tenant_table
from services.pulse.tenant_stats import by_kind, cause_kind, final_refusals, tenant_figures, together
from services.pulse.tenants import TenantSpec, check_tenants, parse_tenant
from tests.client.fakes import Fail, FakeReplicas, Serve

RE = "RESOURCE_EXHAUSTED"


def test_a_tenant_reads_every_field() -> None:
    spec = parse_tenant("name=A,key=k1,load=4x,class=batch,deadline-ms=1500,seed=7")
    assert spec == TenantSpec("A", None, 4.0, "k1", "batch", 1500.0, 7)
    assert spec.rate_qps(capacity_qps=10.0) == 40.0
    assert parse_tenant("name=B, qps=2.5").rate_qps(None) == 2.5
    assert parse_tenant("name=B,qps=2.5").seed_or(3) == 3 and spec.seed_or(3) == 7


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("qps=3", "field name: required"),
        ("name=A", "field qps or load"),
        ("name=A,qps=1,load=2", "field qps or load"),
        ("name=A,qps=fast", "field qps: not a number"),
        ("name=A,qps=0", "field qps: must be a number > 0"),
        ("name=A,load=-1x", "field load: must be"),
        ("name=A,qps=1,rate=2", "field 'rate': unknown"),
        ("name=A,qps=1,qps=2", "field qps: given twice"),
        ("name=A,qps=1,seed=x", "field seed: not a number"),
        ("name=A,qps=1,key=", "field key: empty"),
        ("name=A,qps", "field 'qps': expected name=value"),
    ],
)
def test_a_bad_tenant_names_its_field(text: str, field: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=field):
        parse_tenant(text)


def test_the_cli_says_which_field_is_bad(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["pulse", "--endpoint", "127.0.0.1:1", "--tenant", "name=A,qps=1,deadline-ms=soon"])
    assert exit_.value.code == 2
    assert "argument --tenant" in (err := capsys.readouterr().err) and "field deadline-ms" in err


def test_load_needs_a_capacity_and_tenants_need_keys_with_endpoints() -> None:
    with pytest.raises(ValueError, match="load=4 needs --capacity-json"):
        parse_tenant("name=A,load=4").rate_qps(None)
    a, b = parse_tenant("name=A,qps=1,key=x"), parse_tenant("name=B,qps=1")
    check_tenants([a, b], ["B"], with_endpoints=False)
    with pytest.raises(ValueError, match="--tenant B: field key is needed"):
        check_tenants([a, b], [], with_endpoints=True)
    with pytest.raises(ValueError, match="--alone C"):
        check_tenants([a, b], ["C"], with_endpoints=False)
    with pytest.raises(ValueError, match="names must differ"):
        check_tenants([a, a], [], with_endpoints=False)
    with pytest.raises(ValueError, match="share a key"):
        check_tenants([a, parse_tenant("name=C,qps=1,key=x")], [], with_endpoints=False)


def test_tenant_flags_that_do_not_go_together() -> None:
    with pytest.raises(SystemExit, match="no --qps/--load"):
        main(["pulse", "--tenant", "name=A,qps=1,key=k", "--qps", "3", "--endpoint", "127.0.0.1:1"])
    with pytest.raises(SystemExit, match="--alone names a --tenant"):
        main(["pulse", "--alone", "A", "--qps", "3", "--endpoint", "127.0.0.1:1", "--api-key", "k"])


def call(i: int, attempts: list[str], outcome: str, took_s: float | None = 0.1, cause: str = "") -> RequestTrace:
    """A call sent at i seconds, its attempts 10 ms apart, finished `took_s` later (deadline 1 s)."""
    return RequestTrace(
        index=i,
        planned_s=float(i),
        deadline_ms=1000,
        prompt_tokens=8,
        max_tokens=4,
        sent_s=float(i),
        outcome=outcome,
        attempts=[(i + 0.01 * k, a) for k, a in enumerate(attempts)],
        finished_s=None if took_s is None else i + took_s,
        server_deadline_met=True if outcome == "ok" else None,
        refusal_cause=cause,
    )


@pytest.fixture
def b_together() -> list[RequestTrace]:
    return [
        call(0, ["admitted"], "ok"),
        call(1, [RE, "admitted"], "ok"),
        call(2, ["admitted"], "ok", took_s=1.5),  # admitted, finished past its deadline
        call(3, [RE, RE], "rejected", took_s=0.02, cause="over_share"),
        call(4, ["DEADLINE_EXCEEDED"], "infeasible", took_s=0.01),
    ]


SERVER = {
    "refusals_by_tenant": {"B": {"over_share": 2, "slots_full": 1}, "A": {"slots_full": 40, "quota": 2}},
    "device_unit_us_by_tenant": {"B": {"core_us": 2_500_000.0}},
}


def test_a_tenants_figures(b_together) -> None:
    alone = tenant_figures("B", [call(i, ["admitted"], "ok") for i in range(4)], 10.0, 0.5)
    b = tenant_figures("B", b_together, 10.0, 0.5, SERVER, "batch", alone)
    assert b.admitted_share == 3 / 5 and b.in_deadline_of_admitted == 2 / 3
    assert b.goodput_rps == 2 / 10 and alone.goodput_rps == 4 / 10 and b.goodput_vs_alone == 0.5
    assert b.refused_in_the_end == {"over_share": 1, "infeasible": 1}
    assert b.replica_refusals == {"over_share": 2, "slots_full": 1}
    assert b.replica_refusals_by_kind == {"overload": 1, "share": 2}
    assert b.replica_device_us == {"core_us": 2_500_000.0}
    assert alone.replica_refusals is None and alone.goodput_vs_alone is None
    assert b.to_dict()["alone"]["goodput_rps"] == 0.4 and b.to_dict()["service_class"] == "batch"


def test_all_tenants_together_add_up(b_together) -> None:
    a = [call(i, ["admitted"], "ok") for i in range(6)] + [call(6, [RE], "rejected", 0.01, "slots_full")]
    run = together("fair", {"A": a, "B": b_together}, {"A": 4.0, "B": 0.5}, 10.0, SERVER, {"B": "batch"})
    assert [f.tenant for f in run.tenants] == ["A", "B"] and run.tenants[1].service_class == "batch"
    assert run.total.offered_qps == 4.5 and run.total.summary.num_sent == 12
    assert run.total.goodput_rps == pytest.approx(run.tenants[0].goodput_rps + run.tenants[1].goodput_rps)
    assert run.total.replica_refusals == {"slots_full": 41, "quota": 2, "over_share": 2}
    assert run.total.replica_device_us == {"core_us": 2_500_000.0}  # A's use was not in the scrape
    assert run.total.refused_in_the_end == {"slots_full": 1, "over_share": 1, "infeasible": 1}
    assert together("x", {"A": a}, {"A": 1.0}, 10.0).total.replica_refusals is None


def test_causes_fall_into_kinds() -> None:
    overload = ("slots_full", "step_budget", "deadline", "delays_admitted", "compiles")
    assert [cause_kind(c) for c in overload] == ["overload"] * 5
    assert [cause_kind(c) for c in ("over_share", "priority", "quota", "infeasible", "new")] == [
        "share",
        "priority",
        "quota",
        "infeasible",
        "other",
    ]
    kinds = by_kind({"quota": 1, "new": 2, "deadline": 3, "over_share": 4})
    assert list(kinds) == ["overload", "share", "quota", "other"]
    assert final_refusals([call(0, [RE], "rejected", cause="")]) == {"unknown": 1}


def test_the_replica_view_splits_refusals_by_tenant_and_class() -> None:
    def key(name: str, **labels: str):
        return (name, tuple(sorted(labels.items())))

    before = {key("zeroqueue_refusals_total", cause="over_share", tenant="A", service_class="batch"): 1.0}
    after = {
        key("zeroqueue_refusals_total", cause="over_share", tenant="A", service_class="batch"): 4.0,
        key("zeroqueue_refusals_total", cause="slots_full", tenant="A", service_class="standard"): 2.0,
        key("zeroqueue_refusals_total", cause="slots_full", tenant="B", service_class="batch"): 1.0,
        key("zeroqueue_refusals_total", cause="quota", tenant="C", service_class="batch"): 0.0,
        key("zeroqueue_device_unit_us_total", tenant="B", cost_center="", unit="core_us"): 7.0,
        key("zeroqueue_class_requests_total", service_class="batch", outcome="ok"): 5.0,
    }
    view = server_view(before, after)
    assert view["refusals_by_tenant"] == {"A": {"over_share": 3.0, "slots_full": 2.0}, "B": {"slots_full": 1.0}}
    assert view["refusals_by_class"] == {"batch": {"over_share": 3.0, "slots_full": 1.0}, "standard": {"slots_full": 2}}
    assert view["device_unit_us_by_tenant"] == {"B": {"core_us": 7.0}}
    assert view["requests_by_class"] == {"batch": {"ok": 5.0}}
    # the counter as it was before it had a class: the class reads as ""
    classless = {key("zeroqueue_refusals_total", cause="deadline", tenant="A"): 2.0}
    assert nested_counts(classless, "zeroqueue_refusals_total", "service_class", "cause") == {"": {"deadline": 2.0}}


def test_the_table_puts_each_tenant_its_alone_run_and_all_side_by_side(b_together) -> None:
    alone = tenant_figures("B", [call(i, ["admitted"], "ok") for i in range(4)], 10.0, 0.5)
    a = [call(i, ["admitted"], "ok") for i in range(6)]
    run = together("fair", {"A": a, "B": b_together}, {"A": 4.0, "B": 0.5}, 10.0, SERVER, alone={"B": alone})
    assert [header for header, _ in columns(run)] == ["fair: A", "fair: B", "fair: B alone", "fair: all"]
    console = Console(record=True, width=200)
    print_tenant_table([run], "two tenants", console)
    text = console.export_text()
    for row, b_cell in (
        ("admitted, of sent", "60.00 %"),
        ("in deadline, of admitted", "66.67 %"),
        ("goodput vs alone", "0.500"),
        ("replica: refusals by kind", "share 2, overload 1"),
        ("replica: device time", "2.50 core·s"),
    ):
        line = next(line for line in text.splitlines() if row in line)
        assert b_cell in line, (row, line)


def test_two_tenants_end_to_end_each_with_its_key_and_class(tmp_path) -> None:
    refusal = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", {"cause": "over_share"})
    quota = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "QUOTA_EXCEEDED", {"cap": "calls_per_s"})
    with FakeReplicas([[refusal] * 2 + [quota] + [Serve()] * 100]) as fakes:
        argv = ["pulse", "--endpoint", fakes.addresses[0], "--tenant", "name=A,key=secret-a,qps=12,class=batch"]
        argv += ["--tenant", "name=B,key=kb,qps=4", "--alone", "B", "--duration", "1", "--arrival", "constant"]
        argv += ["--prompt-tokens", "5", "--max-tokens", "2", "--max-attempts", "1", "--out", str(tmp_path)]
        assert main([*argv, "--no-progress"]) == 0
        calls = fakes[0].calls
    seen = Counter((c.metadata["authorization"], c.request.service_class) for c in calls)
    assert seen == {("Bearer secret-a", "batch"): 12, ("Bearer kb", ""): 8}  # B's 4 alone, then its 4 beside A
    doc = json.loads((tmp_path / "pulse.json").read_text())
    tenants = doc["runs"]["run"]["tenants"]
    assert tenants["A"]["summary"]["num_sent"] == 12 and tenants["B"]["summary"]["num_sent"] == 4
    assert tenants["B"]["alone"]["summary"]["num_sent"] == 4
    # B's first two calls alone were refused over_share, with no retry, and its third at a quota
    assert tenants["B"]["alone"]["refused_in_the_end"] == {"over_share": 2, "quota": 1}
    assert tenants["B"]["alone"]["summary"]["outcomes"] == {"rejected": 2, "quota_exceeded": 1, "ok": 1}
    assert tenants["B"]["goodput_vs_alone"] == pytest.approx(4 / 1)
    assert doc["runs"]["run"]["total"]["summary"]["num_sent"] == 16
    assert doc["config"]["tenants"][1] == {
        "name": "B",
        "qps": 4.0,
        "load": None,
        "service_class": "",
        "deadline_ms": 2000.0,
        "seed": 1,
    }
    assert "secret-a" not in (tmp_path / "pulse.json").read_text()  # keys stay out of the results
    traces = {p.name for p in tmp_path.glob("trace-*.jsonl")}
    assert traces == {"trace-run-A.jsonl", "trace-run-B.jsonl", "trace-run-B-alone.jsonl"}
