"""Wires a serving replica: gRPC server (inference, health, reflection), warm-up and calibration,
the engine (its own process by default, engine/core.py), Prometheus metrics, and a graceful drain on
shutdown."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import start_http_server
from zeroqueue.inference.v1 import inference_pb2

from billing.db import data_dir
from billing.policy import ServingPolicy
from services.http.door import HttpDoor
from services.metering.link import MeteringLink
from services.metering.server import MAX_MESSAGE_BYTES as METERING_MAX_MESSAGE_BYTES
from services.metering.server import server_credentials
from services.standard import SERVICE_NAMES as STANDARD_SERVICES
from services.standard import add_health, enable_reflection

from .admission import Admission, AdmissionConfig, AdmissionController, FifoAdmission
from .card import ModelCard, WarmupState
from .chat import ChatTemplate, stop_token_ids
from .clock import Clock
from .compiler import GrammarCompiler
from .cost.model import CostModel
from .device.checkpoint import read_header
from .device.cpus import pin
from .device.telemetry import GpuTelemetry
from .engine.client import EngineClient
from .engine.handle import EngineHandle
from .engine.messages import EngineSpec, Ready
from .engine.thread import EngineThread
from .generate_request import RequestLimits
from .grammar import GrammarLimits
from .health.reaction import DeviceReaction
from .health.state import DeviceState
from .kv_pool import KvReservations
from .meter import Meter
from .metrics import ServiceMetrics, StepLog, StepStats
from .policy import PolicyBook, QuotaGate, ledger_reader, remote_reader, weights_of
from .serve_config import ServeConfig
from .service import InferenceService
from .servicer import InferenceServicer

log = structlog.get_logger(__name__)
INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
LIVENESS = "liveness"
# gRPC's own default receive limit, and the least this server takes: a request up to it that is too large for the
# model is parsed by us and refused OUT_OF_RANGE naming its field; above it gRPC answers a bare RESOURCE_EXHAUSTED
MIN_RECEIVE_BYTES = 4 << 20
SERVER_OPTIONS = [
    # a request's headers: up to 16 KiB, always taken (so that a bad one gets a status naming it, from us); gRPC's
    # default soft limit of 8 KiB refuses some calls between the two at random, RESOURCE_EXHAUSTED without details
    ("grpc.max_metadata_size", 16 << 10),
    ("grpc.absolute_max_metadata_size", 16 << 10),
    # clients re-resolve DNS only when a connection ends: recycle them, so new replicas get traffic
    ("grpc.max_connection_age_ms", 5 * 60_000),
    ("grpc.max_connection_age_grace_ms", 2 * 60_000),  # streams in flight finish first
]


def receive_limit(limits: RequestLimits, context_length: int, hosts_metering: bool) -> int:
    """grpc.max_receive_message_length: the largest valid Generate request for this context (Generate checks
    that exact bound itself, before parsing), or a RecordUsage batch when the replica hosts Metering, and at
    least gRPC's default."""
    hosted = METERING_MAX_MESSAGE_BYTES if hosts_metering else 0
    return max(MIN_RECEIVE_BYTES, limits.max_request_bytes(context_length), hosted)


def drain_grace_s(default_deadline_ms: int) -> float:
    """How long a draining replica waits for admitted calls: the longest default budget, plus a second."""
    return default_deadline_ms / 1000 + 1


class Replica:
    """One serving replica; construct it inside a running event loop. This process reads the checkpoint's header
    (config and tokenizer) and never imports torch: the weights and the device are the engine's (`make_executor`,
    a module-level callable that crosses into the engine process by reference; None: the device's Executor,
    imported there)."""

    def __init__(self, config: ServeConfig, make_executor: Callable[..., Any] | None = None) -> None:
        self.config = config
        self.make_executor = make_executor
        self.clock = Clock()
        self.metrics = ServiceMetrics()
        self.header = read_header(config.model_dir, config.dtype)  # the checkpoint's; the card is made once ready
        self.credentials = server_credentials(config.tls_cert, config.tls_key)
        self.link = MeteringLink(
            Path(config.data_dir) if config.data_dir else data_dir(),
            config.ledger_url,
            config.metering_address,
            config.metering_key,
            config.metering_ca,
        )
        if self.link.channel is not None:  # remote metering: GetServingPolicy under the replica's admin key
            read = remote_reader(self.link.channel, config.metering_key or "")
        else:
            read = ledger_reader(self.link.sessions)
        self.book = PolicyBook(read, config.policy_refresh_s, self._policy_read)
        self.chat = ChatTemplate.from_dir(self.header.path)  # None: the model has none, and messages are refused
        chat_stops = stop_token_ids(self.chat, self.header.tokenizer) if self.chat is not None else frozenset()
        self.servicer = InferenceServicer(
            self.header.name,
            self.header.tokenizer,
            self.link.authenticator,
            config.limits,
            self.book,
            self.chat,
            chat_stops,
            config.elsewhere,
        )
        self.meter: Meter | None = None
        self.telemetry: GpuTelemetry | None = None
        self.health = health_aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.engine: EngineHandle | None = None
        self.cost: CostModel | None = None
        self.reaction: DeviceReaction | None = None  # to the device's state (health/reaction.py), once warm
        self.port = 0
        self.http: HttpDoor | None = None
        self.http_port = 0

    @property
    def service(self) -> InferenceService | None:
        return self.servicer.service

    @property
    def context_length(self) -> int:
        """The context the engine will serve, known before it starts: the executor caps it the same way."""
        return min(self.config.executor.max_seq_len, self.header.args.max_position_embeddings)

    def receive_bytes(self, context_length: int) -> int:
        return receive_limit(self.config.limits, context_length, self.link.hosts_metering)

    async def start(self) -> int:
        """Listens at once (health says NOT_SERVING), warms up and calibrates, then says SERVING."""
        context_length = self.context_length
        self.server = grpc.aio.server(
            options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", self.receive_bytes(context_length))]
        )
        self.servicer.add_to_server(self.server, context_length)
        add_health(self.server, self.health)
        hosted = self.link.attach(self.server)
        # method names resolve too (grpcurl describe pkg.Service.Method): services/standard.py
        enable_reflection((INFERENCE_SERVICE, *hosted, *STANDARD_SERVICES), self.server)
        address = f"{self.config.host}:{self.config.port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        for name in ("", INFERENCE_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in (LIVENESS, *hosted):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        await self.server.start()
        if self.config.health_port is not None:
            self.health_server = grpc.aio.server()
            add_health(self.health_server, self.health)
            self.health_server.add_insecure_port(f"{self.config.host}:{self.config.health_port}")
            await self.health_server.start()
        self.link.start()
        self.book.start()
        if self.config.http_port is not None:  # answers 503 while warming, as gRPC says UNAVAILABLE
            self.http = HttpDoor(self.servicer, self.metrics.registry)
            tls = (self.config.tls_cert, self.config.tls_key) if self.credentials is not None else None
            self.http_port = await self.http.start(self.config.host, self.config.http_port, tls)
        if self.config.metrics_port is not None:
            start_http_server(self.config.metrics_port, addr=self.config.host, registry=self.metrics.registry)
        log.info("listening", address=f"{self.config.host}:{self.port}", state="warming_up")
        service = await asyncio.to_thread(self._warm_up)
        readiness = ("", INFERENCE_SERVICE)
        recovery_s = self.config.device_recovery_s
        self.reaction = DeviceReaction(service, self.cost, self.metrics, self._health, readiness, LIVENESS, recovery_s)
        self.engine.start()
        # fair share weighs tenants as the ledger says
        self.book.subscribe(lambda policy: service.admission.set_weights(weights_of(policy)))
        if not await self.book.first_read():  # the ledger's classes and caps before the first call
            log.warning("serving_without_policy", why="the first read of the serving policy failed; it is retried")
        service.state = WarmupState.READY
        self.servicer.service = service
        for name in ("", INFERENCE_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        # what start-up made (the tokenizer, the protobuf and SQLAlchemy machinery, the cost model) lives as long as
        # the replica: out of the collector's reach, a full collection no longer walks it, and a refusal, the
        # common answer under overload, no longer pays for those walks (bench/refusal_cost.py)
        gc.freeze()
        log.info("serving", address=f"{self.config.host}:{self.port}", admission=self.config.admission)
        return self.port

    def _warm_up(self) -> InferenceService:
        engine, ready = self._launch_engine()
        cost = self.cost = ready.cost_model()
        admission, observed_cost, kv = self._admission(ready, cost, engine)
        steps = StepLog()
        pace_tokens = self.config.pace_tokens
        stats = StepStats(observed_cost, self.metrics, ready.num_slots, steps, pace_tokens, admission.step_ended)
        engine.observers.append(stats)
        pool = kv.pool if kv is not None else None
        self.metrics.kv_pool.watch(ready.num_kv_blocks, (lambda: pool.counts) if pool else (lambda: stats.kv_counts))
        header, kv_facts = self.header, (ready.num_kv_blocks, ready.kv_block_size, self.config.prefix_cache.enabled)
        facts = (ready.max_seq_len, header.dtype, header.args.vocab_size, ready.num_slots, ready.device, *kv_facts)
        card = ModelCard(header.name, *facts, weight_dtype=ready.weight_dtype)
        self.meter = Meter(
            ready.device,
            card.name,
            uuid.uuid4().hex[:12],
            self.clock.epoch_us,
            self.link.outbox.append,
            started_ns=self.clock.now_ns(),
            count=self.metrics.count_usage,
            weight_dtype=card.weight_dtype,  # every usage record says what the weights are held in (int8: quantized)
        )
        self.metrics.compute_units.set(ready.device.num_units)
        self.telemetry = self.metrics.watch_device(ready.device)
        engine.observers.append(self.meter)
        self.engine = engine
        self.servicer.compiler = self._grammar_compiler()
        if (why := self.servicer.compiler.support_error(self.header.tokenizer)) != "":
            log.warning("response_formats_off", why=why)  # a call with one is refused, saying why
            self.servicer.compiler, self.servicer.formats_off = None, why
        return InferenceService(
            engine,
            card,
            admission,
            self.metrics,
            self.clock,
            self.meter,
            self.link.outbox,
            steps,
            self.config.default_deadline_ms,
            self.config.stream_interval_ms,
            QuotaGate(self.book),
            self.config.prefix_cache,
            kv,
        )

    def _launch_engine(self) -> tuple[EngineHandle, Ready]:
        """The engine, in its own process (or on a thread with --engine-thread), loaded, warmed up and calibrated;
        this process pinned to the cores the engine left it."""
        spec = EngineSpec(
            str(self.header.path),
            self.config.dtype,
            self.config.executor,
            self.config.max_num_batched_tokens,
            make_executor=self.make_executor,
            json_logs=self.config.json_logs,
            pace_tokens=self.config.pace_tokens,
            pin_cpus=self.config.pin_cpus,
            watchdog=self.config.watchdog,
            fault=self.config.fault,
            earliest_deadline_first=self.config.admission != "fifo",
        )
        make_engine = EngineClient if self.config.engine_process else EngineThread
        engine = make_engine(spec, self.clock.now_ns, on_lost=self._engine_lost, on_verdict=self._device_changed)
        ready = engine.launch()
        if ready.server_cpus:  # the engine process pinned itself to cores of its own: this process takes the rest
            pin(ready.server_cpus)
            log.info("cpus_pinned", engine=list(ready.engine_cpus), server=list(ready.server_cpus))
        return engine, ready

    def _admission(
        self, ready: Ready, cost: CostModel, engine: EngineHandle
    ) -> tuple[Admission, CostModel | None, KvReservations | None]:
        """(admission, the cost model the steps teach: None for FIFO, the pool of KV blocks admission reserves: None
        for FIFO, whose engine reserves them as calls start)."""
        if self.config.admission == "fifo":
            return FifoAdmission(), None, None
        config = self.config
        admission_config = AdmissionConfig(
            ready.num_slots,
            ready.max_num_batched_tokens,
            config.margin_ms,
            config.margin_fraction,
            pace_tokens=config.pace_tokens,
        )
        kv = KvReservations(ready.num_kv_blocks, ready.kv_block_size, ready.num_slots, ready.max_seq_len)
        admission = AdmissionController(
            cost, admission_config, config.admission_settings(), kv=kv if kv.planned else None
        )
        self.metrics.watch_reservations(admission.events)
        engine.set_expiry_guard(int(cost.step_us(ready.num_slots) * 1000))
        return admission, cost, kv

    def _grammar_compiler(self) -> GrammarCompiler:
        """The server's grammar compiler, its compile times calibrated (on the warm-up thread)."""
        header = self.header
        compiler = GrammarCompiler(
            header.tokenizer, (*header.eos_token_ids, *self.servicer.chat_stop_token_ids), GrammarLimits()
        )
        compiler.calibrate()
        log.info(
            "grammar_compiler_calibrated", base_us=round(compiler.cost.base_us), us_per_byte=compiler.cost.us_per_byte
        )
        return compiler

    def _policy_read(self, ok: bool, policy: ServingPolicy) -> None:
        self.metrics.count_policy_refresh(ok, policy.read_at_us or time.time_ns() // 1000)

    def _engine_lost(self, why: str) -> None:
        """The engine process died: this replica cannot serve; clients go elsewhere (UNAVAILABLE)."""
        if self.service is not None:
            self.service.state = WarmupState.FAILED
        log.error("replica_failed", why=why)
        # liveness too: only a restart brings it back
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, "", INFERENCE_SERVICE, LIVENESS)

    def _device_changed(self, state: DeviceState, ratio: float, why: str) -> None:
        """The engine's watchdog changed its verdict on the device (on the event loop): the one reaction, once
        this replica serves."""
        if self.service is not None and self.reaction is not None:
            self.reaction(state, ratio, why)

    def _health(self, serving: bool, names: tuple[str, ...]) -> None:
        self._set_health(
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING, *names
        )

    def _set_health(self, status: int, *names: str) -> None:
        loop = asyncio.get_running_loop()
        for name in names:
            loop.create_task(self.health.set(name, status))

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops admitting (NOT_SERVING), lets admitted calls finish inside their deadlines, then exits.
        By default it waits as long as the longest default budget, since no admitted call outlives its own."""
        if grace_s is None:
            grace_s = drain_grace_s(self.config.default_deadline_ms)
        for name in ("", INFERENCE_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        service = self.service
        if service is not None:
            service.start_draining()
            try:
                await asyncio.wait_for(service.drained.wait(), grace_s)
            except TimeoutError:
                log.warning("drain_timeout", in_flight=len(service.in_flight))
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        if self.health_server is not None:
            await self.health_server.stop(grace=0)
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)
        if self.meter is not None:
            self.meter.on_idle(self.clock.now_ns(), final=True)
        await self.book.stop()
        await self.link.stop()
        if self.telemetry is not None:
            self.telemetry.close()
        log.info("stopped")
