"""Runs scheduled steps on the device. With cuda_graphs.py, the only file that touches CUDA.

KV memory is allocated once here. On CUDA, decode-only steps replay a CUDA graph captured per batch and
context bucket over static input buffers (cuda_graphs.py); steps with prompt chunks run eagerly. On CPU the
same model runs eagerly, with packed-weight kernels where the CPU supports them. Every step reports its
measured device time.
"""

from __future__ import annotations

import os
import time

import structlog
import torch

from ..sched.scheduler import SchedulerOutput
from . import kernels
from .attention import AttentionBackend, AttentionMetadata, KVCache, PrefillChunk
from .cpus import allowed_cpus, engine_threads
from .cuda_graphs import GraphRunner, attention_kernels
from .loader import Checkpoint
from .model import Transformer
from .nvml import gpu_facts
from .packed import pack_model
from .quant import fake_quantize_linears, fp8_layers
from .sampler import draw_step
from .spec import QUANTIZE_CHOICES, Device, ExecutorConfig, StepResult

log = structlog.get_logger(__name__)
PROBE_SIZE = 128  # the probe's square fp32 matmul: about 4 MFLOP, tens of µs on one core


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def runs_on_cpu(config: ExecutorConfig) -> bool:
    return _pick_device(config.device).type == "cpu"


def _cpu_threads(requested: int) -> int:
    # One core stays free for the event loop and gRPC: an OpenMP team that shares its cores with another
    # busy thread waits at every barrier (measured here: a 1.7 ms step became 54 ms with 2 threads).
    return engine_threads(requested, allowed_cpus())


def describe_device(device: torch.device) -> Device:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)  # SMs of the device or MIG slice we were given
        torch_uuid = str(props.uuid)
        facts = gpu_facts(torch_uuid)
        if facts is not None:
            uuid = facts.uuid
        elif torch_uuid.startswith(("GPU-", "MIG-")):
            uuid = torch_uuid
        else:  # torch's UUID has no prefix; CUDA names a slice "<GPU> MIG <profile>"
            uuid = ("MIG-" if " MIG " in props.name else "GPU-") + torch_uuid
        return Device("cuda", facts.name if facts else props.name, uuid, props.multi_processor_count, "sm_us")
    return Device("cpu", "cpu", f"cpu:{os.uname().nodename}", torch.get_num_threads(), "core_us")


class Executor:
    def __init__(self, checkpoint: Checkpoint, config: ExecutorConfig) -> None:
        if config.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, not {config.quantize!r}")
        self.config = config
        self.device = _pick_device(config.device)
        if self.device.type == "cpu":
            torch.set_num_threads(_cpu_threads(config.num_threads))
        else:  # streams, events and graphs go to the current device: make it ours (cuda:N, N > 0)
            torch.cuda.set_device(self.device)
        args = checkpoint.args
        self._plan_pool(checkpoint)
        self.model = self._build_model(checkpoint)
        self.kv_cache = KVCache(
            args.num_hidden_layers,
            self.num_blocks,
            args.num_key_value_heads,
            self.block_size,
            args.head_dim,
            checkpoint.dtype,
            self.device,
        )
        # the kernels take bf16 and fp32 weights; fp16 runs on plain torch
        kernel_dtype = checkpoint.dtype in (torch.bfloat16, torch.float32)
        self.cpu_ops = self._cpu_ops() if self.device.type == "cpu" and kernel_dtype else None
        # a pre-quantized checkpoint is served as int8 whatever config.quantize says: its weights are int8 values
        self.quantize = "int8" if checkpoint.int8 else config.quantize
        # what ListModels and each usage record say the weights are held in
        self.weight_dtype = str(checkpoint.dtype).removeprefix("torch.") if self.quantize == "none" else self.quantize
        if self.cpu_ops is not None and self.quantize != "fp8":
            pack_model(self.model, self.cpu_ops, self.quantize, checkpoint.int8)
        else:  # fp8 refuses a CPU here
            self._quantize_plain(checkpoint)
        # the decode kernel is specialised for the common head sizes; others use the SDPA path
        use_kernel = self.cpu_ops is not None and args.head_dim in kernels.DECODE_HEAD_DIMS
        decode_kernel = self.cpu_ops.decode_attention if use_kernel else None
        self.backend = AttentionBackend(self.kv_cache, decode_kernel)
        self.info = describe_device(self.device)
        # the watchdog's probe (health/watchdog.py): one small matmul, on a stream of its own on a GPU
        self._probe_in = torch.ones(PROBE_SIZE, PROBE_SIZE, device=self.device)
        self._probe_out = torch.empty_like(self._probe_in)
        self._probe_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.graphs: GraphRunner | None = None
        if self.device.type == "cuda" and config.use_cuda_graphs:
            self.graphs = GraphRunner(self.model, self.backend, self.num_slots, self.max_seq_len, self.device)
        self._log_ready()

    def _plan_pool(self, checkpoint: Checkpoint) -> None:
        """The context, the slots and the paged KV pool's blocks, within the KV memory the config gives."""
        args, config = checkpoint.args, self.config
        self.max_seq_len = min(config.max_seq_len, args.max_position_embeddings)
        self.block_size = config.kv_block_size
        block_bytes = KVCache.bytes_per_block(
            args.num_hidden_layers, args.num_key_value_heads, self.block_size, args.head_dim, checkpoint.dtype
        )
        blocks_per_seq = -(-self.max_seq_len // self.block_size)
        # the scratch block comes out of the budget too
        budget_blocks = config.kv_memory_bytes // block_bytes - 1
        if budget_blocks < blocks_per_seq:
            need_mib = -(-(blocks_per_seq + 1) * block_bytes // (1 << 20))
            raise ValueError(
                f"the KV memory ({config.kv_memory_bytes >> 20} MiB) holds fewer than one call of max_seq_len "
                f"{self.max_seq_len} tokens: give it at least {need_mib} MiB or a shorter max_seq_len"
            )
        # Slots are rows of the batch, not memory: a call holds the blocks of its own prompt and max_tokens, so a
        # long max_seq_len no longer divides the calls that run at once; where the slots could fill more blocks
        # than the pool has, admission (or the engine's scheduler) counts the blocks as it counts the slots.
        self.num_slots = config.max_batch
        # Up to twice the blocks the slots can fill, where memory allows: deadline admission reserves a call's
        # blocks when it admits it, and a call admitted into a slot that frees at the end of the running step needs
        # its blocks while its predecessor still holds its own (services/inference/kv_pool.py); the rest hold
        # cached prefixes. A pool the size of the whole budget would only cost startup time on a small model.
        self.num_blocks = min(2 * self.num_slots * blocks_per_seq, budget_blocks)

    def _log_ready(self) -> None:
        log.info(
            "executor_ready",
            device=self.info.name,
            slots=self.num_slots,
            max_seq_len=self.max_seq_len,
            kv_blocks=self.num_blocks,
            kv_block_size=self.block_size,
            kv_mib=self.kv_cache.num_bytes >> 20,
            kernels=self.cpu_ops is not None,
            kernels_isa=self.cpu_ops.isa if self.cpu_ops is not None else None,
            bf16_linears=self.cpu_ops.bf16_path_name if self.cpu_ops is not None else None,
            int_linears=self.cpu_ops.int_path if self.cpu_ops is not None else None,
            quantize=self.quantize,
            graph_buckets=self.graphs.buckets if self.graphs else [],
            graph_contexts=self.graphs.context_buckets if self.graphs else [],
        )

    def _build_model(self, checkpoint: Checkpoint) -> Transformer:
        with torch.device("meta"):
            model = Transformer(checkpoint.args, self.max_seq_len)
        model.load_state_dict(checkpoint.state_dict, strict=True, assign=True)
        if checkpoint.args.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary.build(self.device, checkpoint.dtype)
        return model.to(self.device).eval().requires_grad_(False)

    def _quantize_plain(self, checkpoint: Checkpoint) -> None:
        """--quantize without the CPU kernels: fp8 on a CUDA device that has it; int8 and int4 as their values
        (correct, not faster: quant.py)."""
        if self.quantize == "fp8":
            if self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (8, 9):
                raise ValueError("quantize fp8 needs a CUDA device of compute capability 8.9 or above (Ada, Hopper)")
            if checkpoint.dtype != torch.bfloat16:
                raise ValueError(f"quantize fp8 serves bfloat16 activations, not {checkpoint.dtype}")
            fp8_layers(self.model.layers)
        elif self.quantize == "int8":
            log.warning("int8_without_kernels", why=f"no CPU kernels here: int8 values computed in {checkpoint.dtype}")
            # a pre-quantized checkpoint's layers hold their int8 values already; its LM head is quantized here
            fake_quantize_linears(*(() if checkpoint.int8 else (self.model.layers,)), self.model.lm_head)
        elif self.quantize == "int4":
            log.warning("int4_without_kernels", why=f"no CPU kernels here: int4 values computed in {checkpoint.dtype}")
            fake_quantize_linears(self.model.layers, bits=4)
            fake_quantize_linears(self.model.lm_head)  # int8, as on the kernels (packed.pack_model)

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
            # the events bracket the forward alone: sampling runs on the host while the device is idle
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits, padded, used_graph = self._forward(step)
            end.record()
            sampled, logprobs, errors, masked = self._sample(step, logits)
            end.synchronize()
            device_us = round(start.elapsed_time(end) * 1000)
        else:
            t0 = time.perf_counter_ns()
            logits, padded, used_graph = self._forward(step)
            sampled, logprobs, errors, masked = self._sample(step, logits)
            device_us = (time.perf_counter_ns() - t0) // 1000
        return StepResult(sampled, device_us, padded, used_graph, logprobs, errors, masked)

    @torch.inference_mode()
    def probe(self) -> None:
        """A tiny operation on the device, waited for: the watchdog times it while the engine idles. On a GPU it
        runs on its own stream, so it neither waits behind a step's work nor holds one up."""
        if self._probe_stream is None:
            torch.mm(self._probe_in, self._probe_in, out=self._probe_out)
            return
        with torch.cuda.stream(self._probe_stream):
            torch.mm(self._probe_in, self._probe_in, out=self._probe_out)
        self._probe_stream.synchronize()

    def _forward(self, step: SchedulerOutput) -> tuple[torch.Tensor, int, bool]:
        """(logits [rows to sample, vocab], rows computed with padding, whether a graph ran)."""
        if self.graphs is not None and not step.prefills and self.graphs.fits(len(step.decodes)):
            logits, bucket = self.graphs.replay(step.decodes)
            return logits, bucket.batch, True
        with attention_kernels(self.device):
            return self._eager(step), step.num_seqs, False

    def _sample(
        self, step: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[dict[str, int], dict[str, tuple], dict[str, str], int]:
        """(call id -> token, call id -> its log-probabilities, call id -> why its grammar failed, masked rows)."""
        seqs = [s for s in (*step.decodes, *step.prefills) if s.sample]
        requests = [s.request for s in seqs]
        matchers = [r.matcher for r in requests] if any(r.matcher is not None for r in requests) else None
        apply_mask = self.cpu_ops.apply_token_bitmask if self.cpu_ops is not None else None
        draws = draw_step(
            logits, [r.sampling for r in requests], [r.num_output_tokens for r in requests], matchers, apply_mask
        )
        ids = [r.call_id for r in requests]
        return (
            dict(zip(ids, draws.tokens)),
            {ids[row]: lp for row, lp in draws.logprobs.items()},
            {ids[row]: why for row, why in draws.grammar_errors.items()},
            len(matchers) - matchers.count(None) if matchers is not None else 0,
        )

    def _eager(self, step: SchedulerOutput) -> torch.Tensor:
        tokens, positions, slots, rows, chunks, row_seq = [], [], [], [], [], []
        bs = self.block_size
        seqs = (*step.decodes, *step.prefills)
        for i, seq in enumerate(step.decodes):
            tokens.append(seq.token_ids[0])
            positions.append(seq.start_pos)
            slots.append(seq.block_ids[seq.start_pos // bs] * bs + seq.start_pos % bs)
            rows.append(i)
            row_seq.append(i)
        for i, seq in enumerate(step.prefills, start=len(step.decodes)):
            offset = len(tokens)
            tokens.extend(seq.token_ids)
            span = range(seq.start_pos, seq.start_pos + seq.num_tokens)
            positions.extend(span)
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in span)
            row_seq.extend([i] * seq.num_tokens)
            chunks.append(PrefillChunk(offset, seq.num_tokens, seq.start_pos))
            if seq.sample:
                rows.append(offset + seq.num_tokens - 1)
        num_decode = len(step.decodes)
        pos = self._ints(positions)
        # each sequence's table, cut to the blocks this step reads, padded with the scratch block: [S, M]
        width = max(-(-(s.start_pos + s.num_tokens) // bs) for s in seqs)
        scratch = self.kv_cache.scratch_block
        tables = [[*s.block_ids[:width], *[scratch] * (width - min(width, len(s.block_ids)))] for s in seqs]
        meta = AttentionMetadata(
            slot_mapping=self._ints(slots),
            positions=pos,
            num_decode=num_decode,
            block_tables=self._ints(tables)[self._ints(row_seq)],  # [T, M]
            decode_lens=pos[:num_decode] + 1,
            max_decode_len=max(positions[:num_decode], default=0) + 1,
            prefills=tuple(chunks),
        )
        return self.model(self._ints(tokens), pos, self._ints(rows), self.backend, meta)

    def _ints(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
