"""What `zeroqueue serve` is told: the replica's settings (the CLI's flags, services/cli_serve.py), and deadline
admission's settings as those flags choose them."""

from __future__ import annotations

from dataclasses import dataclass

from .admission import AdmissionSettings
from .device.spec import ExecutorConfig
from .generate_request import RequestLimits
from .health.faults import Fault
from .health.watchdog import WatchdogConfig
from .policy import DEFAULT_REFRESH_S
from .policy.gate import PrefixCachePolicy


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    admission: str = "deadline"  # deadline | fifo
    fair_share: bool = True  # deadline mode: fair share between tenants and class priority; False: first come
    hold: bool = False  # deadline mode: a call that fits later inside its slack is held for its slot; False: refused
    hold_prompts: bool = True  # deadline mode: a prompt that waits a few steps for the step budget is admitted
    hold_blocks: bool = True  # deadline mode, a planned KV pool: a call whose blocks free inside its slack is held
    elsewhere: bool = False  # other replicas serve the same model: saturated, point retries at them; False: alone
    default_deadline_ms: int = 30_000
    metrics_port: int | None = None
    dtype: str = "auto"
    executor: ExecutorConfig = ExecutorConfig()
    engine_process: bool = True  # the engine in a child process (False: a thread of this one)
    pin_cpus: bool = False  # engine process on cores of its own, this process on the rest (CPU)
    json_logs: bool | None = None  # the engine process logs like this one (None: console lines), on stderr
    max_num_batched_tokens: int = 256
    pace_tokens: int = 0  # paced steps with room for this prompt chunk (pacing.py); 0: unpaced
    stream_interval_ms: int = 0  # least time between a call's token messages after its first; 0: each step
    margin_ms: float = 20.0
    margin_fraction: float = 0.05
    max_reservations: int | None = None  # refused calls' retries that may hold a slot at once; None: one per slot
    data_dir: str | None = None  # the outbox (and the default ledger); $ZEROQUEUE_HOME or ~/.zeroqueue
    ledger_url: str | None = None  # embedded metering: the ledger database
    metering_address: str | None = None  # remote metering: ship usage and check keys there
    metering_key: str | None = None  # admin key for RecordUsage on the remote metering service
    metering_ca: str | None = None  # PEM roots to reach the metering service over TLS
    tls_cert: str | None = None  # serve over TLS with this certificate chain and key (PEM)
    tls_key: str | None = None
    health_port: int | None = None  # plaintext gRPC health only (kubelet probes cannot speak TLS)
    http_port: int | None = None  # the OpenAI/Anthropic-compatible HTTP door (services/http/), TLS as gRPC's; None: off
    limits: RequestLimits = RequestLimits()  # what one Generate request may hold (servicer.py)
    watchdog: WatchdogConfig | None = WatchdogConfig()  # the device's watchdog (health/watchdog.py); None: off
    device_recovery_s: float = 60.0  # a device failed this long takes liveness down too, so the pod restarts
    fault: Fault | None = None  # a fault injected on purpose, for tests and drills (health/faults.py)
    policy_refresh_s: float = DEFAULT_REFRESH_S  # how often the serving policy (classes, quotas) is read again
    prefix_cache: PrefixCachePolicy = PrefixCachePolicy()  # whose cached prompt blocks a call may share

    def admission_settings(self) -> AdmissionSettings:
        """Deadline admission's settings as the serve flags choose them (the rest are AdmissionSettings' own)."""
        return AdmissionSettings(
            max_reservations=self.max_reservations,
            fair=self.fair_share,
            hold_in_slack=self.hold,
            hold_for_prompts=self.hold_prompts,
            hold_for_blocks=self.hold_blocks,
            elsewhere=self.elsewhere,
        )
