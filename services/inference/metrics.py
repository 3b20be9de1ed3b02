"""Prometheus metrics of the inference service, on a registry owned by the service instance, and the step
observer (`StepStats`) that feeds them and the cost model from every step."""

from __future__ import annotations

import bisect
import threading
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from billing.records import DEFAULT_CLASS

from .admission.decisions import RefusalCause
from .cost.model import CostModel
from .device.spec import Device
from .device.telemetry import GpuTelemetry, HostSteal
from .engine.digest import StepDigest
from .health.state import DeviceState

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1)
# fine below 2 ms, where the admission goal lies, so percentiles can be read off the buckets
ADMISSION_BUCKETS_S = tuple(i * 50e-6 for i in range(1, 41)) + (0.003, 0.005, 0.01, 0.025, 0.05, 0.1)
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4)


MAX_COST_CENTERS = 64  # cost_center comes from callers: more distinct values than this count as "_other"
MAX_TENANTS = 256  # tenants as a label: past this many, "_other"
MAX_CLASSES = 32  # classes of service as a label (the operator's, from the ledger): past this many, "_other"


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._cost_centers: set[str] = set()
        self._tenants: set[str] = set()
        self._classes: set[str] = set()
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._declare_calls(r)
        self._declare_latencies(r)
        self._declare_engine(r)
        self.set_device_state(DeviceState.HEALTHY)
        r.register(HostSteal())

    def _declare_calls(self, r: CollectorRegistry) -> None:
        """What became of calls: outcomes, refusals and their causes, retries, the policy's reads, device time."""
        self.requests = Counter("zeroqueue_requests", "Generate calls by outcome", ["outcome"], registry=r)
        self.rejections = Counter(
            "zeroqueue_rejections", "Calls refused at admission, by reason", ["reason"], registry=r
        )
        self.refusals = Counter(
            "zeroqueue_refusals",
            "Calls refused at admission, by cause (admission's, infeasible, or quota) and tenant (at most "
            f"{MAX_TENANTS}; more count as _other) and service_class (at most {MAX_CLASSES})",
            ["cause", "tenant", "service_class"],
            registry=r,
        )
        self.requests_by_class = Counter(
            "zeroqueue_class_requests",
            f"Admitted Generate calls by class of service (at most {MAX_CLASSES}; more count as _other) and outcome",
            ["service_class", "outcome"],
            registry=r,
        )
        self.policy_refreshes = Counter(
            "zeroqueue_policy_refreshes",
            "Reads of the serving policy (classes, prices, quotas) from the ledger or the metering service, by "
            "result (ok, failed: the last policy read stays in force)",
            ["result"],
            registry=r,
        )
        self.policy_read_at = Gauge(
            "zeroqueue_policy_read_timestamp_seconds",
            "When the serving policy in force was read (Unix time); 0 before the first read",
            registry=r,
        )
        self.retry_attempts = Counter(
            "zeroqueue_retry_attempts",
            "Admission decisions by attempt number (0 for a first attempt; 1, 2, 3+ from x-retry-attempt) and result",
            ["attempt", "result"],
            registry=r,
        )
        self.device_unit_us = Counter(
            "zeroqueue_device_unit_us",
            "Device time of finished calls: SM·µs on a GPU, core·µs on a CPU (unit says which)",
            ["tenant", "cost_center", "unit"],
            registry=r,
        )
        self.compute_units = Gauge(
            "zeroqueue_device_compute_units", "SMs (GPU) or cores (CPU) the engine runs on", registry=r
        )
        self.deadline_misses = Counter(
            "zeroqueue_deadline_misses", "Admitted calls that missed their deadline", registry=r
        )

    def _declare_latencies(self, r: CollectorRegistry) -> None:
        """How long each part of a call took, from its arrival to its usage record."""
        self.queue_time = Histogram(
            "zeroqueue_queue_time_seconds", "Received to first engine step", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.steps_waited = Histogram(
            "zeroqueue_steps_waited",
            "Engine steps that began between a call's admission "
            "and the step that first ran it: 0 when it joined the very next step",
            buckets=(0, 1, 2, 3, 5, 10, 20, 50),
            registry=r,
        )
        self.ttft = Histogram(
            "zeroqueue_ttft_seconds", "Received to first token", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.inter_token = Histogram(
            "zeroqueue_inter_token_seconds", "Between consecutive token messages", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.e2e = Histogram(
            "zeroqueue_e2e_seconds",
            "Received to finished, admitted calls that completed",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.admission_time = Histogram(
            "zeroqueue_admission_seconds", "Arrival to admission decision", buckets=ADMISSION_BUCKETS_S, registry=r
        )
        self.relay_lag = Histogram(
            "zeroqueue_relay_lag_seconds",
            "Engine step end to its output taken up by the call's stream on the event loop "
            "(the oldest output of each message): how far the server runs behind the engine",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.usage_durable = Histogram(
            "zeroqueue_usage_durable_seconds",
            "Engine finish to the call's usage record durable in the outbox, which the final message waits for",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.refusal_reply_time = Histogram(
            "zeroqueue_refusal_reply_seconds",
            "Arrival to a refusal (RESOURCE_EXHAUSTED) handed to gRPC: the decision and the status details",
            buckets=ADMISSION_BUCKETS_S,
            registry=r,
        )

    def _declare_engine(self, r: CollectorRegistry) -> None:
        """The engine's steps, the cost model's running ratio, the slots and KV pool, the device's state."""
        self.step_time = Histogram("zeroqueue_step_seconds", "Engine step interval", buckets=STEP_BUCKETS_S, registry=r)
        self.step_period = Histogram(
            "zeroqueue_step_period_seconds",
            "Start of one engine step to the start of the next while calls stay in "
            "flight: the cadence an arriving call waits on (paced steps idle in it)",
            buckets=STEP_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "zeroqueue_batch_size", "Sequences per engine step", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r
        )
        self.finish_error = Histogram(
            "zeroqueue_finish_prediction_ratio",
            "Actual / predicted time to finish, admitted calls",
            buckets=RATIO_BUCKETS,
            registry=r,
        )
        self.cost_ratio = Gauge("zeroqueue_cost_model_ratio", "Running measured/calibrated step time", registry=r)
        self.cost_deviation = Gauge(
            "zeroqueue_cost_model_deviation",
            "Running mean absolute deviation of that ratio; predictions use ratio + 3 deviations",
            registry=r,
        )
        self.in_flight = Gauge("zeroqueue_in_flight", "Admitted calls not yet finished", registry=r)
        self.free_slots = Gauge("zeroqueue_kv_slots_free", "Slots free: more calls that may run at once", registry=r)
        self.kv_pool = KvPoolMetrics()  # read from the pool when scraped (Replica wires where from)
        r.register(self.kv_pool)
        self.device_state = Gauge(
            "zeroqueue_device_state",
            "1 for the device's state (healthy, slow, failed), 0 for the others",
            ["state"],
            registry=r,
        )

    def set_device_state(self, state: DeviceState) -> None:
        for each in DeviceState:
            self.device_state.labels(each.value).set(1 if each is state else 0)

    def watch_device(self, device: Device) -> GpuTelemetry | None:
        """Adds a GPU's NVML readings to this registry (docs/OPERATIONS.md, "Device telemetry"); None for a CPU,
        or where NVML cannot see the device. The caller closes what it gets."""
        if device.kind != "cuda":
            return None
        telemetry = GpuTelemetry(device.device_id)
        if not telemetry.start():
            return None
        self.registry.register(telemetry)
        return telemetry

    def watch_reservations(self, events: Tally[str]) -> None:
        """Exports admission's count of what became of its promises to refused calls (read at scrape time)."""
        self.registry.register(ReservationEvents(events))

    def count_refusal(self, cause: RefusalCause, tenant: str, service_class: str = DEFAULT_CLASS) -> None:
        """A call refused at admission: `cause` is why not now (admission's Reject.reason, infeasible, or quota)."""
        tenant = _bounded(tenant, self._tenants, MAX_TENANTS)
        self.refusals.labels(cause, tenant, _bounded(service_class, self._classes, MAX_CLASSES)).inc()

    def count_outcome(self, outcome: str, service_class: str) -> None:
        """An admitted call's end: zeroqueue_requests_total{outcome}, and by class too."""
        self.requests.labels(outcome).inc()
        self.requests_by_class.labels(_bounded(service_class, self._classes, MAX_CLASSES), outcome).inc()

    def count_policy_refresh(self, ok: bool, read_at_us: int) -> None:
        self.policy_refreshes.labels("ok" if ok else "failed").inc()
        if ok:
            self.policy_read_at.set(read_at_us / 1e6)

    def count_usage(self, tenant: str, cost_center: str, unit: str, unit_us: int) -> None:
        """Called for every usage record; keeps the cost_center label's cardinality bounded."""
        cost_center = _bounded(cost_center, self._cost_centers, MAX_COST_CENTERS)
        self.device_unit_us.labels(tenant, cost_center, unit).inc(unit_us)


def _bounded(value: str, seen: set[str], limit: int) -> str:
    """A label value from callers, or "_other" once `limit` distinct values have been seen."""
    if value not in seen:
        if len(seen) >= limit:
            return "_other"
        seen.add(value)
    return value


class ReservationEvents(Collector):
    """zeroqueue_reservation_events_total{event}: reserved, unbacked, taken, taken_refused, retry_held,
    retry_held_later, lapsed, retry_after_lapse, turn_held, turn_retry, turn_lapsed, saturated; and of calls admitted
    for a later start instead: held, held_for_blocks, held_for_prompts, held_started_early
    (docs/OPERATIONS.md, "Retries from clients in other languages")."""

    def __init__(self, events: Tally[str]) -> None:
        self.events = events

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "zeroqueue_reservation_events", "What became of refused calls' reserved retries, by event", labels=["event"]
        )
        for event, count in sorted(self.events.items()):
            family.add_metric([event], count)
        yield family


class KvPoolMetrics:
    """The KV block pool, read when scraped, from whichever pool reserves the blocks: deadline admission's in this
    process (services/inference/kv_pool.py), or the engine's as its last step reported it (FIFO). Read at scrape
    time, a block freed after the last step (a call's end) shows at once."""

    def __init__(self) -> None:
        self.num_blocks = 0
        self.counts: Callable[[], tuple[int, ...]] = lambda: (0,) * 7  # BlockPool.counts' order

    def watch(self, num_blocks: int, counts: Callable[[], tuple[int, ...]]) -> None:
        self.num_blocks, self.counts = num_blocks, counts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        used, cached, hit_tokens, queried_tokens, hit_calls, queried_calls, evicted = self.counts()
        blocks = GaugeMetricFamily(
            "zeroqueue_kv_blocks", "KV cache blocks: used by calls, cached (free to evict) or free", labels=["state"]
        )
        for state, n in (("used", used), ("cached", cached), ("free", max(0, self.num_blocks - used - cached))):
            blocks.add_metric([state], n)
        yield blocks
        for name, what, hits, looked in (
            ("prompt_tokens", "Prompt tokens of calls that looked in the prefix cache", hit_tokens, queried_tokens),
            ("calls", "Calls that looked in the prefix cache", hit_calls, queried_calls),
        ):
            family = CounterMetricFamily(
                f"zeroqueue_prefix_cache_{name}", f"{what}: served by it (hit) or not (miss)", labels=["result"]
            )
            family.add_metric(["hit"], hits)
            family.add_metric(["miss"], looked - hits)
            yield family
        yield CounterMetricFamily(
            "zeroqueue_kv_evicted_blocks", "Cached KV blocks evicted for new calls", value=evicted
        )


class StepStats:
    """Step observer: feeds every measured step to the cost model and the metrics. Paced (pace_tokens > 0), the
    cost model learns a step's period, its interval plus the idle the engine held after it (which comes with
    the next step), against the step padded with a prompt chunk: that is what admission predicts then."""

    def __init__(
        self,
        cost: CostModel | None,
        metrics: ServiceMetrics,
        num_slots: int,
        steps: StepLog,
        pace_tokens: int = 0,
        step_ended: Callable[[int], None] | None = None,
    ) -> None:
        self.cost, self.metrics, self.num_slots, self.steps = cost, metrics, num_slots, steps
        self.pace_tokens = pace_tokens
        self.step_ended = step_ended  # admission's: the engine, busy, began its next step when this one ended
        self.kv_counts: tuple[int, ...] = (0,) * 7  # the engine's pool as the last step left it (BlockPool.counts)
        self._last: StepDigest | None = None  # the step whose period ends when the next one begins

    def on_step(self, digest: StepDigest) -> None:
        self.metrics.free_slots.set(digest.num_free_slots)
        self.kv_counts = digest[-7:]  # the digest's last seven fields are BlockPool.counts
        if not digest.ran:
            return
        if digest.num_unfinished and self.step_ended is not None:
            self.step_ended(digest.ended_ns)
        self.steps.add(digest.began_ns)
        interval_us = digest.interval_ns // 1000
        if self.cost is not None:  # before _last moves on to this step
            self._observe_cost(digest)
            self.metrics.cost_ratio.set(self.cost.ratio)
            self.metrics.cost_deviation.set(self.cost.deviation)
        self.metrics.step_time.observe(interval_us / 1e6)
        self.metrics.batch_size.observe(digest.num_seqs)
        last, self._last = self._last, digest
        if last is not None and last.num_unfinished:
            self.metrics.step_period.observe((digest.began_ns - last.began_ns) / 1e9)

    def _observe_cost(self, digest: StepDigest) -> None:
        cost = self.cost
        if not self.pace_tokens:
            cost.observe(digest.num_tokens, digest.context_tokens, digest.interval_ns // 1000, self._extra_us(digest))
            return
        last = self._last
        if last is not None:
            rows = max(last.num_tokens, last.num_seqs + self.pace_tokens)
            cost.observe(rows, last.context_tokens, (last.interval_ns + digest.paced_ns) // 1000, self._extra_us(last))

    def _extra_us(self, digest: StepDigest) -> float:
        """Calibrated time a step takes beyond its calibrated rows: its masked and log-probability rows' host work,
        and its prompt chunks' reads of the positions before them."""
        cost = self.cost
        host_us = cost.host_us(digest.num_masked_rows, digest.num_logprob_rows)
        return host_us + digest.prefill_context_tokens * cost.us_per_prefill_context_token

    def on_idle(self, now_ns: int) -> None:
        self.metrics.free_slots.set(self.num_slots)  # idle: nothing holds a slot


# When recent engine steps began, to tell how many steps an admitted call waited before it first ran.
#
# "Joins the very next step" is the product's promise: a call admitted while a step runs waits for that step
# (0 steps waited), never for another. (Counted from the admission decision: a step that begins while the
# decision is being made could not have taken the call; the time from receipt is the queue-time metric.) Queue time in
# ms cannot show this on its own: a call more likely arrives
# during a long step than a short one, so its mean wait is E[S²]/2E[S], above half a mean step.
class StepLog:
    """Start times (ns) of the last `capacity` steps that ran, appended in order by the step observer (the
    engine's thread or the event loop) and read on the event loop; a lock keeps the two apart."""

    def __init__(self, capacity: int = 4096) -> None:
        self._began_ns: deque[int] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def add(self, began_ns: int) -> None:
        with self._lock:
            self._began_ns.append(began_ns)

    def steps_began_between(self, after_ns: int, before_ns: int) -> int:
        """Steps that began strictly after `after_ns` and strictly before `before_ns` (bisect indexes the deque
        directly: a lookup is O(n/64) there, a dozen of them per call)."""
        with self._lock:
            return max(bisect.bisect_left(self._began_ns, before_ns) - bisect.bisect_right(self._began_ns, after_ns), 0)
