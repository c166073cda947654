"""The kernel benchmark's serving-shaped step (benchmarks/decode_step.py), small, on the CPU: the
fused plan (one block through per-head tables, what CUDA runs) and the padded blocks compute the
same attention and the same statistics."""

from __future__ import annotations

import pytest
import torch

import sgl_kvc.core.decode as decode_module
from benchmarks.decode_step import StepShape, serving_step

SHAPE = StepShape(layers=2, q_heads=6, kv_heads=2, head_dim=16, budget=24, buffer=16, window=4, dtype=torch.float32)


def test_fused_and_padded_steps_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_module, "DECODE_BLOCK_ELEMS", 40 * SHAPE.kv_heads * SHAPE.head_dim)  # blocks of ~1
    results = []
    for fused in (True, False):
        store, step, out = serving_step(12, SHAPE, ("rkv", "h2o", "kvcompress"), "cpu", fused=fused)
        step()
        plan = store.decode_step
        assert plan.fused is fused and (len(plan.blocks) == 1) is fused
        results.append((out.clone(), {row: s.stats[1].clone() for row, s in store.states.items() if s.stats[1] is not None}))
    (fused_out, fused_stats), (padded_out, padded_stats) = results
    assert torch.allclose(fused_out, padded_out, atol=1e-5)
    assert fused_stats.keys() == padded_stats.keys() and len(fused_stats) == 8
    for row in fused_stats:
        assert torch.allclose(fused_stats[row], padded_stats[row], atol=1e-5), row
