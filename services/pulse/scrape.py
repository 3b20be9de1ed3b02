"""The replica's own view of a run, from its Prometheus /metrics before and after: queue time (receive ->
first engine step), steps waited (steps that began in between), step time and period, deadline misses, the
retry-attempt counters the SDK's x-retry-attempt feeds, and refusals by cause per tenant and per class."""

from __future__ import annotations

import math
import urllib.request
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout_s: float = 5.0) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 - an operator-given http URL
        text = reply.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def delta(after: Samples, before: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def _bucket_counts(samples: Samples, name: str) -> list[tuple[float, float]]:
    buckets = [(float(dict(labels)["le"]), value) for (n, labels), value in samples.items() if n == f"{name}_bucket"]
    return sorted(buckets)


def quantile_upper_bound(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket that holds the q-quantile (cumulative buckets): "at most this"."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    target = q * buckets[-1][1]
    return next(le for le, cumulative in buckets if cumulative >= target)


def histogram_ms(samples: Samples, name: str) -> dict:
    """A histogram's count, mean and bucket bounds on P50, P99 and the max, in milliseconds."""
    buckets = _bucket_counts(samples, name)
    count = samples.get((f"{name}_count", ()), 0.0)
    total = samples.get((f"{name}_sum", ()), 0.0)

    def ms(value: float | None) -> float | None:
        return None if value is None else (math.inf if math.isinf(value) else value * 1000)

    return {
        "count": int(count),
        "mean_ms": total / count * 1000 if count else None,
        "p50_at_most_ms": ms(quantile_upper_bound(buckets, 0.50)),
        "p99_at_most_ms": ms(quantile_upper_bound(buckets, 0.99)),
        "max_at_most_ms": ms(quantile_upper_bound(buckets, 1.0)),
    }


def _by_labels(samples: Samples, name: str, *keys: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), value in samples.items():
        if n == name and value:
            label = dict(labels)
            out["/".join(label.get(k, "") for k in keys)] += value
    return dict(out)


def _steps_waited(samples: Samples) -> dict:
    """Of admitted calls that ran, how many joined the very next step (0 steps waited), and the most waited."""
    name = "zeroqueue_steps_waited"
    buckets = _bucket_counts(samples, name)
    count = samples.get((f"{name}_count", ()), 0.0)
    next_step = next((cumulative for le, cumulative in buckets if le == 0), 0.0)
    return {
        "count": int(count),
        "next_step_share": next_step / count if count else None,
        "mean": samples.get((f"{name}_sum", ()), 0.0) / count if count else None,
        "max_at_most": quantile_upper_bound(buckets, 1.0),
    }


def nested_counts(samples: Samples, name: str, outer: str, inner: str) -> dict[str, dict[str, float]]:
    """A counter's non-zero samples as {outer label: {inner label: count}}, summed over its other labels; a label
    the series lack reads as "" (zeroqueue_refusals_total before it had service_class, say)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (n, labels), value in samples.items():
        if n == name and value:
            label = dict(labels)
            out[label.get(outer, "")][label.get(inner, "")] += value
    return {key: dict(counts) for key, counts in out.items()}


def server_view(before: Samples, after: Samples) -> dict:
    d = delta(after, before)
    return {
        "queue_time": histogram_ms(d, "zeroqueue_queue_time_seconds"),
        "step_time": histogram_ms(d, "zeroqueue_step_seconds"),
        "step_period": histogram_ms(d, "zeroqueue_step_period_seconds"),
        "steps_waited": _steps_waited(d),
        "deadline_misses": int(d.get(("zeroqueue_deadline_misses_total", ()), 0.0)),
        "requests_by_outcome": _by_labels(d, "zeroqueue_requests_total", "outcome"),
        "rejections_by_reason": _by_labels(d, "zeroqueue_rejections_total", "reason"),
        "retry_attempts": _by_labels(d, "zeroqueue_retry_attempts_total", "attempt", "result"),
        "refusals_by_tenant": nested_counts(d, "zeroqueue_refusals_total", "tenant", "cause"),
        "refusals_by_class": nested_counts(d, "zeroqueue_refusals_total", "service_class", "cause"),
        "requests_by_class": nested_counts(d, "zeroqueue_class_requests_total", "service_class", "outcome"),
        "device_unit_us_by_tenant": nested_counts(d, "zeroqueue_device_unit_us_total", "tenant", "unit"),
    }
