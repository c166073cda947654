"""Per-(layer, KV head) eviction foundations: head-flattened attention and per-head selection.

(a) `sgl_kvc.kernels.per_head_attention` against dense float64 attention in which each KV head's
    evicted keys are masked out (GQA, ragged lengths, logical positions with gaps, float32/bf16).
(b) `select_per_head`: budgets, protected tokens, the variable mode's total and floor, and that the
    per-head selection differs from the shared one (and equals it when all heads agree).
(c) Dense references written here with explicit loops of the papers' per-head rules: SnapKV per
    KV head (uniform) and KV-Compress eq. 10 (squared) + eq. 8 with one sort over layer x head x
    token (§4.2, variable).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvc_reference import maxpool, softmax
from sgl_kvc.kernels.per_head_attention import HeadTables, per_head_decode, per_head_extend
from sgl_kvc.policies import LayerView, PolicyParams, get_policy
from sgl_kvc.policies.per_head import (
    HeadSelection,
    carry_stats_per_head,
    layer_shares,
    select_from_scores,
    select_per_head,
)


pytestmark = pytest.mark.usefixtures("single_thread")


def kept_mask(sel: HeadSelection) -> torch.Tensor:
    """Bool [L, H, n]: True where (layer, head) keeps the token (a reference view for tests)."""
    out = torch.zeros(sel.num_layers, sel.num_heads, sel.n + 1, dtype=torch.bool, device=sel.indices.device)
    out.scatter_(-1, torch.where(sel.valid(), sel.indices, sel.n), True)  # padding -> spare column n
    return out[..., : sel.n]


# ==================================================================================================
# (a) attention over head-flattened tables
# ==================================================================================================


def make_requests(
    gen: torch.Generator, n_list: list[int], h_kv: int, d: int, dv: int, dtype: torch.dtype,
    keep_prob: float, must_keep_last: int,
) -> list[dict]:
    """Per request: dense K [n, H_kv, d], V, logical positions (gaps), keep mask [H_kv, n].

    The last ``must_keep_last`` tokens (an extend's new tokens) are kept in every head."""
    reqs = []
    for n in n_list:
        gaps = torch.randint(1, 4, (n,), generator=gen)
        keep = torch.rand(h_kv, n, generator=gen) < keep_prob
        if must_keep_last:
            keep[:, n - must_keep_last:] = True
        reqs.append({
            "k": torch.randn(n, h_kv, d, generator=gen).to(dtype),
            "v": torch.randn(n, h_kv, dv, generator=gen).to(dtype),
            "pos": torch.cumsum(gaps, 0) + int(torch.randint(0, 50, (1,), generator=gen)),
            "keep": keep,
        })
    return reqs


def build_tables(
    gen: torch.Generator, reqs: list[dict], h_kv: int, spare: int = 7
) -> tuple[torch.Tensor, torch.Tensor, HeadTables]:
    """Write every kept (token, head) of every request into a flat pool at shuffled slots."""
    count = sum(int(r["keep"].sum()) for r in reqs)
    slots_total = count + spare
    perm = torch.randperm(slots_total, generator=gen)
    d, dv, dtype = reqs[0]["k"].shape[2], reqs[0]["v"].shape[2], reqs[0]["k"].dtype
    k_pool = torch.randn(slots_total, d, generator=gen).to(dtype) * 100  # garbage where unused
    v_pool = torch.randn(slots_total, dv, generator=gen).to(dtype) * 100
    n_max = max([int(r["keep"].sum(dim=1).max()) for r in reqs] + [1])
    b = len(reqs)
    slots = torch.full((b, h_kv, n_max), 10**6, dtype=torch.int64)  # padding: out of range
    positions = torch.full((b, h_kv, n_max), -7, dtype=torch.int64)
    lengths = torch.zeros(b, h_kv, dtype=torch.int64)
    nxt = 0
    for i, r in enumerate(reqs):
        for h in range(h_kv):
            kept = torch.nonzero(r["keep"][h]).flatten()
            m = kept.numel()
            s = perm[nxt: nxt + m]
            nxt += m
            k_pool[s] = r["k"][kept, h]
            v_pool[s] = r["v"][kept, h]
            slots[i, h, :m] = s
            positions[i, h, :m] = r["pos"][kept]
            lengths[i, h] = m
    return k_pool, v_pool, HeadTables(units=slots, lengths=lengths, positions=positions)


def on_device(tables: HeadTables, device: torch.device) -> HeadTables:
    """The tables on `device` (they are built on the CPU, beside the dense reference)."""
    positions = None if tables.positions is None else tables.positions.to(device)
    return HeadTables(units=tables.units.to(device), lengths=tables.lengths.to(device), positions=positions)


def dense_reference(
    r: dict, q: torch.Tensor, q_pos: torch.Tensor, scale: float, mask_evicted: bool = True
) -> torch.Tensor:
    """float64 attention of queries q [m, H_q, d] (logical positions q_pos) over the request's
    dense keys, each KV head's evicted keys masked out; causal by logical position."""
    k, v = r["k"].double(), r["v"].double()
    h_kv = k.shape[1]
    group = q.shape[1] // h_kv
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for i in range(q.shape[0]):
        for hq in range(q.shape[1]):
            h = hq // group  # GQA: query head hq reads KV head hq // G
            visible = r["pos"] <= q_pos[i]
            if mask_evicted:
                visible = visible & r["keep"][h]
            if not bool(visible.any()):
                continue  # no key: zero output, as the kernel defines it
            logits = (k[visible, h] @ q[i, hq].double()) * scale
            out[i, hq] = torch.softmax(logits, dim=0) @ v[visible, h]
    return out


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}


def run_decode_case(
    seed: int, n_list: list[int], h_kv: int, group: int, d: int, dv: int, dtype: torch.dtype,
    keep_prob: float, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the kernel's output on `device`, brought back to the CPU; the masked and the unmasked
    dense references)."""
    gen = torch.Generator().manual_seed(seed)
    reqs = make_requests(gen, n_list, h_kv, d, dv, dtype, keep_prob, must_keep_last=0)
    k_pool, v_pool, tables = build_tables(gen, reqs, h_kv)
    q = torch.randn(len(reqs), h_kv * group, d, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(d)
    out = per_head_decode(q.to(device), k_pool.to(device), v_pool.to(device), on_device(tables, device))
    assert out.device == device
    out = out.cpu()
    ref = torch.stack([
        dense_reference(r, q[i: i + 1], r["pos"][-1:], scale)[0] for i, r in enumerate(reqs)
    ])
    unmasked = torch.stack([
        dense_reference(r, q[i: i + 1], r["pos"][-1:], scale, mask_evicted=False)[0]
        for i, r in enumerate(reqs)
    ])
    return out, ref, unmasked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "h_kv,group", [(1, 1), (2, 1), (2, 4), (3, 3)], ids=["mha1", "mha2", "gqa4", "gqa3"]
)
def test_decode_matches_dense_masked_attention(
    device: torch.device, dtype: torch.dtype, h_kv: int, group: int
) -> None:
    out, ref, unmasked = run_decode_case(
        seed=h_kv * 10 + group, n_list=[5, 37, 1, 20], h_kv=h_kv, group=group, d=16, dv=12,
        dtype=dtype, keep_prob=0.6, device=device,
    )
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))
    # the masks matter: ignoring the per-head evictions gives a clearly different answer
    assert (out.double() - unmasked).abs().max() > 0.05


def test_decode_empty_head_gives_zeros_and_probs_sum_to_one(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    reqs = make_requests(gen, [9, 4], 2, 8, 8, torch.float32, 0.7, must_keep_last=0)
    reqs[1]["keep"][1] = False  # request 1, head 1 holds nothing
    k_pool, v_pool, tables = build_tables(gen, reqs, 2)
    q = torch.randn(2, 4, 8, generator=gen).to(device)
    tables = on_device(tables, device)
    out, probs = per_head_decode(q, k_pool.to(device), v_pool.to(device), tables, return_probs=True)
    assert out.device == probs.device == device and torch.isfinite(out).all()
    assert torch.equal(out[1, 2:], torch.zeros(2, 8, device=device))  # query heads 2, 3 read KV head 1
    sums = probs.sum(dim=-1)  # [B, H_kv, G]
    assert torch.allclose(sums[0], torch.ones_like(sums[0]))
    assert torch.allclose(sums[1, 0], torch.ones(2, device=device))
    assert torch.equal(sums[1, 1], torch.zeros(2, device=device))
    assert torch.equal(probs[~tables.valid().unsqueeze(2).expand_as(probs)],
                       torch.zeros(int((~tables.valid()).sum()) * 2, device=device))


def run_extend_case(
    seed: int, n_list: list[int], new_list: list[int], h_kv: int, group: int, d: int, dv: int,
    dtype: torch.dtype, keep_prob: float, q_block: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last new_list[b] tokens are its extend queries (kept in every head).
    Returns the kernel's output on `device`, brought back to the CPU, and the dense reference."""
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for n, e in zip(n_list, new_list):
        reqs += make_requests(gen, [n], h_kv, d, dv, dtype, keep_prob, must_keep_last=e)
    k_pool, v_pool, tables = build_tables(gen, reqs, h_kv)
    q = torch.randn(sum(new_list), h_kv * group, d, generator=gen).to(dtype)
    indptr = torch.tensor([0] + new_list).cumsum(0)
    q_pos = torch.cat([r["pos"][r["pos"].numel() - e:] for r, e in zip(reqs, new_list)])
    out = per_head_extend(
        q.to(device), indptr.to(device), q_pos.to(device), k_pool.to(device), v_pool.to(device),
        on_device(tables, device), q_block=q_block,
    )
    assert out.device == device
    out = out.cpu()
    scale = 1.0 / math.sqrt(d)
    ref = torch.cat([
        dense_reference(r, q[indptr[i]: indptr[i + 1]], q_pos[indptr[i]: indptr[i + 1]], scale)
        for i, r in enumerate(reqs)
    ])
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("q_block", [3, 256])
def test_extend_matches_dense_masked_causal_attention(device: torch.device, dtype: torch.dtype, q_block: int) -> None:
    out, ref = run_extend_case(
        seed=11, n_list=[30, 12, 25, 8], new_list=[7, 12, 1, 3], h_kv=2, group=3, d=16, dv=8,
        dtype=dtype, keep_prob=0.5, q_block=q_block, device=device,
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@pytest.mark.parametrize("q_block", [3, 256])
def test_an_extend_with_and_without_probabilities_is_the_same_attention(device: torch.device, q_block: int) -> None:
    """The two ways an extend runs: PyTorch's fused attention where nothing reads its
    probabilities, its own softmax where a prefill statistic does (`on_probs`). Both are the
    dense reference, the probabilities sum to 1 over the keys each query sees, and a head with no
    entry reads zeros both ways."""
    gen = torch.Generator().manual_seed(23)
    reqs = make_requests(gen, [30, 12], 2, 16, 8, torch.float32, 0.5, must_keep_last=5)
    k_pool, v_pool, tables = build_tables(gen, reqs, 2)
    q = torch.randn(10, 6, 16, generator=gen)
    indptr, q_pos = torch.tensor([0, 5, 10]), torch.cat([r["pos"][-5:] for r in reqs])
    ref = torch.cat([dense_reference(r, q[5 * i: 5 * i + 5], q_pos[5 * i: 5 * i + 5], 0.25) for i, r in enumerate(reqs)])
    empty = HeadTables(units=tables.units, lengths=tables.lengths * torch.tensor([[1, 0], [1, 1]]),
                       positions=tables.positions)
    for t in (tables, empty):
        args = (q.to(device), indptr.to(device), q_pos.to(device), k_pool.to(device), v_pool.to(device),
                on_device(t, device))
        seen: list[torch.Tensor] = []
        fused = per_head_extend(*args, q_block=q_block).cpu()
        softmax = per_head_extend(*args, q_block=q_block, on_probs=lambda start, stop, p: seen.append(p.cpu())).cpu()
        if t is tables:
            torch.testing.assert_close(fused.double(), ref, **tolerance(torch.float32))
            torch.testing.assert_close(softmax.double(), ref, **tolerance(torch.float32))
            sums = torch.cat([p.sum(dim=-1) for p in seen], dim=-1)  # [B, H_kv, G, q]
            torch.testing.assert_close(sums, torch.ones_like(sums))
        else:  # request 0's KV head 1 (query heads 3-5) holds nothing
            assert torch.equal(fused[:5, 3:], torch.zeros(5, 3, 8)) and torch.equal(softmax[:5, 3:], fused[:5, 3:])
            torch.testing.assert_close(fused, softmax, **tolerance(torch.float32))


def test_extend_causal_mask_uses_logical_positions(device: torch.device) -> None:
    """Permuting a head's table (slots with their positions) changes nothing; a table whose
    positions were replaced by table indices (physical order) gives a different answer."""
    gen = torch.Generator().manual_seed(5)
    reqs = make_requests(gen, [20], 1, 8, 8, torch.float32, 0.6, must_keep_last=4)
    k_pool, v_pool, t = build_tables(gen, reqs, 1)
    k_pool, v_pool, t = k_pool.to(device), v_pool.to(device), on_device(t, device)
    q = torch.randn(4, 2, 8, generator=gen).to(device)
    q_pos = reqs[0]["pos"][-4:].to(device)
    indptr = torch.tensor([0, 4], device=device)
    base = per_head_extend(q, indptr, q_pos, k_pool, v_pool, t)
    assert base.device == device
    m = int(t.lengths[0, 0])
    perm = torch.randperm(m, generator=gen).to(device)
    shuffled = HeadTables(
        units=t.units[:, :, perm], lengths=t.lengths, positions=t.positions[:, :, perm]
    )
    torch.testing.assert_close(per_head_extend(q, indptr, q_pos, k_pool, v_pool, shuffled), base)
    physical = HeadTables(units=t.units, lengths=t.lengths,
                          positions=torch.arange(m, device=device).reshape(1, 1, m))
    assert not torch.allclose(per_head_extend(q, indptr, q_pos, k_pool, v_pool, physical), base)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    h_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([4, 8, 16]),
    n_list=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    keep_prob=st.floats(0.2, 1.0),
    bf16=st.booleans(),
)
def test_decode_property(device, seed, h_kv, group, d, n_list, keep_prob, bf16) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    out, ref, _ = run_decode_case(seed, n_list, h_kv, group, d, d, dtype, keep_prob, device)
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    h_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2]),
    sizes=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 6)), min_size=1, max_size=3
    ),
    keep_prob=st.floats(0.2, 1.0),
    q_block=st.integers(1, 8),
    bf16=st.booleans(),
)
def test_extend_property(device, seed, h_kv, group, sizes, keep_prob, q_block, bf16) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    n_list = [n + e for n, e in sizes]
    new_list = [e for _, e in sizes]
    out, ref = run_extend_case(
        seed, n_list, new_list, h_kv, group, 8, 8, dtype, keep_prob, q_block, device
    )
    torch.testing.assert_close(out.double(), ref, **tolerance(dtype))


def test_decode_reads_one_head_fp8_rows_pool(device: torch.device) -> None:
    """A head-flattened FP8 pool (Fp8Rows with one head per slot) plugs in as k/v pool."""
    from sgl_kvc.kernels.fp8 import Fp8Rows

    gen = torch.Generator().manual_seed(4)
    reqs = make_requests(gen, [10, 7], 2, 8, 8, torch.float32, 0.7, must_keep_last=0)
    k_pool, v_pool, t = build_tables(gen, reqs, 2)
    t = on_device(t, device)
    k8 = Fp8Rows.empty(k_pool.shape[0], 1, 8, dtype=torch.float32, device=device)
    v8 = Fp8Rows.empty(v_pool.shape[0], 1, 8, dtype=torch.float32, device=device)
    all_slots = torch.arange(k_pool.shape[0], device=device)
    k8[all_slots] = k_pool[:, None, :].to(device)
    v8[all_slots] = v_pool[:, None, :].to(device)
    q = torch.randn(2, 4, 8, generator=gen).to(device)
    expect = per_head_decode(q, k8[all_slots][:, 0], v8[all_slots][:, 0], t)
    torch.testing.assert_close(per_head_decode(q, k8, v8, t), expect)  # devices compared too


# ==================================================================================================
# (b) per-head selection
# ==================================================================================================

LAYERS = 2
WINDOW = 6
BUDGET = 16


def make_views(
    seed: int, n: int, h_kv: int, group: int, d: int, device: torch.device, layers: int = LAYERS,
    identical_heads: bool = False, with_stats: bool = False,
) -> list[LayerView]:
    """Views drawn on the CPU and moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    views = []
    base_k = torch.randn(n, 1, d, generator=gen)
    base_q = torch.randn(WINDOW, 1, d, generator=gen)
    value_gen = torch.Generator().manual_seed(10_000 + seed)  # values: a stream of their own
    base_v = torch.randn(n, 1, d, generator=value_gen)
    positions = torch.cumsum(torch.randint(1, 3, (n,), generator=gen), 0)  # shared by layers
    for _ in range(layers):
        if identical_heads:  # every head and every layer sees the same keys, queries and values
            keys = base_k.expand(n, h_kv, d).clone()
            queries = base_q.expand(WINDOW, h_kv * group, d).clone()
            values = base_v.expand(n, h_kv, d).clone()
        else:
            keys = torch.randn(n, h_kv, d, generator=gen)
            queries = torch.randn(WINDOW, h_kv * group, d, generator=gen)
            values = torch.randn(n, h_kv, d, generator=value_gen)
        stats = None
        if with_stats:
            stats = torch.rand(h_kv, n, generator=gen) if not identical_heads else (
                torch.rand(1, n, generator=torch.Generator().manual_seed(seed)).expand(h_kv, n)
            )
        views.append(LayerView(
            keys=keys.to(device), queries=queries.to(device), positions=positions.to(device),
            stats=None if stats is None else stats.to(device), values=values.to(device),
        ))
    return views


POLICIES = ["snapkv", "kvcompress", "rkv", "h2o", "batchmax", "streamingllm", "expected_attention", "keydiff"]
STATS = {"h2o", "batchmax"}


def policy_and_views(
    name: str, seed: int, device: torch.device, n: int = 40, h_kv: int = 3, group: int = 2, **kw
):
    p = PolicyParams(budget=BUDGET, window=WINDOW, sink_tokens=3)
    views = make_views(seed, n, h_kv, group, 8, device, with_stats=name in STATS, **kw)
    return get_policy(name, p), views


@pytest.mark.parametrize("name", POLICIES)
def test_uniform_keeps_budget_per_head_and_protected(device: torch.device, name: str) -> None:
    policy, views = policy_and_views(name, seed=1, device=device)
    sel = select_per_head(policy, views, BUDGET)
    assert sel.indices.shape == (LAYERS, 3, BUDGET) and sel.indices.device == device
    assert torch.equal(sel.lengths, torch.full((LAYERS, 3), BUDGET, device=device))
    mask = kept_mask(sel)
    assert torch.equal(mask.sum(-1), sel.lengths)
    for layer, view in enumerate(views):
        prot = policy.protected(view)
        assert mask[layer][:, prot].all()
        for h in range(3):
            kept = sel.kept(layer, h)
            assert torch.equal(kept, torch.sort(kept).values) and kept.unique().numel() == BUDGET


@pytest.mark.parametrize("name", POLICIES)
def test_variable_total_floor_and_protected(device: torch.device, name: str) -> None:
    policy, views = policy_and_views(name, seed=2, device=device)
    for floor in (1, 5, BUDGET):
        sel = select_per_head(policy, views, BUDGET, mode="variable", min_per_head=floor)
        assert sel.total == BUDGET * LAYERS * 3 and sel.indices.device == sel.lengths.device == device
        mask = kept_mask(sel)
        assert torch.equal(mask.sum(-1), sel.lengths)
        for layer, view in enumerate(views):
            prot = policy.protected(view)
            assert mask[layer][:, prot].all()
            assert (sel.lengths[layer] >= max(floor, int(prot.sum()))).all()
        assert (sel.indices[~sel.valid()] == HeadSelection.PAD).all()
    # with the floor at the budget there is nothing left to move: uniform
    uni = select_per_head(policy, views, BUDGET)
    full = select_per_head(policy, views, BUDGET, mode="variable", min_per_head=BUDGET)
    assert torch.equal(kept_mask(full), kept_mask(uni))


@pytest.mark.parametrize("name", ["snapkv", "kvcompress", "rkv", "h2o", "expected_attention", "keydiff"])
def test_variable_is_one_global_sort(device: torch.device, name: str) -> None:
    """Every dropped candidate scores at most as high as every kept non-mandatory one, over all
    layers and heads (eq. 18 with block size 1), and the lengths really vary between heads."""
    policy, views = policy_and_views(name, seed=3, device=device)
    sel = select_per_head(policy, views, BUDGET, mode="variable", min_per_head=1)
    scores = torch.stack([policy.score(v) for v in views])  # protected = +inf
    mask = kept_mask(sel)
    prot = torch.stack([policy.protected(v) for v in views]).unsqueeze(1).expand_as(mask)
    dropped_max = scores[~mask].max()
    # a head's kept candidates beyond its floor: all of them when the floor is only protected
    kept_cands = scores[mask & ~prot]
    assert kept_cands.numel() > 0
    # the head's own floor could keep a worse one only if it had fewer than min_per_head
    assert kept_cands.min() >= dropped_max
    assert len(set(sel.lengths.flatten().tolist())) > 1


def test_variable_handles_no_protected_tokens_with_floor(device: torch.device) -> None:
    """batchmax protects nothing; a strongly skewed head gets most of the budget but never all."""
    policy, views = policy_and_views("batchmax", seed=4, device=device)
    for v in views:
        v.stats[1:] *= 1e-3  # heads 1, 2 score far lower than head 0
    sel = select_per_head(policy, views, BUDGET, mode="variable", min_per_head=2)
    assert sel.total == BUDGET * LAYERS * 3
    assert (sel.lengths[:, 0] == 40).all()  # head 0 of both layers keeps everything
    assert (sel.lengths[:, 1:] >= 2).all() and int(sel.lengths[:, 1:].sum()) == 96 - 80


@pytest.mark.parametrize("name", POLICIES)
def test_per_head_differs_from_shared_selection_on_random_data(device: torch.device, name: str) -> None:
    policy, views = policy_and_views(name, seed=5, device=device)
    shared = HeadSelection.broadcast(policy.select(views, BUDGET), LAYERS, 3, views[0].n)
    sel = select_per_head(policy, views, BUDGET)
    if name == "streamingllm":  # recency is the same in every head: per head == shared
        assert torch.equal(kept_mask(sel), kept_mask(shared))
    else:
        assert not torch.equal(kept_mask(sel), kept_mask(shared))


@pytest.mark.parametrize("name", POLICIES)
def test_identical_heads_give_the_shared_selection(device: torch.device, name: str) -> None:
    policy, views = policy_and_views(name, seed=6, device=device, identical_heads=True)
    shared = HeadSelection.broadcast(policy.select(views, BUDGET), LAYERS, 3, views[0].n)
    for mode in ("uniform", "variable", "layer"):
        sel = select_per_head(policy, views, BUDGET, mode=mode)
        assert torch.equal(kept_mask(sel), kept_mask(shared)), mode
        assert torch.equal(sel.indices, shared.indices), mode


def test_protected_overflow_keeps_newest_like_select(device: torch.device) -> None:
    p = PolicyParams(budget=4, window=6)
    policy = get_policy("snapkv", p)
    views = make_views(7, 20, 2, 2, 8, device)
    shared = policy.select(views, 4)
    for mode in ("uniform", "variable", "layer"):
        sel = select_per_head(policy, views, 4, mode=mode)
        assert torch.equal(kept_mask(sel), kept_mask(HeadSelection.broadcast(shared, LAYERS, 2, 20)))


def test_short_cache_keeps_everything(device: torch.device) -> None:
    policy, views = policy_and_views("snapkv", seed=8, device=device, n=10)
    for mode in ("uniform", "variable", "layer"):
        sel = select_per_head(policy, views, BUDGET, mode=mode)
        assert sel.total == 10 * LAYERS * 3 and kept_mask(sel).all()


def test_select_per_head_rejects_bad_arguments(device: torch.device) -> None:
    policy, views = policy_and_views("snapkv", seed=9, device=device)
    with pytest.raises(ValueError, match="mode"):
        select_per_head(policy, views, BUDGET, mode="pyramid")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_per_head"):
        select_per_head(policy, views, BUDGET, mode="variable", min_per_head=BUDGET + 1)
    with pytest.raises(ValueError, match="min_per_head"):
        select_per_head(policy, views, BUDGET, mode="variable", min_per_head=0)
    with pytest.raises(ValueError, match="budget"):
        select_per_head(policy, views, 0)
    short = make_views(9, 30, 3, 2, 8, device)[:1]
    with pytest.raises(ValueError, match="same tokens"):
        select_per_head(policy, [views[0], short[0]], BUDGET)


def test_gather_and_carry_stats_per_head(device: torch.device) -> None:
    policy, views = policy_and_views("kvcompress", seed=10, device=device)
    sel = select_per_head(policy, views, BUDGET, mode="variable")
    carried = carry_stats_per_head(policy, views, sel)
    for layer, view in enumerate(views):
        metric = policy.prefill_metric(view)  # eq. (8)/(10): what seeds eq. (20)
        got = carried[layer]
        assert got is not None and got.shape == (3, sel.max_keep) and got.device == device
        for h in range(3):
            m = int(sel.lengths[layer, h])
            assert torch.equal(got[h, :m], metric[h, sel.kept(layer, h)])
            assert (got[h, m:] == 0).all()
    snap = get_policy("snapkv", PolicyParams(budget=BUDGET, window=WINDOW))
    assert carry_stats_per_head(snap, views, sel) == [None, None]


@pytest.mark.parametrize("mode", ["uniform", "variable", "layer"])
def test_ragged_tables_never_keep_padding(device: torch.device, mode: str) -> None:
    """After a first per-head compaction heads hold different lengths: selection over padded
    [L, H, N] scores must ignore the padding whatever it contains, and equal the selection over
    each head's real entries."""
    gen = torch.Generator().manual_seed(12)
    layers, heads, n = 2, 3, 30
    lengths = torch.tensor([[30, 12, 5], [20, 30, 1]], device=device)
    scores = torch.rand(layers, heads, n, generator=gen).to(device)
    real = torch.arange(n, device=device) < lengths.unsqueeze(-1)
    protected = torch.zeros(layers, heads, n, dtype=torch.bool, device=device)
    for l in range(layers):  # the last 3 real entries of each head are its observation window
        for h in range(heads):
            m = int(lengths[l, h])
            protected[l, h, max(0, m - 3): m] = True
    budget = 8
    base = select_from_scores(scores, protected, budget, lengths=lengths, mode=mode)
    assert base.indices.device == base.lengths.device == device
    for garbage in (math.inf, -math.inf, math.nan, 1e9):
        noisy = torch.where(real, scores, garbage)
        noisy_prot = protected | ~real  # padding claims to be protected: ignored too
        sel = select_from_scores(noisy, noisy_prot, budget, lengths=lengths, mode=mode)
        assert torch.equal(sel.indices, base.indices) and torch.equal(sel.lengths, base.lengths)
    assert not (kept_mask(base) & ~real).any()
    assert (kept_mask(base) | ~protected).all()  # protected always kept
    if mode == "uniform":
        assert torch.equal(base.lengths, lengths.clamp(max=budget))
        for l in range(layers):
            for h in range(heads):
                m = int(lengths[l, h])
                one = select_from_scores(
                    scores[l:l + 1, h:h + 1, :m], protected[l:l + 1, h:h + 1, :m], budget
                )
                assert torch.equal(one.kept(0, 0), base.kept(l, h))
    else:
        assert base.total == min(budget * layers * heads, int(lengths.sum()))
        assert (base.lengths >= torch.minimum(lengths, torch.full_like(lengths, 3))).all()
        assert (base.lengths <= lengths).all()


def test_ragged_variable_small_heads_lend_their_budget(device: torch.device) -> None:
    """Heads shorter than the budget keep everything; the rest of the total goes elsewhere."""
    scores = torch.rand(1, 2, 10, generator=torch.Generator().manual_seed(13)).to(device)
    protected = torch.zeros(1, 2, 10, dtype=torch.bool, device=device)
    sel = select_from_scores(
        scores, protected, 6, lengths=torch.tensor([[10, 2]], device=device), mode="variable"
    )
    assert sel.lengths.device == device and sel.lengths.tolist() == [[10, 2]]  # total min(6 x 2, 12) = 12



@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.integers(1, 4), heads=st.integers(1, 4), n=st.integers(1, 24), budget=st.integers(1, 8),
    floor=st.integers(1, 8), seed=st.integers(0, 10_000),
)
def test_layer_mode_is_the_variable_sort_of_each_layer_alone(device, layers, heads, n, budget, floor, seed) -> None:
    """Ada-SnapKV (`mode="layer"`): layer l keeps its share of the request's budget
    (`layer_shares`), chosen as the variable mode chooses for a request of that one layer where
    the share is Ada-SnapKV's, min(budget x H, its entries); ties, floors and protection alike."""
    floor = min(floor, budget)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (layers, heads, n), generator=g).float().to(device)  # ties on purpose
    protected = (torch.rand(layers, heads, n, generator=g) < 0.2).to(device)
    lengths = torch.randint(0, n + 1, (layers, heads), generator=g).to(device)
    sel = select_from_scores(scores, protected, budget, lengths=lengths, mode="layer", min_per_head=floor)
    assert sel.lengths.device == device
    shares = layer_shares(lengths.sum(-1), budget * layers * heads).tolist()
    assert sel.total == min(budget * layers * heads, int(lengths.sum()))
    for layer in range(layers):
        assert int(sel.lengths[layer].sum()) == shares[layer]
        alone = select_from_scores(scores[layer : layer + 1], protected[layer : layer + 1], budget,
                                   lengths=lengths[layer : layer + 1], mode="variable", min_per_head=floor)
        assert (sel.lengths[layer] >= lengths[layer].clamp(max=floor)).all()  # its floor, at most all it holds
        assert (sel.lengths[layer] <= lengths[layer]).all()
        if shares[layer] == min(budget * heads, int(lengths[layer].sum())):
            assert torch.equal(sel.lengths[layer], alone.lengths[0])
            for h in range(heads):
                assert torch.equal(sel.kept(layer, h), alone.kept(0, h))


def reference_layer_shares(held: list[int], budget: int) -> list[int]:
    """The water level by counting up: the largest s with sum(min(held, s)) <= budget, then one
    more to the lower layers above it while the budget lasts."""
    keep = min(budget, sum(held))
    level = 0
    while level < max(held, default=0) and sum(min(h, level + 1) for h in held) <= keep:
        level += 1
    out = [min(h, level) for h in held]
    for i, h in enumerate(held):
        if sum(out) < keep and h > level:
            out[i] += 1
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.lists(st.integers(0, 40), min_size=1, max_size=8), budget=st.integers(0, 200))
def test_layer_shares_fill_the_budget_level_by_level(device, held, budget) -> None:
    """A layer that holds less than its equal share keeps everything and the others share the
    rest alike: the request keeps min(budget, all it holds); where every layer holds its equal
    share, the shares are Ada-SnapKV's (budget / L each)."""
    shares = layer_shares(torch.tensor(held, device=device), budget)
    assert shares.device.type == device.type
    assert shares.tolist() == reference_layer_shares(held, budget)
    assert int(shares.sum()) == min(budget, sum(held))
    if budget % len(held) == 0 and min(held) >= budget // len(held):
        assert shares.tolist() == [budget // len(held)] * len(held)


def test_a_packed_rows_narrow_layers_lend_their_share(device: torch.device) -> None:
    """A row whose layers an earlier sort over every head left unequal (KVzip's): the layer mode
    keeps the request's whole budget; its narrow layers keep all, its wide ones the rest alike.
    With equal shares this row kept 2 + 4 + 4 of 12 (budget 4 a head, 1 head, 3 layers)."""
    lengths = torch.tensor([[2], [9], [25]], device=device)
    scores = torch.rand(3, 1, 25, generator=torch.Generator().manual_seed(3)).to(device)
    protected = torch.zeros(3, 1, 25, dtype=torch.bool, device=device)
    sel = select_from_scores(scores, protected, 4, lengths=lengths, mode="layer")
    assert sel.lengths.flatten().tolist() == [2, 5, 5]


# ==================================================================================================
# (c) dense references of the papers' per-head rules (explicit loops, float64)
# ==================================================================================================






def window_probs(keys: list, obs: list, h: int, hq: int, scale: float) -> list[list[float]]:
    """Observation query j (at cache index n - q + j) of query head hq over keys of KV head h."""
    n, q = len(keys), len(obs)
    rows = []
    for j in range(q):
        visible = n - q + j + 1
        logits = [
            sum(a * b for a, b in zip(obs[j][hq], keys[i][h])) * scale for i in range(visible)
        ]
        rows.append(softmax(logits) + [0.0] * (n - visible))
    return rows


def ref_snapkv_head_scores(
    view: LayerView, p: PolicyParams, gqa: str = "mean"
) -> list[list[float]]:
    """SnapKV per KV head: votes of the window summed over queries, GQA group mean, pooled over
    the candidates (the window itself is protected)."""
    keys = view.keys.double().tolist()
    obs = view.queries.double().tolist()[-p.window:]
    n, h_kv, d = view.keys.shape
    group = view.queries.shape[1] // h_kv
    nc = n - p.window
    out = []
    for h in range(h_kv):
        per_q = []
        for g in range(group):
            rows = window_probs(keys, obs, h, h * group + g, 1.0 / math.sqrt(d))
            per_q.append([sum(rows[j][i] for j in range(len(obs))) for i in range(nc)])
        agg = (lambda xs: sum(xs) / group) if gqa == "mean" else max
        votes = [agg([per_q[g][i] for g in range(group)]) for i in range(nc)]
        out.append(maxpool(votes, p.pool_kernel))
    return out


def ref_kvc_head_metric(view: LayerView, p: PolicyParams) -> list[list[float]]:
    """KV-Compress eq. (10) with squared attention (§4.3) then eq. (8) pooling, per KV head."""
    keys = view.keys.double().tolist()
    obs = view.queries.double().tolist()[-p.window:]
    n, h_kv, d = view.keys.shape
    group = view.queries.shape[1] // h_kv
    out = []
    for h in range(h_kv):
        m = [0.0] * n
        for g in range(group):  # h in H_k (eq. 11)
            rows = window_probs(keys, obs, h, h * group + g, 1.0 / math.sqrt(d))
            for j in range(len(obs)):
                for i in range(n):
                    m[i] += rows[j][i] ** 2
        out.append(maxpool(m, p.pool_kernel))
    return out


def assert_clear_cut(values: list[float], take: int) -> None:
    """The cut between kept and dropped must be an exact tie or a clear gap (float32 vs 64)."""
    if 0 < take < len(values):
        gap = values[take - 1] - values[take]
        scale = max(abs(v) for v in values) + 1e-30
        assert gap == 0.0 or gap > 1e-5 * scale, f"ill-conditioned test case: {gap}"


def ref_uniform(head_scores: list[list[list[float]]], n: int, window: int, budget: int):
    """Per (layer, head): the window, then the top budget - window candidates (ties: low index)."""
    kept = []
    for layer_scores in head_scores:
        per_layer = []
        for s in layer_scores:
            s = s[: n - window]  # candidates only; the window is protected
            order = sorted(range(len(s)), key=lambda i: (-s[i], i))
            assert_clear_cut([s[i] for i in order], budget - window)
            per_layer.append(set(order[: budget - window]) | set(range(n - window, n)))
        kept.append(per_layer)
    return kept


def ref_variable(metric: list[list[list[float]]], n: int, window: int, budget: int):
    """KV-Compress §4.2: window kept in every head; then ONE sort of all (layer, head, token)
    candidates; keep the budget x L x H - (mandatory) largest. Ties: per-head rank, then (l, h)."""
    layers, heads = len(metric), len(metric[0])
    cands = []
    for l in range(layers):
        for h in range(heads):
            m = metric[l][h][: n - window]
            order = sorted(range(len(m)), key=lambda i: (-m[i], i))
            cands += [(m[i], rank, l, h, i) for rank, i in enumerate(order)]
    cands.sort(key=lambda c: (-c[0], c[1], c[2], c[3]))
    take = budget * layers * heads - window * layers * heads
    assert_clear_cut([c[0] for c in cands], take)
    kept = [[set(range(n - window, n)) for _ in range(heads)] for _ in range(layers)]
    for _, _, l, h, i in cands[:take]:
        kept[l][h].add(i)
    return kept


def as_sets(sel: HeadSelection) -> list[list[set[int]]]:
    return [[set(sel.kept(l, h).tolist()) for h in range(sel.num_heads)]
            for l in range(sel.num_layers)]


REF_CASES = [(11, 40, 2, 1), (12, 48, 2, 4), (13, 36, 1, 3), (14, 44, 3, 2)]  # seed, n, H_kv, G


@pytest.mark.parametrize("seed,n,h_kv,group", REF_CASES)
def test_snapkv_per_head_matches_dense_reference(
    device: torch.device, seed: int, n: int, h_kv: int, group: int
) -> None:
    p = PolicyParams(budget=BUDGET, window=WINDOW)
    views = make_views(seed, n, h_kv, group, 8, device)
    sel = select_per_head(get_policy("snapkv", p), views, BUDGET)
    ref = ref_uniform([ref_snapkv_head_scores(v, p) for v in views], n, WINDOW, BUDGET)
    assert sel.indices.device == device and as_sets(sel) == ref


def test_snapkv_per_head_reference_is_discriminative(device: torch.device) -> None:
    """The per-head reference with the wrong GQA rule (max), and the shared selection, differ."""
    p = PolicyParams(budget=BUDGET, window=WINDOW)
    policy = get_policy("snapkv", p)
    ours, wrong, shared = [], [], []
    for seed, n, h_kv, group in REF_CASES:
        views = make_views(seed, n, h_kv, group, 8, device)
        sel = select_per_head(policy, views, BUDGET)
        ours.append(as_sets(sel))
        wrong_scores = [ref_snapkv_head_scores(v, p, "max") for v in views]
        wrong.append(ref_uniform(wrong_scores, n, WINDOW, BUDGET))
        keep = set(policy.select(views, BUDGET).tolist())
        shared.append([[keep] * h_kv for _ in views])
    assert ours != wrong
    assert ours != shared


@pytest.mark.parametrize("seed,n,h_kv,group", REF_CASES)
def test_kvcompress_variable_matches_dense_reference(
    device: torch.device, seed: int, n: int, h_kv: int, group: int
) -> None:
    p = PolicyParams(budget=BUDGET, window=WINDOW)
    views = make_views(seed, n, h_kv, group, 8, device)
    policy = get_policy("kvcompress", p)
    metric = [ref_kvc_head_metric(v, p) for v in views]
    sel = select_per_head(policy, views, BUDGET, mode="variable", min_per_head=1)
    assert sel.indices.device == device and as_sets(sel) == ref_variable(metric, n, WINDOW, BUDGET)
    uni = select_per_head(policy, views, BUDGET, mode="uniform")
    assert as_sets(uni) == ref_uniform(metric, n, WINDOW, BUDGET)


def test_kvcompress_variable_reference_is_discriminative(device: torch.device) -> None:
    """Variable differs from uniform allocation, and from a per-layer (not cross-layer) sort."""
    p = PolicyParams(budget=BUDGET, window=WINDOW)
    policy = get_policy("kvcompress", p)
    ours, uniform, per_layer = [], [], []
    for seed, n, h_kv, group in REF_CASES:
        views = make_views(seed, n, h_kv, group, 8, device)
        metric = [ref_kvc_head_metric(v, p) for v in views]
        ours.append(as_sets(select_per_head(policy, views, BUDGET, mode="variable")))
        uniform.append(ref_uniform(metric, n, WINDOW, BUDGET))
        # Ada-SnapKV: one sort per layer (heads only), not across layers
        per_layer.append([ref_variable([m], n, WINDOW, BUDGET)[0] for m in metric])
    assert ours != uniform
    assert ours != per_layer
