"""Per-head compaction's pieces that need no SGLang: moving each head's kept units into the
request's slots (plain and FP8 pools), per-head positions, and policies reading them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes import FakeAllocator

from sgl_kvc.core.moves import move_units_many
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.kernels.fp8 import Fp8Rows
from sgl_kvc.policies import LayerView, get_policy, select_per_head

pytestmark = pytest.mark.usefixtures("single_thread")


class Pool:
    """SGLang's MHA pool surface that compaction uses: per-layer [slots, H, d] K and V."""

    def __init__(self, k: list, v: list, start_layer: int = 0) -> None:
        self.k, self.v, self.start_layer = k, v, start_layer

    def get_kv_buffer(self, layer_id: int):
        i = layer_id - self.start_layer
        return self.k[i], self.v[i]


def move_units(pool, row: torch.Tensor, idx: torch.Tensor, dest: torch.Tensor) -> None:
    """One request's move: what the batched compaction does for a single request."""
    move_units_many(pool, [(row, idx, dest)])


def _expected(buf: torch.Tensor, row: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[H, k, d]: entry j of head h = head h of slot row[idx[h, j]] (a loop, as a reference)."""
    h_kv, k = idx.shape
    return torch.stack([torch.stack([buf[row[idx[h, j]], h] for j in range(k)]) for h in range(h_kv)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(2, 24), frac=st.floats(0.1, 1.0), layers=st.integers(1, 3),
    heads=st.integers(1, 3), seed=st.integers(0, 10_000), start_layer=st.integers(0, 2),
)
def test_move_units_packs_each_heads_kept_entries(device, n, frac, layers, heads, seed, start_layer) -> None:
    g = torch.Generator().manual_seed(seed)
    slots, d = 40, 4
    k_bufs = [torch.randn(slots, heads, d, generator=g).to(device) for _ in range(layers)]
    v_bufs = [torch.randn(slots, heads, d, generator=g).to(device) for _ in range(layers)]
    row = (torch.randperm(slots - 1, generator=g)[:n] + 1).to(device)  # slot 0 is SGLang's padding slot
    k = max(1, int(frac * n))
    # each (layer, head) keeps its own k entries, ascending
    idx = torch.stack([
        torch.stack([torch.sort(torch.randperm(n, generator=g)[:k]).values for _ in range(heads)])
        for _ in range(layers)
    ]).to(device)
    dest = row[:k]  # the request's own first k slots: sources and destinations overlap
    want_k = [_expected(k_bufs[l], row, idx[l]) for l in range(layers)]
    want_v = [_expected(v_bufs[l], row, idx[l]) for l in range(layers)]
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[dest] = False
    before = [b[untouched].clone() for b in k_bufs]
    move_units(Pool(k_bufs, v_bufs, start_layer), row, idx, dest)
    for l in range(layers):
        assert torch.equal(k_bufs[l][dest].transpose(0, 1), want_k[l])
        assert torch.equal(v_bufs[l][dest].transpose(0, 1), want_v[l])
        assert torch.equal(k_bufs[l][untouched], before[l])  # nothing else is written


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.integers(1, 4), layers=st.integers(1, 3), heads=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_moving_several_requests_together_equals_moving_them_one_by_one(device, reqs, layers, heads, seed) -> None:
    """Requests due in the same step are compacted with one gather + scatter per layer; their
    slots are disjoint, so the result is that of moving each alone."""
    g = torch.Generator().manual_seed(seed)
    slots, d = 64, 4
    bufs = [[torch.randn(slots, heads, d, generator=g).to(device) for _ in range(layers)] for _ in range(2)]
    free = torch.randperm(slots - 1, generator=g) + 1
    moves, used = [], 0
    for _ in range(reqs):
        n = int(torch.randint(2, 12, (1,), generator=g))
        row, used = free[used : used + n], used + n
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        idx = torch.stack([
            torch.stack([torch.sort(torch.randperm(n, generator=g)[:k]).values for _ in range(heads)])
            for _ in range(layers)
        ])
        row, idx = row.to(device), idx.to(device)
        moves.append((row, idx, row[:k]))
    together = [[b.clone() for b in bs] for bs in bufs]
    move_units_many(Pool(*together), moves)
    for row, idx, dest in moves:
        move_units(Pool(*bufs), row, idx, dest)
    for a, b in zip(together, bufs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_move_units_moves_fp8_codes_and_scales_as_they_are(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    slots, heads, d, n, k = 16, 2, 8, 10, 4
    rows = []
    for _ in range(2):
        r = Fp8Rows.empty(slots, heads, d, device=device)
        r[torch.arange(slots, device=device)] = torch.randn(slots, heads, d, generator=g).to(device, torch.bfloat16)
        rows.append(r)
    row = torch.arange(1, n + 1, device=device)
    idx = torch.tensor([[[0, 3, 5, 9], [1, 2, 8, 9]]], device=device)  # [1 layer, 2 heads, 4]
    codes, scales = rows[0].codes.clone(), rows[0].scales.clone()
    move_units(Pool([rows[0]], [rows[1]]), row, idx, row[:k])
    for h in range(heads):
        src = row[idx[0, h]]
        assert torch.equal(rows[0].codes[row[:k], h], codes[src, h])
        assert torch.equal(rows[0].scales[row[:k], h], scales[src, h])


def test_positions_per_head_follow_compactions(device: torch.device) -> None:
    s = ReqKvState(policy=get_policy("snapkv"), budget=Budget(3), device=device)
    # 6 tokens compacted per head to 3 entries each (2 layers x 2 heads); the next is logical 6
    s.kept_positions = torch.tensor([[[0, 2, 5], [1, 4, 5]], [[3, 4, 5], [0, 1, 5]]], device=device)
    s.offset = 6 - 3
    assert s.logical_len(3) == 6 and s.logical_len(5) == 8
    pos = s.positions(5)
    assert pos.shape == (2, 2, 5) and pos.device == device
    assert pos[0, 1].tolist() == [1, 4, 5, 6, 7] and pos[1, 0].tolist() == [3, 4, 5, 6, 7]


def test_layer_view_takes_per_head_positions(device: torch.device) -> None:
    keys = torch.randn(5, 2, 4, device=device)
    LayerView(keys=keys, positions=torch.tensor([[0, 1, 2, 3, 4], [0, 2, 3, 6, 9]], device=device))
    with pytest.raises(ValueError, match="positions"):
        LayerView(keys=keys, positions=torch.zeros(3, 5, dtype=torch.int64, device=device))


@pytest.mark.parametrize("name", ["streamingllm", "batchmax"])
def test_position_policies_score_each_heads_own_tokens(device: torch.device, name: str) -> None:
    """Per-head positions: head h's scores equal those of a one-head view of its own tokens."""
    policy = get_policy(name)
    pos = torch.tensor([[0, 1, 2, 3, 9], [0, 4, 6, 8, 9]], device=device)
    keys = torch.randn(5, 2, 4, device=device)
    stats = torch.rand(2, 5, device=device)
    both = policy.score(LayerView(keys=keys, positions=pos, stats=stats))
    assert both.device == device
    for h in range(2):
        alone = policy.score(LayerView(keys=keys[:, h : h + 1], positions=pos[h], stats=stats[h : h + 1]))
        assert torch.equal(both[h], alone[0])


def test_per_head_selection_differs_between_heads_where_scores_do(device: torch.device) -> None:
    """The point of per-head: two heads that attend to different tokens keep different ones."""
    n, d = 32, 8
    keys = torch.zeros(n, 2, d, device=device)
    keys[5, 0, 0] = keys[20, 1, 1] = 10.0  # head 0 looks at token 5, head 1 at token 20
    queries = torch.zeros(4, 2, d, device=device)
    queries[:, 0, 0] = queries[:, 1, 1] = 1.0
    view = LayerView(keys=keys, queries=queries)
    sel = select_per_head(get_policy("snapkv"), [view], budget=12)  # window 8 + 4 candidates
    assert sel.indices.device == device
    assert 5 in sel.kept(0, 0).tolist() and 5 not in sel.kept(0, 1).tolist()
    assert 20 in sel.kept(0, 1).tolist() and 20 not in sel.kept(0, 0).tolist()


def test_staged_pass_cost_follows_the_policys_scoring_cost(device: torch.device) -> None:
    """R-KV's redundancy compares each token with up to 1024 others: a layer costs far more than
    a linear-cost scorer's, so a staged pass gives it fewer layers per step."""
    snap, rkv = get_policy("snapkv"), get_policy("rkv")
    assert snap.score_cost(8000) == 8000
    assert rkv.score_cost(8000) == 8000 * (1 + 1024 // 48)
    # quadratic below 1024 tokens, then linear
    assert rkv.score_cost(512) / 512 < rkv.score_cost(1024) / 1024 == rkv.score_cost(8000) / 8000


@pytest.mark.parametrize(
    "name", ["rkv", "snapkv", "h2o", "batchmax", "kvcompress", "streamingllm", "expected_attention", "keydiff"]
)
def test_one_head_at_a_time_chooses_what_the_whole_layer_chooses(device: torch.device, name: str) -> None:
    """Staged passes score one KV head at a time where a layer does not fit in a step's work
    (`LayerView.head`): the result is the layer's per-head selection."""
    g = torch.Generator().manual_seed(1)
    n, h_kv, group, d = 40, 3, 2, 8
    view = LayerView(
        keys=torch.randn(n, h_kv, d, generator=g).to(device),
        queries=torch.randn(6, h_kv * group, d, generator=g).to(device),
        positions=torch.stack(
            [torch.sort(torch.randperm(80, generator=g)[:n]).values for _ in range(h_kv)]
        ).to(device),
        stats=torch.rand(h_kv, n - 3, generator=g).to(device),
        values=torch.randn(n, h_kv, d, generator=g).to(device),
    )
    policy = get_policy(name)
    whole = select_per_head(policy, [view], 16).indices[0]
    alone = torch.stack([select_per_head(policy, [view.head(h)], 16).indices[0, 0] for h in range(h_kv)])
    assert whole.device == device and torch.equal(whole, alone)


def test_a_failed_batched_move_gives_back_the_slots_it_allocated(device: torch.device, monkeypatch) -> None:
    """A request whose kept entries outnumber the slots it owns (a long prefix hit: its first
    slots belong to the radix tree) gets new slots before the move; if the move fails, those go
    back to the allocator, and the request's row and lengths are as they were; the failure is that
    request's outcome (its caller fails it), not an exception for the whole step."""
    from types import SimpleNamespace

    from sgl_kvc.adapter.moments import compaction
    from sgl_kvc.policies import HeadSelection

    layers, heads, n, k = 2, 2, 10, 6
    pool = Pool([torch.randn(64, heads, 4, device=device) for _ in range(layers)],
                [torch.randn(64, heads, 4, device=device) for _ in range(layers)])
    allocator = FakeAllocator(64, pool, device=device)
    row = allocator.alloc(n)
    r2t = torch.zeros(1, 32, dtype=torch.int32, device=device)
    r2t[0, :n] = row.to(torch.int32)
    kv = SimpleNamespace(req_pool_idx=0, cache_protected_len=n - 2)  # owns only 2 slots
    monkeypatch.setattr(compaction, "make_room_in_tree", lambda tree, need: None)  # a fake tree: nothing to evict
    batch = SimpleNamespace(
        reqs=[SimpleNamespace(kv=kv)], seq_lens_cpu=torch.tensor([n]), tree_cache=None,
        req_to_token_pool=SimpleNamespace(req_to_token=r2t), token_to_kv_pool_allocator=allocator,
    )
    indices = torch.stack([torch.randperm(n)[:k].sort().values for _ in range(layers * heads)]).to(device)
    selection = HeadSelection(
        indices=indices.reshape(layers, heads, k), lengths=torch.full((layers, heads), k, device=device), n=n
    )
    free_before = allocator.available_size()

    def broken(*args, **kwargs):
        raise RuntimeError("planted failure inside the batched move")

    monkeypatch.setattr(compaction, "move_units_many", broken)
    [outcome] = compaction.compact_requests_per_head(batch, [(0, selection)])
    assert isinstance(outcome, RuntimeError) and "planted" in str(outcome)  # the request fails, alone
    assert allocator.available_size() == free_before  # the k - 2 new slots came back
    assert torch.equal(r2t[0, :n], row.to(torch.int32)) and kv.cache_protected_len == n - 2
