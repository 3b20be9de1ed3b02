"""CUDA graphs for decode-only steps, and the attention kernels every CUDA forward may use. With executor.py,
the only file that touches CUDA.

A graph is captured per (batch bucket, context bucket) over static input buffers. The context bucket bounds
how far back a replay's attention reads the cache: without it every replay would gather and attend over the
whole configured context, so a step's cost would follow `max_seq_len` rather than the calls' real lengths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..sched.scheduler import ScheduledSeq
from .attention import AttentionBackend, AttentionMetadata
from .model import Transformer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_CONTEXT_BUCKET = 128
# cuDNN's attention builds a plan per (batch, key length) shape; eager decode lengths change every step, so
# each eager step would pay for a new plan (tens of ms). Graphs and eager steps use the same kernels.
CUDA_ATTENTION_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


class Bucket(NamedTuple):
    batch: int  # rows the graph computes, padding included
    context: int  # cache positions [0, context) its attention reads


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a forward on `device` may pick (all of them off CUDA)."""
    return sdpa_kernel(list(CUDA_ATTENTION_KERNELS)) if device.type == "cuda" else contextlib.nullcontext()


def context_buckets(max_seq_len: int) -> list[int]:
    """Powers of two from MIN_CONTEXT_BUCKET below max_seq_len, then max_seq_len itself."""
    buckets, c = [], MIN_CONTEXT_BUCKET
    while c < max_seq_len:
        buckets.append(c)
        c *= 2
    return buckets + [max_seq_len]


class GraphRunner:
    """One CUDA graph per bucket, captured over static buffers, for decode-only steps.

    Padded rows write into the scratch block at offset 0 and attend to that one position only. With
    capture=False the same padded static-buffer forward runs eagerly: how the CPU tests and the GPU
    check's dry run exercise everything here but the capture itself.
    """

    def __init__(
        self,
        model: Transformer,
        backend: AttentionBackend,
        num_slots: int,
        max_seq_len: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model, self.backend, self.device = model, backend, device
        cache = backend.cache
        self.scratch_block, self.block_size = cache.scratch_block, cache.block_size
        self.buckets = [b for b in BATCH_BUCKETS if b < num_slots] + [num_slots]
        self.context_buckets = context_buckets(max_seq_len)
        n, width = self.buckets[-1], -(-max_seq_len // cache.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), self.scratch_block * self.block_size, dtype=torch.int64, device=device)
        self.lens = torch.ones(n, dtype=torch.int64, device=device)
        self.tables = torch.full((n, width), self.scratch_block, dtype=torch.int64, device=device)  # [n, M]
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self.host = torch.empty((4, n), dtype=torch.int64, pin_memory=pinned)
        self.host_tables = torch.empty((n, width), dtype=torch.int64, pin_memory=pinned)
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    def fits(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.buckets[-1]

    def bucket(self, decodes: Sequence[ScheduledSeq]) -> Bucket:
        """The smallest bucket that holds these rows and the longest of their contexts (the new token's too)."""
        n, longest = len(decodes), max(s.start_pos for s in decodes) + 1
        return Bucket(next(b for b in self.buckets if b >= n), next(c for c in self.context_buckets if c >= longest))

    def forward_static(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's forward over the static buffers, run eagerly: logits [batch, vocab]."""
        bs = bucket.batch
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            positions=self.positions[:bs],
            num_decode=bs,
            block_tables=self.tables[:bs, : -(-bucket.context // self.block_size)],
            decode_lens=self.lens[:bs],
            max_decode_len=bucket.context,
        )
        return self.model(self.input_ids[:bs], self.positions[:bs], self.rows[:bs], self.backend, meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # largest first, so the smaller graphs reuse the largest one's memory pool
        for context in reversed(self.context_buckets):
            for bs in reversed(self.buckets):
                bucket = Bucket(bs, context)
                with attention_kernels(self.device):
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(2):
                            self.forward_static(bucket)
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        logits = self.forward_static(bucket)
                pool = graph.pool() if pool is None else pool
                self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize()

    def prepare(self, decodes: Sequence[ScheduledSeq]) -> Bucket:
        """Copies the step's inputs into the static buffers, padded to its bucket; returns the bucket."""
        n, bucket = len(decodes), self.bucket(decodes)
        bs, width = self.block_size, -(-bucket.context // self.block_size)
        host, tables = self.host[:, : bucket.batch], self.host_tables[: bucket.batch, :width]
        host[0].zero_()
        host[1].zero_()
        host[2].fill_(self.scratch_block * bs)
        host[3].fill_(1)
        tables.fill_(self.scratch_block)
        host[0, :n] = torch.tensor([s.token_ids[0] for s in decodes])
        host[1, :n] = torch.tensor([s.start_pos for s in decodes])
        host[2, :n] = torch.tensor([s.block_ids[s.start_pos // bs] * bs + s.start_pos % bs for s in decodes])
        host[3, :n] = host[1, :n] + 1
        for row, s in enumerate(decodes):
            used = s.block_ids[:width]
            tables[row, : len(used)] = torch.tensor(used)
        for buffer, row in zip((self.input_ids, self.positions, self.slot_mapping, self.lens), host):
            buffer[: bucket.batch].copy_(row, non_blocking=True)
        self.tables[: bucket.batch, :width].copy_(tables, non_blocking=True)
        return bucket

    def replay(self, decodes: Sequence[ScheduledSeq]) -> tuple[torch.Tensor, Bucket]:
        """logits [n, vocab] of a decode-only step, from the bucket's graph (or eagerly when not captured)."""
        bucket = self.prepare(decodes)
        if bucket not in self.graphs:
            return self.forward_static(bucket)[: len(decodes)], bucket
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[: len(decodes)], bucket
