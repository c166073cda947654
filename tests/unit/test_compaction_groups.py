"""The kept entries of a step's compactions move in bounded groups (`adapter/moments/compaction.py`): a
move that raises fails the requests of its group, not every request of the step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes import FakeAllocator
from sgl_kvc.adapter.moments import compaction
from sgl_kvc.adapter.moments.compaction import Prepared, move_groups, prepare_per_head
from sgl_kvc.policies import HeadSelection
from test_compressor_moments import SlotPool, Tree

LAYERS, H_KV, N, K = 2, 2, 10, 4


def _batch(reqs: int) -> SimpleNamespace:
    pool = SlotPool(torch.device("cpu"))
    r2t = torch.zeros(reqs, 32, dtype=torch.int32)
    allocator = FakeAllocator(256, pool, seed=3)
    for row in range(reqs):
        r2t[row, :N] = allocator.alloc(N).to(torch.int32)
    return SimpleNamespace(
        reqs=[SimpleNamespace(rid=f"r{i}", kv=SimpleNamespace(req_pool_idx=i, cache_protected_len=0))
              for i in range(reqs)],
        seq_lens_cpu=torch.full((reqs,), N), req_to_token_pool=SimpleNamespace(req_to_token=r2t),
        token_to_kv_pool_allocator=allocator, tree_cache=Tree(torch.device("cpu")),
    )


def _selection(bad: bool = False) -> HeadSelection:
    indices = torch.arange(K).expand(LAYERS, H_KV, K).clone()
    if bad:  # a kept index past the row: the gather of its move raises
        indices[1, 0, -1] = N + 5
    return HeadSelection(indices=indices, lengths=torch.full((LAYERS, H_KV), K), n=N)


def test_groups_are_cut_in_order_and_a_large_item_moves_alone() -> None:
    assert move_groups([3, 3, 3, 9, 1], lambda x: x, limit=6) == [[3, 3], [3], [9], [1]]
    assert move_groups([], lambda x: x, limit=6) == []


@pytest.mark.parametrize(("per_group", "failed"), [(1, {1}), (2, {0, 1}), (4, {0, 1, 2, 3})])
def test_a_failed_move_fails_only_the_requests_of_its_group(monkeypatch, per_group: int, failed: set[int]) -> None:
    monkeypatch.setattr(compaction, "MOVE_GROUP_ENTRIES", per_group * H_KV * K)
    batch = _batch(4)
    outcomes = prepare_per_head(batch, [(i, _selection(bad=i == 1)) for i in range(4)])
    assert {i for i, o in enumerate(outcomes) if not isinstance(o, Prepared)} == failed
    assert all(isinstance(outcomes[i], IndexError) for i in failed)
