"""Runs scheduled steps on the device. The only file that touches CUDA.

KV memory is allocated once here. On CUDA, decode-only steps replay a CUDA graph captured per batch-size
bucket over static input buffers; steps with prompt chunks run eagerly. On CPU the same model runs eagerly,
with packed-weight kernels where the CPU supports them. Every step reports its measured device time.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import structlog
import torch

from . import kernels
from .cpus import allowed_cpus, engine_threads
from .packed import pack_model
from .attention import AttentionBackend, AttentionMetadata, KVCache, PrefillChunk
from .loader import Checkpoint
from .model import Transformer
from .nvml import gpu_facts
from .sampler import sample
from .scheduler import ScheduledSeq, SchedulerOutput

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ExecutorConfig:
    device: str = "auto"                    # auto | cpu | cuda | cuda:N
    max_batch: int = 32                     # KV slots, unless kv_memory_bytes allows fewer
    max_seq_len: int = 1024                 # tokens per slot, capped by the model's context
    kv_memory_bytes: int = 2 << 30          # budget for the static KV cache
    num_threads: int = 0                    # CPU threads; 0: all cores this process may use but one
    use_kernels: bool = True                # CPU: packed-weight kernels when the CPU supports them
    use_cuda_graphs: bool = True


@dataclass(frozen=True)
class DeviceInfo:
    kind: str                   # cpu | cuda
    name: str
    device_id: str              # GPU UUID, or cpu:<host>
    num_compute_units: int      # SMs on a GPU, cores on a CPU
    unit: str                   # sm_us | core_us


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]     # request id -> new token
    device_time_us: int         # measured: CUDA events on a GPU, a monotonic clock around the step on CPU
    num_padded_seqs: int        # sequences the step computed, padding of a graph bucket included
    used_graph: bool


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def runs_on_cpu(config: ExecutorConfig) -> bool:
    return _pick_device(config.device).type == "cpu"


def _cpu_threads(requested: int) -> int:
    # One core stays free for the event loop and gRPC: an OpenMP team that shares its cores with another
    # busy thread waits at every barrier (measured here: a 1.7 ms step became 54 ms with 2 threads).
    return engine_threads(requested, allowed_cpus())


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)       # SMs of the device or MIG slice we were given
        torch_uuid = str(props.uuid)
        facts = gpu_facts(torch_uuid)
        if facts is not None:
            uuid = facts.uuid
        elif torch_uuid.startswith(("GPU-", "MIG-")):
            uuid = torch_uuid
        else:       # torch's UUID has no prefix; CUDA names a slice "<GPU> MIG <profile>"
            uuid = ("MIG-" if " MIG " in props.name else "GPU-") + torch_uuid
        return DeviceInfo("cuda", facts.name if facts else props.name, uuid, props.multi_processor_count, "sm_us")
    return DeviceInfo("cpu", "cpu", f"cpu:{os.uname().nodename}", torch.get_num_threads(), "core_us")


class Executor:
    def __init__(self, checkpoint: Checkpoint, config: ExecutorConfig) -> None:
        self.config = config
        self.device = _pick_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(_cpu_threads(config.num_threads))
        args = checkpoint.args
        self.max_seq_len = min(config.max_seq_len, args.max_position_embeddings)
        slot_bytes = KVCache.bytes_per_slot(args.num_hidden_layers, args.num_key_value_heads, self.max_seq_len,
                                            args.head_dim, checkpoint.dtype)
        self.num_slots = max(1, min(config.max_batch, config.kv_memory_bytes // slot_bytes - 1))
        self.model = self._build_model(checkpoint)
        self.kv_cache = KVCache(args.num_hidden_layers, self.num_slots, args.num_key_value_heads, self.max_seq_len,
                                args.head_dim, checkpoint.dtype, self.device)
        # the kernels take bf16 and fp32 weights; fp16 runs on plain torch
        kernel_dtype = checkpoint.dtype in (torch.bfloat16, torch.float32)
        self.cpu_ops = self._cpu_ops() if self.device.type == "cpu" and kernel_dtype else None
        if self.cpu_ops is not None:
            pack_model(self.model, self.cpu_ops)
        # the decode kernel is specialised for the common head sizes; others use the SDPA path
        use_kernel = self.cpu_ops is not None and args.head_dim in kernels.DECODE_HEAD_DIMS
        decode_kernel = self.cpu_ops.decode_attention if use_kernel else None
        self.backend = AttentionBackend(self.kv_cache, decode_kernel)
        self.info = describe_device(self.device)
        self.graphs: GraphRunner | None = None
        if self.device.type == "cuda" and config.use_cuda_graphs:
            self.graphs = GraphRunner(self.model, self.backend, self.num_slots, self.max_seq_len, self.device)
        log.info("executor_ready", device=self.info.name, slots=self.num_slots, max_seq_len=self.max_seq_len,
                 kv_mib=self.kv_cache.num_bytes >> 20, kernels=self.cpu_ops is not None,
                 kernels_isa=self.cpu_ops.isa if self.cpu_ops is not None else None,
                 bf16_linears=self.cpu_ops.bf16_path_name if self.cpu_ops is not None else None,
                 graph_buckets=self.graphs.buckets if self.graphs else [])

    def _build_model(self, checkpoint: Checkpoint) -> Transformer:
        with torch.device("meta"):
            model = Transformer(checkpoint.args, self.max_seq_len)
        model.load_state_dict(checkpoint.state_dict, strict=True, assign=True)
        if checkpoint.args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.build(self.device, checkpoint.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def _cpu_ops(self) -> kernels.CpuOps | None:
        if not self.config.use_kernels:
            return None
        ops = kernels.load_cpu_ops()
        if ops is None:
            log.warning("cpu_kernels_unavailable", reason=kernels.reason_unavailable())
        return ops

    @torch.inference_mode()
    def run(self, step: SchedulerOutput) -> StepResult:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            sampled, padded, used_graph = self._forward_and_sample(step)
            end.record()
            end.synchronize()
            device_us = round(start.elapsed_time(end) * 1000)
        else:
            t0 = time.perf_counter_ns()
            sampled, padded, used_graph = self._forward_and_sample(step)
            device_us = (time.perf_counter_ns() - t0) // 1000
        return StepResult(sampled, device_us, padded, used_graph)

    def _forward_and_sample(self, step: SchedulerOutput) -> tuple[dict[str, int], int, bool]:
        sample_seqs = [s for s in (*step.decodes, *step.prefills) if s.sample]
        if self.graphs is not None and not step.prefills and self.graphs.fits(len(step.decodes)):
            logits, padded = self.graphs.replay(step.decodes)
            used_graph = True
        else:
            logits = self._eager(step)
            padded, used_graph = step.num_seqs, False
        tokens = sample(logits, [s.request.sampling for s in sample_seqs],
                        [s.request.num_output_tokens for s in sample_seqs])
        return {s.request.request_id: t for s, t in zip(sample_seqs, tokens)}, padded, used_graph

    def _eager(self, step: SchedulerOutput) -> torch.Tensor:
        tokens, positions, slots, rows, chunks = [], [], [], [], []
        for seq in step.decodes:
            tokens.append(seq.token_ids[0])
            positions.append(seq.start_pos)
            slots.append(seq.slot)
            rows.append(len(rows))
        for seq in step.prefills:
            offset = len(tokens)
            tokens.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + seq.num_tokens))
            slots.extend([seq.slot] * seq.num_tokens)
            chunks.append(PrefillChunk(offset, seq.num_tokens, seq.slot, seq.start_pos))
            if seq.sample:
                rows.append(offset + seq.num_tokens - 1)
        num_decode = len(step.decodes)
        slot_ids, pos = self._ints(slots), self._ints(positions)
        decode_lens = pos[:num_decode] + 1
        meta = AttentionMetadata(slot_ids=slot_ids, positions=pos, num_decode=num_decode,
                                 decode_slots=slot_ids[:num_decode], decode_lens=decode_lens,
                                 max_decode_len=max(positions[:num_decode], default=0) + 1, prefills=tuple(chunks))
        return self.model(self._ints(tokens), pos, self._ints(rows), self.backend, meta)

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class GraphRunner:
    """One CUDA graph per batch-size bucket, captured over static buffers, for decode-only steps.

    Padded rows write into the scratch slot at position 0 and attend to that one position only. With
    capture=False the same padded static-buffer forward runs eagerly: how the CPU tests and the GPU
    check's dry run exercise everything here but the capture itself.
    """

    def __init__(self, model: Transformer, backend: AttentionBackend, num_slots: int, max_seq_len: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.max_seq_len = max_seq_len
        self.scratch_slot = backend.cache.scratch_slot
        self.buckets = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b < num_slots] + [num_slots]
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=device)
        self.lens = torch.ones(n, dtype=torch.int64, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.host = torch.empty((4, n), dtype=torch.int64, pin_memory=device.type == "cuda")
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.buckets[-1]

    def forward_static(self, bs: int) -> torch.Tensor:
        """The bucket's forward over the static buffers, run eagerly: logits [bs, vocab]."""
        meta = AttentionMetadata(slot_ids=self.slots[:bs], positions=self.positions[:bs], num_decode=bs,
                                 decode_slots=self.slots[:bs], decode_lens=self.lens[:bs],
                                 max_decode_len=self.max_seq_len)
        return self.model(self.input_ids[:bs], self.positions[:bs], self.rows[:bs], self.backend, meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):      # largest first, so smaller graphs reuse its memory pool
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward_static(bs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward_static(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()

    def prepare(self, decodes: tuple[ScheduledSeq, ...]) -> int:
        """Copies the step's inputs into the static buffers, padded to its bucket; returns the bucket."""
        n = len(decodes)
        bs = next(b for b in self.buckets if b >= n)
        host = self.host[:, :bs]
        host[0].zero_()
        host[1].zero_()
        host[2].fill_(self.scratch_slot)
        host[3].fill_(1)
        host[0, :n] = torch.tensor([s.token_ids[0] for s in decodes])
        host[1, :n] = torch.tensor([s.start_pos for s in decodes])
        host[2, :n] = torch.tensor([s.slot for s in decodes])
        host[3, :n] = host[1, :n] + 1
        for buffer, row in zip((self.input_ids, self.positions, self.slots, self.lens), host):
            buffer[:bs].copy_(row, non_blocking=True)
        return bs

    def replay(self, decodes: tuple[ScheduledSeq, ...]) -> tuple[torch.Tensor, int]:
        """logits [n, vocab] of a decode-only step, from the bucket's graph (or eagerly when not captured)."""
        bs = self.prepare(decodes)
        if bs not in self.graphs:
            return self.forward_static(bs)[:len(decodes)], bs
        graph, logits = self.graphs[bs]
        graph.replay()
        return logits[:len(decodes)], bs
