"""Per-request compression state and the observation-query store (no SGLang needed)."""

from __future__ import annotations

import torch

from sgl_kvc.adapter.state import KvcStore, ReqKvState
from sgl_kvc.policies import get_policy


def _state(budget: int = 8, ratio: float | None = None) -> ReqKvState:
    return ReqKvState(policy=get_policy("rkv"), budget=budget, budget_ratio=ratio)


def test_positions_follow_compactions() -> None:
    s = _state()
    assert s.positions(5).tolist() == [0, 1, 2, 3, 4]
    # compact 10 tokens to those at logical 0, 3, 7, 9; the next token is logical 10
    s.kept_positions = torch.tensor([0, 3, 7, 9])
    s.offset = 10 - 4
    assert s.positions(7).tolist() == [0, 3, 7, 9, 10, 11, 12]
    # a second compaction keeps physical 1, 4, 6 -> logical 3, 10, 12
    s.kept_positions = s.positions(7)[torch.tensor([1, 4, 6])]
    s.offset = 13 - 3
    assert s.positions(5).tolist() == [3, 10, 12, 13, 14]


def test_effective_budget_ratio_uses_logical_length() -> None:
    s = _state(budget=8, ratio=0.5)
    s.offset = 100
    assert s.effective_budget(100) == 100  # half of 200 logical tokens
    assert _state(budget=8).effective_budget(10_000) == 8


def test_query_window_keeps_the_last_queries_in_order() -> None:
    store = KvcStore(num_layers=2, window=3, req_to_token=torch.zeros(4, 16, dtype=torch.int32), kv_pool=None)
    store.begin(1, _state())
    q = lambda v: torch.full((1, 2, 4), float(v))  # noqa: E731  [1 token, 2 heads, d=4]
    store.record_extend(0, 1, torch.cat([q(1), q(2)]), pool_rows=4)
    assert store.queries(1, 0, n=10)[:, 0, 0].tolist() == [1.0, 2.0]
    for v in (3, 4):
        store.record_decode(0, torch.tensor([1]), q(v), pool_rows=4)
    assert store.queries(1, 0, n=10)[:, 0, 0].tolist() == [2.0, 3.0, 4.0]
    assert store.queries(1, 0, n=2)[:, 0, 0].tolist() == [3.0, 4.0]  # never more than n tokens
    store.begin(1, _state())  # the row is reused by a new request: no stale queries
    assert store.queries(1, 0, n=10) is None
