"""`zeroqueue serve`: its options, grouped as `--help` shows them, the replica's ServeConfig made from them, and the
run itself (with the demo tenant `make serve` creates)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path

from services.cli_ledger import fails_cleanly
from services.cli_types import block_size, non_negative_int, parse_bytes, positive_float
from services.inference.bundled_model import BUNDLED_MODEL
from services.inference.device.spec import QUANTIZE_CHOICES


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run an inference replica")
    _model_options(p.add_argument_group("the model and the device"))
    _batch_options(p.add_argument_group("slots, the KV cache and the step"))
    _admission_options(p.add_argument_group("admission"))
    _ledger_options(p.add_argument_group("the ledger and metering"))
    _door_options(p.add_argument_group("the doors, logs and metrics"))
    add_device_options(p.add_argument_group("device health and drills"))
    p.set_defaults(run=fails_cleanly(run_serve))


def _model_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--model",
        default=str(BUNDLED_MODEL),
        help="Hugging Face checkpoint directory (default: the bundled model, zq-python-tiny)",
    )
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    g.add_argument(
        "--quantize",
        default="none",
        choices=QUANTIZE_CHOICES,
        help="the linear weights, quantized at load time, activations staying in --dtype: int8 (symmetric, per "
        "output channel) for the decoder layers and the LM head; int4 (symmetric, per group of 64 inputs) for the "
        "decoder layers, the LM head int8; fp8 (E4M3, CUDA 8.9+) for the decoder layers. The embedding keeps "
        "--dtype. Faster decode on the CPU kernels",
    )
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores but one)")
    g.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine on a thread of the server process instead of its own process",
    )
    g.add_argument(
        "--pin-cpus",
        action="store_true",
        help="CPU engine process on the last --threads cores, the server on the others (on 2 cores it "
        "starved the server under overload: see BENCHMARKS.md)",
    )


def _batch_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-batch", type=int, default=32, help="slots: the most calls running at once")
    g.add_argument("--max-seq-len", type=int, default=1024, help="tokens one call may hold (prompt + output)")
    g.add_argument("--kv-memory", type=parse_bytes, default=parse_bytes("2GiB"), help="KV cache budget, e.g. 512MiB")
    g.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole (for comparison)")
    g.add_argument(
        "--shared-prefix-cache",
        type=lambda text: frozenset(filter(None, text.split(","))),
        default=frozenset(),
        metavar="TENANT,class:NAME,...",
        help="tenants and classes whose calls share one prefix cache; each other tenant has its own, since a "
        "shared cache lets a tenant time what another's prompts start with",
    )
    g.add_argument(
        "--kv-block-size",
        type=block_size,
        default=16,
        metavar="TOKENS",
        help="tokens per KV block, a multiple of 16: the unit the cache is reserved and shared in",
    )
    g.add_argument("--max-batched-tokens", type=int, default=256, help="tokens per engine step")
    g.add_argument(
        "--pace-tokens",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="paced steps: each step lasts at least as long as it would with N more prompt tokens, so "
        "arrivals do not lengthen running calls (tighter latency spread, higher median at low "
        "load); 0: unpaced",
    )


def _admission_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--admission", choices=("deadline", "fifo"), default="deadline")
    g.add_argument("--default-deadline-ms", type=int, default=30_000, help="budget of calls without a deadline")
    g.add_argument("--safety-margin-ms", type=float, default=20.0)
    g.add_argument("--safety-margin-pct", type=float, default=5.0)
    g.add_argument(
        "--fair-share",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deadline admission keeps headroom for tenants under their fair share and for higher-priority "
        "classes; --no-fair-share: first come, the comparison of old",
    )
    g.add_argument(
        "--hold",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="deadline admission admits a call that fits later inside its slack and holds it for the slot planned "
        "for it, instead of refusing it at once with a reserved retry (the default, which measured better at "
        "capacity: BENCHMARKS.md, 'Holding calls in their slack')",
    )
    g.add_argument(
        "--hold-prompts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="deadline admission admits a call whose prompt waits a few steps for room in the step's token budget "
        "(a burst's prompts), when it still finishes in time; --no-hold-prompts refuses it with a held turn",
    )
    g.add_argument(
        "--hold-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where the KV pool holds fewer calls than the slots could fill, deadline admission admits a call whose "
        "blocks free inside its slack and holds it for them; --no-hold-blocks refuses it with its blocks reserved",
    )
    g.add_argument(
        "--elsewhere",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="other replicas serve the same model behind the same address or balancer, so a saturated replica "
        "points retries at them; off (the default): the replica is alone, and while saturated still reserves "
        "a slot for a refused call's retry inside its budget",
    )
    g.add_argument(
        "--max-reservations",
        type=non_negative_int,
        default=None,
        help="refused calls whose hinted retry may hold a KV slot at once (default: one per slot; 0: none)",
    )


def _ledger_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--data-dir", default=None, help="outbox and default ledger ($ZEROQUEUE_HOME or ~/.zeroqueue)")
    g.add_argument("--ledger", metavar="URL", default=None, help="embedded metering: the ledger database URL")
    g.add_argument(
        "--metering",
        metavar="ADDRESS",
        default=None,
        help="remote metering service; usage is shipped there and API keys checked there",
    )
    g.add_argument(
        "--metering-key",
        default=os.environ.get("ZEROQUEUE_METERING_KEY"),
        help="admin key for --metering (default: $ZEROQUEUE_METERING_KEY)",
    )
    g.add_argument("--metering-ca", metavar="PEM", default=None, help="CA certificates to reach --metering over TLS")
    g.add_argument(
        "--policy-refresh-s",
        type=positive_float,
        default=2.0,
        metavar="S",
        help="how often the serving policy (classes of service, prices, tenants' weights and quotas) is read again "
        "from the ledger or --metering; a failed read keeps the last one",
    )
    g.add_argument(
        "--demo-tenant",
        metavar="NAME",
        default=None,
        help="embedded ledger with no tenant yet: create this one and print its key (make serve)",
    )


def _door_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=50051)
    g.add_argument("--tls-cert", metavar="PEM", default=None, help="serve over TLS: certificate chain")
    g.add_argument("--tls-key", metavar="PEM", default=None, help="serve over TLS: private key")
    g.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve gRPC health in plaintext on this port (for kubelet probes under TLS)",
    )
    g.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI- and Anthropic-compatible HTTP API on this port (/v1/chat/completions, "
        "/v1/completions, /v1/messages, /v1/models), over TLS with --tls-cert",
    )
    g.add_argument(
        "--stream-interval-ms",
        type=non_negative_int,
        default=0,
        metavar="MS",
        help="least time between a call's token messages after its first: tokens in between go in the "
        "next message (first token and end never wait); fewer messages, less CPU on both ends. "
        "0: a message per engine step",
    )
    g.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    g.add_argument("--json-logs", action=argparse.BooleanOptionalAction, default=True)


def add_device_options(p: argparse._ArgumentGroup) -> None:
    """The device's watchdog (services/inference/health/watchdog.py) and faults injected for drills."""
    p.add_argument(
        "--watchdog-period-ms",
        type=non_negative_int,
        default=100,
        help="how often the watchdog judges the device, and probes it while idle; 0: no watchdog",
    )
    p.add_argument(
        "--device-hang-ms",
        type=non_negative_int,
        default=1000,
        help="a device operation running this long (or 8x its calibrated time, if longer) for 3 watchdog periods "
        "fails the device: calls in flight end UNAVAILABLE, billed, and readiness goes NOT_SERVING",
    )
    p.add_argument(
        "--device-recovery-s",
        type=float,
        default=60.0,
        help="a device failed this long takes liveness down too, so the pod is restarted",
    )
    p.add_argument(
        "--inject-fault",
        type=_fault,
        default=None,
        metavar="SPEC",
        help="for tests and drills: slow:FACTOR, hang or fail, with after=SECONDS (from SERVING) and for=SECONDS; "
        "e.g. slow:4,after=10,for=20",
    )


def _fault(text: str):
    from services.inference.health.faults import Fault

    try:
        return Fault.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def device_config(args: argparse.Namespace) -> dict:
    """ServeConfig's device fields from the options of add_device_options."""
    from services.inference.health.watchdog import WatchdogConfig

    watchdog = None
    if args.watchdog_period_ms:
        watchdog = WatchdogConfig(period_s=args.watchdog_period_ms / 1000, min_allowance_s=args.device_hang_ms / 1000)
    return {"watchdog": watchdog, "device_recovery_s": args.device_recovery_s, "fault": args.inject_fault}


def serve_config(args: argparse.Namespace):
    """The replica's ServeConfig from `zeroqueue serve`'s options."""
    from services.inference.device.spec import ExecutorConfig
    from services.inference.policy.gate import PrefixCachePolicy
    from services.inference.serve_config import ServeConfig

    return ServeConfig(
        model_dir=args.model,
        host=args.host,
        port=args.port,
        admission=args.admission,
        fair_share=args.fair_share,
        hold=args.hold,
        hold_prompts=args.hold_prompts,
        hold_blocks=args.hold_blocks,
        elsewhere=args.elsewhere,
        default_deadline_ms=args.default_deadline_ms,
        metrics_port=args.metrics_port,
        dtype=args.dtype,
        executor=ExecutorConfig(
            device=args.device,
            max_batch=args.max_batch,
            max_seq_len=args.max_seq_len,
            kv_memory_bytes=args.kv_memory,
            kv_block_size=args.kv_block_size,
            num_threads=args.threads,
            quantize=args.quantize,
        ),
        max_num_batched_tokens=args.max_batched_tokens,
        prefix_cache=PrefixCachePolicy(not args.no_prefix_cache, args.shared_prefix_cache),
        margin_ms=args.safety_margin_ms,
        margin_fraction=args.safety_margin_pct / 100,
        max_reservations=args.max_reservations,
        data_dir=args.data_dir,
        ledger_url=args.ledger,
        metering_address=args.metering,
        metering_key=args.metering_key,
        metering_ca=args.metering_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        health_port=args.health_port,
        http_port=args.http_port,
        engine_process=not args.engine_thread,
        pin_cpus=args.pin_cpus,
        json_logs=args.json_logs,
        pace_tokens=args.pace_tokens,
        stream_interval_ms=args.stream_interval_ms,
        policy_refresh_s=args.policy_refresh_s,
        **device_config(args),
    )


def run_serve(args: argparse.Namespace) -> int:
    from services.inference.replica import Replica

    config = serve_config(args)
    if args.demo_tenant and not args.metering:
        ensure_demo_tenant(args.ledger, args.demo_tenant, args.data_dir)
    return asyncio.run(_serve(lambda: Replica(config)))


def ensure_demo_tenant(ledger: str | None, name: str, data_dir_arg: str | None) -> None:
    """First run of an embedded ledger: create a tenant and show its key once (also kept, readable by you
    alone, in the data directory, since a demo without its key is no demo)."""
    from billing import commands
    from billing.db import data_dir, default_ledger_url, is_default_data_dir, make_engine, session_factory, unit_of_work
    from billing.private_files import private_dir, write_private
    from billing.tenants import list_tenants

    url = ledger or default_ledger_url()
    engine = make_engine(url)
    try:
        with unit_of_work(session_factory(engine)) as session:
            if list_tenants(session):
                return
    finally:
        engine.dispose()
    key = commands.create_tenant(url, name)
    home = Path(data_dir_arg) if data_dir_arg else data_dir()
    key_file = private_dir(home, narrow_existing=is_default_data_dir(home)) / f"{name}.key"
    write_private(key_file, key + "\n")  # 0600 from its creation, never readable by others first
    print(f"zeroqueue: created tenant {name!r}; its API key (shown once, kept in {key_file}):\n  {key}", flush=True)


async def _serve(make_app) -> int:
    app = make_app()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(app.start())
    while not app.port and not starting.done():
        await asyncio.sleep(0.01)
    print(f"zeroqueue: listening on {app.config.host}:{app.port} (warming up)", flush=True)
    await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        if starting.exception() is not None:
            await app.stop(grace_s=0)
            raise starting.exception()
        print(f"zeroqueue: SERVING on {app.config.host}:{app.port}", flush=True)
        await stop.wait()
    print("zeroqueue: draining", flush=True)
    await app.stop()
    return 0
