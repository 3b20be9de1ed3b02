"""Calibration at warm-up: it measures what a prefill after a cached prefix adds (the prefix blocks really are hit
while it measures), it fits a pool smaller than the slots could fill (a long max_seq_len), and what it measured
crosses the engine's pipe whole."""

from __future__ import annotations

from dataclasses import fields

from services.inference.engine.calibration import PREFILL_ROWS, calibrate
from services.inference.engine.messages import Ready
from tests.inference.conftest import make_engine


def test_calibration_measures_a_prefill_after_a_cached_prefix(llama_dir):
    engine = make_engine(llama_dir, max_batch=4, max_seq_len=256)
    cost = calibrate(engine, num_steps=2, repeats=2)
    pool = engine.scheduler.blocks
    # two runs, each after a prefix of 256 - 64 - 1 tokens rounded down to blocks: 176
    assert pool.num_hit_calls == 2 and pool.num_hit_tokens == 2 * ((256 - PREFILL_ROWS - 1) // 16 * 16)
    assert cost.us_per_prefill_context_token >= 0.0
    assert pool_is_empty(engine), "calibration left blocks held"


def test_calibration_fits_a_pool_smaller_than_the_slots_could_fill(llama_dir):
    # 32 slots of 512 tokens could fill 1,024 blocks; the pool has 40 (the full context, and a little)
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # k and v, 2 layers, 2 heads of 16, 16 tokens, float32
    engine = make_engine(llama_dir, max_batch=32, max_seq_len=512, kv_memory_bytes=41 * block_bytes)
    assert engine.executor.num_blocks == 40
    cost = calibrate(engine, num_steps=2, repeats=1)  # its long-context runs no longer ask for 8 calls of 256 tokens
    assert cost.rows == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # decode steps up to the 32 slots, then prompt chunks
    assert pool_is_empty(engine)


def test_calibration_leaves_out_the_batches_the_pool_cannot_hold(llama_dir):
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4
    engine = make_engine(llama_dir, max_batch=64, max_seq_len=512, kv_memory_bytes=33 * block_bytes)
    cost = calibrate(engine, num_steps=2, repeats=1)  # 64 short calls need 64 blocks: the pool has 32
    assert cost.rows == [1, 2, 4, 8, 16, 32, 128, 256]  # 64 is neither a decode step it can run nor a prompt chunk
    assert cost.raw_step_us(64) > 0 and pool_is_empty(engine)


def pool_is_empty(engine) -> bool:
    return engine.scheduler.blocks.num_used == 0


def test_the_calibrated_model_crosses_the_pipe_whole(llama_dir):
    engine = make_engine(llama_dir, max_batch=2, max_seq_len=128)
    cost = calibrate(engine, num_steps=2, repeats=1)
    ready = Ready(
        engine.executor.info,
        2,
        128,
        256,
        cost_rows=tuple(cost.rows),
        cost_row_us=tuple(cost.row_us),
        cost_us_per_context_token=cost.us_per_context_token,
        cost_us_per_masked_row=cost.us_per_masked_row,
        cost_us_per_logprob_row=cost.us_per_logprob_row,
        cost_us_per_prefill_context_token=cost.us_per_prefill_context_token,
    )
    rebuilt = ready.cost_model()
    calibrated = [f.name for f in fields(cost) if f.name.startswith(("rows", "row_us", "us_per"))]
    assert len(calibrated) == 6
    assert all(getattr(rebuilt, name) == getattr(cost, name) for name in calibrated)
