"""deploy/grafana: every query parses as PromQL and asks only for metrics (and labels) that a replica exports.

The exported names come from the service's own registry (services/inference/metrics.py), with a GPU's telemetry
read from a fake NVML (services/inference/device/telemetry.py) and the HTTP door's metrics (services/http/door.py)
on the same registry, as a replica serving --http-port has them, so renaming a metric there without updating the
dashboard fails here.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from unittest import mock

import promql_parser as promql
import pytest
from prometheus_client.metrics import MetricWrapperBase

from services.http.door import HttpMetrics
from services.inference.device.spec import Device
from services.inference.metrics import ServiceMetrics
from tests.inference.fake_nvml import A100, FakeNvml, mig_host

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "info": ("_info",),
}


def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, for every metric a replica's ServiceMetrics registers, a GPU's included."""
    metrics = ServiceMetrics()
    http = HttpMetrics(metrics.registry)  # the HTTP door's, on the replica's registry (replica.py)
    gpus = mig_host()
    gpus[1].xids.append(79)  # so that the XID counter has a sample, and its label is seen
    with mock.patch.dict(sys.modules, {"pynvml": FakeNvml(gpus)}):
        metrics.watch_device(Device("cuda", "NVIDIA A100-SXM4-40GB", A100, 108, "sm_us"))
    labels = {
        m._name: set(m._labelnames)
        for m in [*vars(metrics).values(), *vars(http).values()]  # noqa: SLF001 - no public accessor
        if isinstance(m, MetricWrapperBase)
    }
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for suffix in SUFFIXES[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            sampled = {label for sample in family.samples for label in sample.labels}
            names[family.name + suffix] = labels.get(family.name, set()) | sampled | extra
    return names


EXPORTED = exported()


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as Prometheus would receive them: built-in intervals become durations, template
    variables (used inside label matchers) a regex."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: "5m" if m.group(1).startswith("__") else ".*", expr)


def panels(items: list[dict]):
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"])
            assert match, f"variable {variable['name']}: {variable['definition']}"
            exprs.append(f"count by ({match.group(2)}) ({match.group(1)})")
    return exprs


def selectors(expr) -> list:
    found = []
    promql.walk(expr, lambda node: found.append(node) if isinstance(node, promql.VectorSelector) else None)
    return found


def metric_name(selector) -> str:
    names = [m.value for m in selector.matchers.matchers if m.name == "__name__"]
    return selector.name or names[0]


def check(expr_text: str) -> list[str]:
    """Problems with one query: unknown metrics, labels the metric lacks, grouping by labels nobody has."""
    expr = promql.parse(grafana_to_promql(expr_text))
    problems = []
    for selector in selectors(expr):
        name = metric_name(selector)
        if name not in EXPORTED:
            problems.append(f"{name} is not exported")
            continue
        unknown = {m.name for m in selector.matchers.matchers} - EXPORTED[name] - TARGET_LABELS - {"__name__"}
        problems += [f"{name} has no label {label}" for label in sorted(unknown)]

    def grouping(node) -> None:
        if isinstance(node, promql.AggregateExpr) and node.modifier is not None:
            inner = {label for s in selectors(node.expr) for label in EXPORTED.get(metric_name(s), set())}
            unknown = set(node.modifier.labels) - inner - TARGET_LABELS
            problems.extend(f"{node.op} groups by {label}, which its series lack" for label in sorted(unknown))

    promql.walk(expr, grouping)
    return problems


@pytest.fixture(params=DASHBOARDS, ids=lambda p: p.name)
def dashboard(request) -> dict:
    return json.loads(request.param.read_text())


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS


def test_every_query_uses_exported_metrics_and_labels(dashboard: dict) -> None:
    exprs = queries(dashboard)
    assert len(exprs) > 10
    problems = {expr: found for expr in exprs if (found := check(expr))}
    assert not problems, json.dumps(problems, indent=1, ensure_ascii=False)


def test_the_checker_catches_mistakes() -> None:
    assert check("rate(zeroqueue_requests_total[5m])") == []
    assert check("rate(zeroqueue_request_total[5m])") == ["zeroqueue_request_total is not exported"]
    assert check('rate(zeroqueue_requests_total{outcom="ok"}[5m])') == ["zeroqueue_requests_total has no label outcom"]
    assert check("sum by (tenant) (rate(zeroqueue_requests_total[5m]))") == [
        "sum groups by tenant, which its series lack"
    ]
    assert check("histogram_quantile(0.99, sum by (le) (rate(zeroqueue_e2e_seconds_bucket[$__rate_interval])))") == []
    with pytest.raises(ValueError):
        check("sum(rate(zeroqueue_requests_total[5m])")


def test_panels_cover_the_board(dashboard: dict) -> None:
    """The views operations asked for, each backed by its metric."""
    text = "\n".join(queries(dashboard))
    for metric in (
        "zeroqueue_retry_attempts_total",
        "zeroqueue_rejections_total",
        "zeroqueue_refusals_total",
        "zeroqueue_class_requests_total",
        "zeroqueue_e2e_seconds_bucket",
        "zeroqueue_queue_time_seconds_bucket",
        "zeroqueue_deadline_misses_total",
        "zeroqueue_device_unit_us_total",
        "zeroqueue_device_compute_units",
        "zeroqueue_gpu_utilization_ratio",
        "zeroqueue_gpu_sm_clock_hertz",
        "zeroqueue_gpu_clocks_event_reason",
        "zeroqueue_gpu_temperature_celsius",
        "zeroqueue_gpu_power_watts",
        "zeroqueue_gpu_memory_used_bytes",
        "zeroqueue_gpu_xid_errors_total",
        "zeroqueue_gpu_ecc_errors_total",
        "zeroqueue_cost_model_ratio",
        "zeroqueue_host_steal_seconds_total",
        "zeroqueue_http_responses_total",
        "zeroqueue_http_refusal_reply_seconds_bucket",
        "zeroqueue_refusal_reply_seconds_bucket",
    ):
        assert metric in text, metric
    assert re.search(r'attempt="1",result="admitted"', text), "first-retry success"
    assert re.search(
        r"histogram_quantile\(0\.99, .*zeroqueue_e2e_seconds_bucket.*\) / histogram_quantile\(0\.5,", text
    ), "P99/P50"


def test_panel_ids_are_unique_and_datasources_are_the_variable(dashboard: dict) -> None:
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"]["uid"].strip("${}") in variables, panel["title"]


def refusal_exprs(dashboard: dict) -> list[str]:
    return [e for e in queries(dashboard) if "zeroqueue_refusals_total" in e]


def cause_matchers(expr_text: str) -> set[str]:
    """The causes a query's cause="x" or cause=~"x|y" matcher selects (none: every cause)."""
    found: set[str] = set()
    for selector in selectors(promql.parse(grafana_to_promql(expr_text))):
        for m in selector.matchers.matchers:
            if m.name == "cause":
                found |= set(m.value.split("|"))
    return found


def test_refusals_by_kind_are_the_causes_pulse_groups_them_by(dashboard: dict) -> None:
    """The board's kinds (overload, share, priority, quota, infeasible) select exactly the causes `zeroqueue pulse`
    groups under each, and every cause admission gives falls in one."""
    from services.inference.admission import RefusalCause
    from services.pulse.tenant_stats import CAUSE_KINDS, KIND_OF_CAUSE

    kinds = [p for p in panels(dashboard["panels"]) if p.get("title") == "Refusals by kind"]
    assert kinds, "a panel of refusals by kind"
    chosen = {t["legendFormat"]: cause_matchers(t["expr"]) for t in kinds[0]["targets"]}
    assert chosen == {kind: set(causes) for kind, causes in CAUSE_KINDS.items()}
    given = set(RefusalCause)
    assert given <= set(KIND_OF_CAUSE), given - set(KIND_OF_CAUSE)


def test_refusals_are_shown_per_tenant_and_per_class(dashboard: dict) -> None:
    grouped = set()
    for text in refusal_exprs(dashboard):
        expr = promql.parse(grafana_to_promql(text))
        promql.walk(
            expr,
            lambda n: (
                grouped.update(n.modifier.labels)
                if isinstance(n, promql.AggregateExpr) and n.modifier is not None
                else None
            ),
        )
    assert {"tenant", "service_class", "cause"} <= grouped


def test_the_rejection_board_has_a_row_per_class(dashboard: dict) -> None:
    """A row repeated over the service_class variable, its panels each filtered to that class."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    klass = variables["service_class"]
    assert klass["multi"] and klass["includeAll"], "a repeated row needs a multi-value variable"
    assert klass["definition"] == "label_values(zeroqueue_refusals_total, service_class)"
    items = dashboard["panels"]
    rows = [i for i, p in enumerate(items) if p["type"] == "row" and p.get("repeat") == "service_class"]
    assert len(rows) == 1
    start = rows[0]
    end = next((i for i in range(start + 1, len(items)) if items[i]["type"] == "row"), len(items))
    under = items[start + 1 : end]
    assert len(under) >= 2
    for panel in under:
        assert "$service_class" in panel["title"]
        for target in panel["targets"]:
            assert 'service_class=~"$service_class"' in target["expr"], panel["title"]


def test_panels_do_not_overlap(dashboard: dict) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
