"""What a replica serves and whether it serves now: its model card, as ListModels tells it and requests are
checked against, and its warm-up state."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .device.spec import Device


class WarmupState(enum.Enum):
    WARMING_UP = "warming_up"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # the engine died; this replica cannot serve


@dataclass(frozen=True)
class ModelCard:
    """The model this replica serves, as ListModels tells it and requests are checked against: the checkpoint's
    header (device/checkpoint.py) bounded by what the engine made of it once ready (context, slots, device)."""

    name: str
    context_length: int
    dtype: str
    vocab_size: int
    max_batch: int
    device: Device
    kv_blocks: int = 0  # the paged KV cache: blocks of kv_block_size tokens, and whether prompts share them
    kv_block_size: int = 0
    prefix_cache: bool = False
    weight_dtype: str = ""  # the decoder layers' linear weights: "int8" when quantized, else dtype
