"""The extend-attention benchmark (benchmarks/extend_attention.py), small: both ways the kernel runs,
timed against a baseline (here this checkout's own kernel), agree."""

from __future__ import annotations

from benchmarks.extend_attention import case
from sgl_kvc.kernels.per_head_attention import per_head_extend


def test_the_benchmark_times_both_ways_and_compares_them() -> None:
    for probs in (False, True):
        row = case((2, 2, 8), context=40, extend=12, reps=1, baseline=per_head_extend, probs=probs)
        assert row["probabilities"] is probs and row["ms"] > 0 and row["ms@baseline"] > 0
        assert float(row["max_abs_diff"]) == 0.0, row
