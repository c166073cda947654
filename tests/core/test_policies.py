"""Unit tests of the engine-agnostic eviction policies (sgl_kvc.policies).

Each policy's kept set is compared with a dense reference written here with explicit Python loops
in float64, following the papers' formulas / algorithms step by step (no policy helper is called).
Each reference also has a deliberately wrong variant (e.g. mean instead of max over the GQA group)
that must disagree with the policy on at least one case, so the comparison can fail.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvc_reference import dot, maxpool, softmax
from sgl_kvc.policies import (
    LayerView,
    Policy,
    PolicyParams,
    available_policies,
    get_policy,
    policy_class,
    register_policy,
)
from sgl_kvc.policies import rkv as rkv_module

pytestmark = pytest.mark.usefixtures("single_thread")


ALL_POLICIES = [
    "batchmax", "expected_attention", "h2o", "keydiff", "kvcompress", "kvzip", "none", "rkv", "snapkv",
    "streamingllm",
]

# --------------------------------------------------------------------------------------------------
# random inputs
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    seed: int
    n: int
    h_kv: int
    group: int  # G = H_q / H_kv
    d: int
    q: int  # observation queries given (<= window)
    outliers: bool = False  # a few key channels 50x larger
    dup: bool = False  # near-duplicate keys (cosine > T) so R-KV's threshold / beta matter


CASES = [
    Case(seed=1, n=48, h_kv=2, group=1, d=16, q=8),  # MHA
    Case(seed=2, n=64, h_kv=2, group=4, d=16, q=8),  # GQA, H_q = 4 H_kv
    Case(seed=3, n=56, h_kv=1, group=4, d=32, q=8, outliers=True),
    Case(seed=4, n=60, h_kv=2, group=2, d=16, q=8, dup=True),
    Case(seed=5, n=44, h_kv=2, group=4, d=8, q=5, outliers=True, dup=True),  # q < window
    Case(seed=6, n=52, h_kv=2, group=4, d=16, q=8, dup=True),
]
CASE_IDS = [f"seed{c.seed}-n{c.n}-kv{c.h_kv}-g{c.group}" for c in CASES]
LAYERS = 2
WINDOW = 8
KEEP = 24


def make_layer(case: Case, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys [n, H_kv, d], queries [q, H_q, d], positions [n] (with gaps), drawn on the CPU and
    moved to `device`."""
    g = torch.Generator().manual_seed(1000 * case.seed + layer)
    keys = torch.randn(case.n, case.h_kv, case.d, generator=g)
    if case.outliers:
        channels = torch.randperm(case.d, generator=g)[:2]
        keys[:, :, channels] *= 50.0
    if case.dup:
        # near-duplicates of earlier tokens (small noise so the float32/float64 ranks agree)
        src = torch.randint(0, case.n // 2, (case.n // 5,), generator=g)
        dst = torch.randperm(case.n - case.n // 2, generator=g)[: case.n // 5] + case.n // 2
        keys[dst] = keys[src] + 0.05 * torch.randn(len(dst), case.h_kv, case.d, generator=g)
    q_scale = 0.08 if case.outliers else 0.7
    queries = q_scale * torch.randn(case.q, case.h_kv * case.group, case.d, generator=g)
    gaps = torch.randint(1, 4, (case.n,), generator=g)
    positions = torch.cumsum(gaps, 0) - gaps[0]
    return keys.to(device), queries.to(device), positions.to(device)


def random_probs(
    gen: torch.Generator, h_q: int, rows: int, n: int, causal_from: int | None
) -> torch.Tensor:
    """Softmax rows [H_q, rows, n]; row r sees keys <= causal_from + r when causal_from is set."""
    logits = 2.0 * torch.randn(h_q, rows, n, generator=gen)
    if causal_from is not None:
        key_idx = torch.arange(n)[None, :]
        row_idx = torch.arange(rows)[:, None] + causal_from
        logits = logits.masked_fill(key_idx > row_idx, -math.inf)
    return torch.softmax(logits, dim=-1)


# --------------------------------------------------------------------------------------------------
# plain-Python float64 reference building blocks
# --------------------------------------------------------------------------------------------------








def causal_probs(keys: list, queries: list, h: int, hq: int, scale: float) -> list[list[float]]:
    """Attention of query head hq (KV head h) of each observation query over all keys, causal."""
    n, q = len(keys), len(queries)
    rows = []
    for j in range(q):
        visible = n - q + j + 1
        logits = [dot(queries[j][hq], keys[i][h]) * scale for i in range(visible)]
        rows.append(softmax(logits) + [0.0] * (n - visible))
    return rows


def ref_select(
    layer_scores: list, protected: set[int], n: int, keep: int
) -> tuple[set[int], float]:
    """Protected first (most recent if too many), then by score mean over heads then layers.

    Returns (kept set, margin between the last kept and the first dropped candidate score).
    """
    keep = min(keep, n)
    agg = []
    for i in range(n):
        per_layer = [
            sum(heads[h][i] for h in range(len(heads))) / len(heads) for heads in layer_scores
        ]
        agg.append(sum(per_layer) / len(per_layer))
    prot = sorted(protected)
    if len(prot) >= keep:
        return set(prot[len(prot) - keep:]), math.inf
    others = sorted((i for i in range(n) if i not in protected), key=lambda i: (-agg[i], i))
    take = keep - len(prot)
    margin = math.inf
    if 0 < take < len(others):
        margin = agg[others[take - 1]] - agg[others[take]]
        scale = max(abs(agg[i]) for i in others) + 1e-30
        # well-conditioned cut: an exact tie (same value in both precisions) or a clear gap
        assert margin == 0.0 or margin > 1e-6 * scale, f"ill-conditioned test case: {margin}"
    return set(prot) | set(others[:take]), margin


def kept(policy: Policy, views: list[LayerView], keep: int) -> set[int]:
    idx = policy.select(views, keep)
    assert idx.device == views[0].keys.device
    return set(idx.tolist())


# --------------------------------------------------------------------------------------------------
# R-KV reference: eq. (1)-(7), Algorithm 1
# --------------------------------------------------------------------------------------------------


def ref_rkv_layer(keys_t, queries_t, p: PolicyParams, gqa: str = "max", beta: int | None = None,
                  spare_recent: bool = False):
    beta = p.rkv_beta if beta is None else beta
    keys = keys_t.double().tolist()
    obs = queries_t.double().tolist()[-p.window:]
    n, h_kv, d = keys_t.shape
    group = queries_t.shape[1] // h_kv
    scale = 1.0 / math.sqrt(d)
    alpha = min(p.window, n)
    nc = n - alpha  # Alg. 1 line 7
    scores = []
    for h in range(h_kv):
        # eq. (2)-(3): per query of the group, logits over candidates; max over group; softmax
        attn = []
        for j in range(len(obs)):
            row = []
            for k in range(nc):
                per_g = [dot(obs[j][h * group + g], keys[k][h]) * scale for g in range(group)]
                row.append(max(per_g) if gqa == "max" else sum(per_g) / group)
            attn.append(softmax(row))
        # Alg. 1 line 14: mean over observation queries; line 16: 1-D (max) pooling
        imp = maxpool([sum(attn[j][k] for j in range(len(obs))) / len(obs) for k in range(nc)],
                      p.pool_kernel)
        # Alg. 1 lines 18-23: cosine similarity, zero diagonal
        normed = []
        for k in range(nc):
            v = keys[k][h]
            norm = math.sqrt(dot(v, v))
            normed.append([x / (norm + 1e-8) for x in v])
        sim = [[dot(normed[u], normed[v]) for v in range(nc)] for u in range(nc)]
        for k in range(nc):
            sim[k][k] = 0.0
        # lines 24-31: for each u, zero the beta largest v with S_uv > T
        similar = [[sim[u][v] > p.rkv_threshold for v in range(nc)] for u in range(nc)]
        for u in range(nc):
            t_u = [v for v in range(nc) if similar[u][v]]
            for v in (t_u[-beta:] if beta > 0 else []):
                sim[u][v] = 0.0
        # lines 32-35 / eq. (6): the mean of row u; the public code's: the mean of column u
        if spare_recent:
            red = softmax([sum(sim[v][u] for v in range(nc)) / nc for u in range(nc)])
        else:
            red = softmax([sum(sim[u]) / nc for u in range(nc)])
        # eq. (7)
        lam = p.rkv_lambda
        scores.append([lam * imp[k] - (1 - lam) * red[k] for k in range(nc)] + [0.0] * alpha)
    return scores, set(range(nc, n))


def rkv_case(case: Case, device: torch.device, p: PolicyParams | None = None, **variant):
    p = PolicyParams(budget=KEEP, window=WINDOW) if p is None else p
    views, layer_scores = [], []
    for layer in range(LAYERS):
        keys, queries, positions = make_layer(case, layer, device)
        views.append(LayerView(keys=keys, queries=queries, positions=positions))
        s, prot = ref_rkv_layer(keys, queries, p, **variant)
        layer_scores.append(s)
    return p, views, ref_select(layer_scores, prot, case.n, KEEP)[0]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rkv_matches_dense_reference(device: torch.device, case: Case) -> None:
    p, views, ref = rkv_case(case, device)
    assert kept(get_policy("rkv", p), views, KEEP) == ref


def test_rkv_reference_is_discriminative(device: torch.device) -> None:
    """Mean (not max) over the GQA group, or no beta exemption, changes the kept set somewhere."""
    gqa_cases = [c for c in CASES if c.group > 1]
    policy_sets, mean_sets = [], []
    for case in gqa_cases:
        p, views, _ = rkv_case(case, device)
        policy_sets.append(kept(get_policy("rkv", p), views, KEEP))
        mean_sets.append(rkv_case(case, device, gqa="mean")[2])
    assert policy_sets != mean_sets
    # the redundancy threshold / beta exemption matters on the duplicated-keys cases
    dup_cases = [c for c in CASES if c.dup]
    assert any(rkv_case(c, device)[2] != rkv_case(c, device, beta=0)[2] for c in dup_cases)


@pytest.mark.parametrize("beta", [0, 2, 3])
def test_rkv_matches_dense_reference_at_other_betas(device: torch.device, beta: int) -> None:
    """beta = 1 (the paper's) takes a max over similar keys; other betas a top-k: both exact."""
    for case in [c for c in CASES if c.dup]:
        p, views, ref = rkv_case(case, device, PolicyParams(budget=KEEP, window=WINDOW, rkv_beta=beta))
        assert kept(get_policy("rkv", p), views, KEEP) == ref


@pytest.mark.parametrize("beta", [1, 2])
def test_rkv_sparing_the_recent_token_matches_dense_reference(device: torch.device, beta: int) -> None:
    """The public code's orientation: the most recent of similar tokens keeps the lowest R."""
    p = PolicyParams(budget=KEEP, window=WINDOW, rkv_beta=beta, rkv_exemption="recent")
    changed = False
    for case in CASES:
        _, views, ref = rkv_case(case, device, p, spare_recent=True)
        assert kept(get_policy("rkv", p), views, KEEP) == ref
        changed |= ref != rkv_case(case, device, dataclasses.replace(p, rkv_exemption="own"))[2]
    assert changed  # the two orientations keep different tokens somewhere


def test_rkv_similarity_blocking_is_exact(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[3]
    p, views, ref = rkv_case(case, device)
    full = get_policy("rkv", p).score(views[0])
    assert full.device == device
    monkeypatch.setattr(rkv_module, "_SIM_CHUNK_ELEMS", {device.type: 300})
    blocked = get_policy("rkv", p).score(views[0])
    torch.testing.assert_close(full, blocked)
    assert kept(get_policy("rkv", p), views, KEEP) == ref


def test_rkv_keeps_budget_total_including_observation_window(device: torch.device) -> None:
    case = CASES[1]
    p, views, _ = rkv_case(case, device)
    pol = get_policy("rkv", p)
    idx = pol.select(views, p.budget)
    assert idx.numel() == p.budget and idx.device == device
    assert set(range(case.n - p.window, case.n)) <= set(idx.tolist())


# --------------------------------------------------------------------------------------------------
# SnapKV reference
# --------------------------------------------------------------------------------------------------


def ref_snapkv_layer(keys_t, queries_t, p: PolicyParams, gqa: str = "mean", pool: bool = True):
    keys = keys_t.double().tolist()
    obs = queries_t.double().tolist()[-p.window:]
    n, h_kv, d = keys_t.shape
    group = queries_t.shape[1] // h_kv
    nc = n - min(p.window, n)
    scores = []
    for h in range(h_kv):
        per_head = []
        for g in range(group):
            rows = causal_probs(keys, obs, h, h * group + g, 1.0 / math.sqrt(d))
            per_head.append([sum(rows[j][i] for j in range(len(obs))) for i in range(nc)])
        if gqa == "mean":
            votes = [sum(per_head[g][i] for g in range(group)) / group for i in range(nc)]
        else:
            votes = [max(per_head[g][i] for g in range(group)) for i in range(nc)]
        votes = maxpool(votes, p.pool_kernel) if pool else votes
        scores.append(votes + [0.0] * (n - nc))
    return scores, set(range(nc, n))


def snapkv_case(case: Case, device: torch.device, **variant):
    p = PolicyParams(budget=KEEP, window=WINDOW)
    views, layer_scores = [], []
    for layer in range(LAYERS):
        keys, queries, positions = make_layer(case, layer, device)
        views.append(LayerView(keys=keys, queries=queries, positions=positions))
        s, prot = ref_snapkv_layer(keys, queries, p, **variant)
        layer_scores.append(s)
    return p, views, ref_select(layer_scores, prot, case.n, KEEP)[0]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_snapkv_matches_dense_reference(device: torch.device, case: Case) -> None:
    p, views, ref = snapkv_case(case, device)
    assert kept(get_policy("snapkv", p), views, KEEP) == ref


def test_snapkv_reference_is_discriminative(device: torch.device) -> None:
    results = [snapkv_case(c, device) for c in CASES]
    ours = [kept(get_policy("snapkv", p), v, KEEP) for p, v, _ in results]
    assert ours != [snapkv_case(c, device, gqa="max")[2] for c in CASES]
    assert ours != [snapkv_case(c, device, pool=False)[2] for c in CASES]


# --------------------------------------------------------------------------------------------------
# KV-Compress reference: eq. (8), (10) squared (as eq. 19), (20)
# --------------------------------------------------------------------------------------------------


def ref_kvc_prefill_metric(keys_t, queries_t, p: PolicyParams, squared: bool = True):
    keys = keys_t.double().tolist()
    obs = queries_t.double().tolist()[-p.window:]
    n, h_kv, d = keys_t.shape
    group = queries_t.shape[1] // h_kv
    metric = []
    for h in range(h_kv):
        m = [0.0] * n
        for g in range(group):  # eq. (10): sum over the query group H_k
            rows = causal_probs(keys, obs, h, h * group + g, 1.0 / math.sqrt(d))
            for j in range(len(obs)):  # sum over the observation window i = L-w..L
                for i in range(n):
                    m[i] += rows[j][i] ** 2 if squared else rows[j][i]
        metric.append(maxpool(m, p.pool_kernel))  # eq. (8)
    return metric


def kvc_case(case: Case, device: torch.device, squared: bool = True):
    p = PolicyParams(budget=KEEP, window=WINDOW)
    views, layer_scores = [], []
    for layer in range(LAYERS):
        keys, queries, positions = make_layer(case, layer, device)
        views.append(LayerView(keys=keys, queries=queries, positions=positions))
        layer_scores.append(ref_kvc_prefill_metric(keys, queries, p, squared))
    prot = set(range(case.n - p.window, case.n))
    return p, views, layer_scores, ref_select(layer_scores, prot, case.n, KEEP)[0]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kvcompress_prefill_matches_dense_reference(device: torch.device, case: Case) -> None:
    p, views, _, ref = kvc_case(case, device)
    assert kept(get_policy("kvcompress", p), views, KEEP) == ref


def test_kvcompress_reference_is_discriminative(device: torch.device) -> None:
    ours = []
    for c in CASES:
        p, views, _, _ = kvc_case(c, device)
        ours.append(kept(get_policy("kvcompress", p), views, KEEP))
    assert ours != [kvc_case(c, device, squared=False)[3] for c in CASES]


@pytest.mark.parametrize("case", CASES[:4], ids=CASE_IDS[:4])
def test_kvcompress_continual_matches_eq20(device: torch.device, case: Case) -> None:
    """Prefill compression seeds M^(pool); decode adds squared group-summed attention (eq. 20)."""
    p, views, metrics, first = kvc_case(case, device)
    pol = get_policy("kvcompress", p)
    keep_idx = pol.select(views, KEEP)
    assert set(keep_idx.tolist()) == first
    order = keep_idx.tolist()
    gen = torch.Generator().manual_seed(77 + case.seed)
    new_views, layer_scores = [], []
    steps = 30
    h_q = case.h_kv * case.group
    for layer, view in enumerate(views):
        stats = pol.carry_stats(view, keep_idx)
        ref = [[metrics[layer][h][i] for i in order] for h in range(case.h_kv)]
        keys = view.keys[keep_idx]
        for _ in range(steps):
            keys = torch.cat([keys, torch.randn(1, case.h_kv, case.d, generator=gen).to(device)])
            probs = random_probs(gen, h_q, 1, keys.shape[0], None).to(device)
            stats = pol.accumulate(stats, probs, case.h_kv)
            pl = probs.double().tolist()
            for h in range(case.h_kv):
                ref[h].append(0.0)
                for g in range(case.group):
                    for i in range(keys.shape[0]):
                        ref[h][i] += pl[h * case.group + g][0][i] ** 2  # eq. (20)
        assert stats.device == device
        new_views.append(LayerView(keys=keys, stats=stats))
        layer_scores.append(ref)
    n = new_views[0].n
    ref_kept, _ = ref_select(layer_scores, set(range(n - p.window, n)), n, KEEP)
    assert kept(pol, new_views, KEEP) == ref_kept


# --------------------------------------------------------------------------------------------------
# H2O and Batch-Max average attention: accumulated attention
# --------------------------------------------------------------------------------------------------


def simulate_stats(policy: Policy, case: Case, layer: int, device: torch.device, steps: int = 20):
    """Prefill (causal, in two row blocks) then ``steps`` decode steps; returns view + ref sums."""
    gen = torch.Generator().manual_seed(500 * case.seed + layer)
    n0 = case.n - steps
    h_q = case.h_kv * case.group
    prefill = random_probs(gen, h_q, n0, n0, causal_from=0).to(device)
    ref = [[0.0] * case.n for _ in range(case.h_kv)]
    stats = None
    blocks = [(0, n0 // 3), (n0 // 3, n0)]  # accumulate is additive over query rows
    for lo, hi in blocks:
        stats = policy.accumulate(stats, prefill[:, lo:hi], case.h_kv)
    passes = [prefill]
    for t in range(steps):
        probs = random_probs(gen, h_q, 1, n0 + t + 1, None).to(device)
        stats = policy.accumulate(stats, probs, case.h_kv)
        passes.append(probs)
    assert stats.device == device
    for probs in passes:
        pl = probs.double().tolist()
        for hq in range(h_q):
            for row in pl[hq]:
                for i, a in enumerate(row):
                    ref[hq // case.group][i] += a  # sum over queries and the query group
    keys, _, positions = make_layer(case, layer, device)
    return LayerView(keys=keys, positions=positions, stats=stats), ref, positions.tolist()


def stats_case(name: str, case: Case, device: torch.device, recent: bool = True, average: bool = True):
    p = PolicyParams(budget=KEEP, window=WINDOW)
    pol = get_policy(name, p)
    views, layer_scores = [], []
    for layer in range(LAYERS):
        view, sums, pos = simulate_stats(pol, case, layer, device)
        views.append(view)
        if name == "batchmax" and average:
            # Batch-Max §3.2: ave_weights = sum_weights / (curr_id + 1 - kv_ids)
            curr = pos[-1]
            sums = [[s[i] / (curr + 1 - pos[i]) for i in range(case.n)] for s in sums]
        layer_scores.append(sums)
    prot = set(range(case.n - KEEP // 2, case.n)) if (name == "h2o" and recent) else set()
    return pol, views, ref_select(layer_scores, prot, case.n, KEEP)[0]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name", ["h2o", "batchmax"])
def test_accumulated_attention_policies_match_reference(device: torch.device, name: str, case: Case) -> None:
    pol, views, ref = stats_case(name, case, device)
    assert kept(pol, views, KEEP) == ref


def test_accumulated_attention_references_are_discriminative(device: torch.device) -> None:
    h2o = [stats_case("h2o", c, device) for c in CASES]
    ours = [kept(pol, views, KEEP) for pol, views, _ in h2o]
    assert ours != [stats_case("h2o", c, device, recent=False)[2] for c in CASES]
    avg = [stats_case("batchmax", c, device) for c in CASES]
    ours = [kept(pol, views, KEEP) for pol, views, _ in avg]
    assert ours != [stats_case("batchmax", c, device, average=False)[2] for c in CASES]


def test_h2o_half_recent_half_heavy(device: torch.device) -> None:
    pol, views, _ = stats_case("h2o", CASES[0], device)
    idx = pol.select(views, KEEP).tolist()
    n = CASES[0].n
    assert set(range(n - KEEP // 2, n)) <= set(idx)
    assert sum(1 for i in idx if i < n - KEEP // 2) == KEEP - KEEP // 2


def test_stats_narrower_than_n_are_zero_padded(device: torch.device) -> None:
    pol = get_policy("h2o", PolicyParams(budget=4))
    probs = torch.softmax(torch.randn(4, 1, 5, device=device), dim=-1)
    stats = pol.accumulate(None, probs, 2)
    probs2 = torch.softmax(torch.randn(4, 2, 7, device=device), dim=-1)
    out = pol.accumulate(stats, probs2, 2)
    expect = torch.nn.functional.pad(stats, (0, 2)) + probs2.reshape(2, 2, 2, 7).sum(dim=(1, 2))
    torch.testing.assert_close(out, expect)  # devices compared too
    view = LayerView(keys=torch.randn(9, 2, 4, device=device), stats=out)
    assert pol.score(view).shape == (2, 9)


def test_stats_policies_require_stats(device: torch.device) -> None:
    view = LayerView(keys=torch.randn(20, 2, 4, device=device))
    for name in ["h2o", "batchmax", "kvcompress", "rkv", "snapkv"]:
        with pytest.raises(ValueError, match=name):
            get_policy(name, PolicyParams(budget=4)).select([view], 4)


# --------------------------------------------------------------------------------------------------
# StreamingLLM
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_streamingllm_keeps_sinks_and_most_recent(device: torch.device, case: Case) -> None:
    p = PolicyParams(budget=KEEP)
    views = []
    for layer in range(LAYERS):
        keys, queries, positions = make_layer(case, layer, device)
        views.append(LayerView(keys=keys, queries=queries, positions=positions))
    ref = set(range(p.sink_tokens)) | set(range(case.n - (KEEP - p.sink_tokens), case.n))
    assert kept(get_policy("streamingllm", p), views, KEEP) == ref
    no_sinks = set(range(case.n - KEEP, case.n))  # the wrong rule: pure sliding window
    assert ref != no_sinks


# --------------------------------------------------------------------------------------------------
# Expected Attention reference: kvpress ExpectedAttentionPress's steps, in float64 with loops
# --------------------------------------------------------------------------------------------------

U32 = 2.0**-24  # float32 unit roundoff


def make_values(case: Case, layer: int, device: torch.device) -> torch.Tensor:
    """values [n, H_kv, d] with norms that vary between tokens, drawn on the CPU."""
    g = torch.Generator().manual_seed(7000 + 10 * case.seed + layer)
    values = torch.randn(case.n, case.h_kv, case.d, generator=g)
    return (values * (0.5 + torch.rand(case.n, case.h_kv, 1, generator=g))).to(device)


def rope_pairs(p: PolicyParams, d: int) -> list[tuple[int, int, float]]:
    """(dimension a, dimension b, frequency theta) of every rotated pair of the model's RoPE."""
    r = p.rope_dim or d
    out = []
    for i in range(r // 2):
        a, b = (i, i + r // 2) if p.rope_neox else (2 * i, 2 * i + 1)
        out.append((a, b, p.rope_theta ** (-(2 * i) / r)))
    return out


def rope_matrix(pairs: list[tuple[int, int, float]], d: int, positions: list[int]) -> list[list[float]]:
    """The mean over `positions` of the RoPE rotation matrices R(t) (one position: R(t) itself)."""
    m = [[float(i == j) for j in range(d)] for i in range(d)]
    for a, b, theta in pairs:
        c = sum(math.cos(t * theta) for t in positions) / len(positions)
        s = sum(math.sin(t * theta) for t in positions) / len(positions)
        m[a][a], m[a][b], m[b][a], m[b][b] = c, -s, s, c
    return m


def matvec(m: list[list[float]], x: list[float]) -> list[float]:
    return [dot(row, x) for row in m]


def matmul(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:
    cols = list(zip(*b))
    return [[dot(row, col) for col in cols] for row in a]


def ref_expected_attention_layer(keys_t, queries_t, values_t, positions_t, p: PolicyParams,
                                 advance: bool = True, covariance: bool | None = None):
    """Scores [H_kv][n] and protected set. kvpress: pre-RoPE query mean and covariance, rotated by
    the mean RoPE matrix over the next F positions; expected logits mu.k/sqrt(d) +
    k^T Sigma k/(2d); softmax over the non-sink keys; mean over the query group; times
    (score + epsilon) ||v||. `advance=False` is the wrong variant that takes the RoPE'd queries'
    statistics as they are."""
    covariance = p.ea_covariance if covariance is None else covariance
    keys, values = keys_t.double().tolist(), values_t.double().tolist()
    obs = queries_t.double().tolist()[-p.window:]
    pos = positions_t.tolist()
    n, h_kv, d = keys_t.shape
    group = queries_t.shape[1] // h_kv
    q = len(obs)
    sinks = min(p.sink_tokens, n)
    protected = set(range(sinks)) | set(range(max(n - p.recent_kept, 0), n))
    if n <= sinks + p.recent_kept:
        return [[0.0] * n for _ in range(h_kv)], protected
    pairs = rope_pairs(p, d)
    future = rope_matrix(pairs, d, list(range(pos[-1] + 1, pos[-1] + 1 + p.ea_future_positions)))
    scale = 1.0 / math.sqrt(d)
    scores = []
    for h in range(h_kv):
        per_group = []
        for g in range(group):
            hq = h * group + g
            if advance:  # undo each query's own rotation R(p_j): the pre-RoPE query
                pre = [matvec(rope_matrix(pairs, d, [-pos[n - q + j]]), obs[j][hq]) for j in range(q)]
            else:
                pre = [obs[j][hq] for j in range(q)]
            mu = [sum(x[c] for x in pre) / q for c in range(d)]
            cov = [[sum((x[a] - mu[a]) * (x[b] - mu[b]) for x in pre) / q for b in range(d)] for a in range(d)]
            if advance:  # mu <- Rbar mu, Sigma <- Rbar Sigma Rbar^T
                mu = matvec(future, mu)
                cov = matmul(matmul(future, cov), [list(col) for col in zip(*future)])
            logits = []
            for i in range(sinks, n):
                k = keys[i][h]
                z = dot(mu, k) * scale
                if covariance:
                    z += dot(k, matvec(cov, k)) * scale * scale / 2
                logits.append(z)
            per_group.append(softmax(logits))
        row = [0.0] * sinks
        for i in range(n - sinks):
            a = sum(per_group[g][i] for g in range(group)) / group
            if p.ea_value_norm:
                v = values[sinks + i][h]
                a = (a + p.ea_epsilon) * math.sqrt(dot(v, v))
            row.append(a)
        scores.append(row)
    return scores, protected


def ea_error_bound(keys_t, queries_t, p: PolicyParams, ref_scores) -> float:
    """Largest |float32 score - float64 score| the policy may show, from float32 rounding: each
    logit is a chain of dot products of length d over queries rotated and averaged over q, so its
    absolute error is at most (d + q + 8) u times its terms' magnitudes (gamma_k of Higham's
    bounds, with a few operations per term), |s mu.k| <= s A ||k|| and
    s^2 k^T Sigma k / 2 <= 2 (s A ||k||)^2 for A the largest query norm (a phasor's modulus is at
    most 1). exp of a logit minus the log-sum-exp has a relative error of at most twice the
    largest logit error; the value norm adds (d + 4) u."""
    d, q = keys_t.shape[2], min(p.window, queries_t.shape[0])
    a = queries_t.double().norm(dim=-1).max().item()
    knorm = keys_t.double().norm(dim=-1).max().item()
    term = a * knorm / math.sqrt(d)
    logit = (d + q + 8) * U32 * (term + 2 * term * term)
    rel = 2 * logit + (d + 4) * U32
    return rel * max(max(row) for row in ref_scores) + U32


def assert_matches_reference(pol: Policy, views: list[LayerView], layer_scores: list, ref: set[int], margin: float,
                             tol: float, device: torch.device) -> None:
    """Each layer's scores within `tol` of the float64 reference's (protected tokens aside), and the
    kept set the reference's, decided by a margin beyond float32 rounding."""
    for view, want in zip(views, layer_scores):
        got = pol.score(view)
        assert got.device == device
        cand = torch.isfinite(got).cpu()
        err = (got.double().cpu() - torch.tensor(want, dtype=torch.float64))[cand].abs().max().item()
        assert err <= tol, (err, tol)
    assert margin > 2 * tol  # the kept set is decided beyond float32 rounding
    assert kept(pol, views, KEEP) == ref


def ea_case(case: Case, device: torch.device, p: PolicyParams | None = None, **variant):
    p = PolicyParams(budget=KEEP, window=WINDOW) if p is None else p
    views, layer_scores, tol = [], [], 0.0
    for layer in range(LAYERS):
        keys, queries, positions = make_layer(case, layer, device)
        values = make_values(case, layer, device)
        views.append(LayerView(keys=keys, queries=queries, positions=positions, values=values))
        s, prot = ref_expected_attention_layer(keys, queries, values, positions, p, **variant)
        layer_scores.append(s)
        tol = max(tol, ea_error_bound(keys, queries, p, s))
    ref, margin = ref_select(layer_scores, prot, case.n, KEEP)
    return p, views, layer_scores, ref, margin, tol


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_expected_attention_matches_dense_reference(device: torch.device, case: Case) -> None:
    p, views, layer_scores, ref, margin, tol = ea_case(case, device)
    assert_matches_reference(get_policy("expected_attention", p), views, layer_scores, ref, margin, tol, device)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[CASE_IDS[0], CASE_IDS[3]])  # well-conditioned cuts
@pytest.mark.parametrize("option", [
    {"ea_covariance": False}, {"ea_value_norm": False}, {"ea_epsilon": 0.02},
    {"rope_theta": 100000.0, "rope_dim": 8, "rope_neox": False},
], ids=["mean-only", "no-vnorm", "epsilon", "gptj-partial-rope"])
def test_expected_attention_options_match_dense_reference(device: torch.device, case: Case, option: dict) -> None:
    p = PolicyParams(budget=KEEP, window=WINDOW, **option)
    p, views, _, ref, margin, tol = ea_case(case, device, p)
    assert margin > 2 * tol
    assert kept(get_policy("expected_attention", p), views, KEEP) == ref


def test_expected_attention_reference_is_discriminative(device: torch.device) -> None:
    """Without the RoPE advance, or without the covariance term, the kept sets change."""
    results = [ea_case(c, device) for c in CASES]
    ours = [kept(get_policy("expected_attention", p), views, KEEP) for p, views, *_ in results]
    assert ours != [ea_case(c, device, advance=False)[3] for c in CASES]
    assert ours != [ea_case(c, device, covariance=False)[3] for c in CASES]


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rope_dim", [0, 6])
def test_advancing_a_rotated_query_is_the_rotation_at_the_later_position(
    device: torch.device, neox: bool, rope_dim: int
) -> None:
    """With one future position, the phasor of offset delta rotates a query RoPE'd at p into the
    same pre-RoPE query RoPE'd at p + delta (R(p + delta) = R(delta) R(p))."""
    from sgl_kvc.policies.expected_attention import mean_future_phasor, rotate_pairs

    d = 10
    p = PolicyParams(ea_future_positions=1, rope_theta=500.0, rope_dim=rope_dim, rope_neox=neox)
    pairs = rope_pairs(p, d)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(d, generator=g, dtype=torch.float64)
    at_p = torch.tensor(matvec(rope_matrix(pairs, d, [37]), x.tolist()), dtype=torch.float64)
    later = torch.tensor(matvec(rope_matrix(pairs, d, [37 + 5]), x.tolist()), dtype=torch.float64)
    re, im = mean_future_phasor(torch.tensor([5], device=device), p, d)
    moved = rotate_pairs(at_p.float().to(device)[None], re, im, p.rope_dim, p.rope_neox)[0]
    assert moved.device == device
    torch.testing.assert_close(moved.double().cpu(), later, atol=8 * d * U32 * float(x.norm()), rtol=0.0)


def test_expected_attention_needs_queries_and_values(device: torch.device) -> None:
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(20, 2, 4, generator=g).to(device)
    queries = torch.randn(8, 4, 4, generator=g).to(device)
    pol = get_policy("expected_attention", PolicyParams(budget=4))
    with pytest.raises(ValueError, match="values"):
        pol.score(LayerView(keys=keys, queries=queries))
    with pytest.raises(ValueError, match="queries"):
        pol.score(LayerView(keys=keys, values=keys))
    mean_only = get_policy("expected_attention", PolicyParams(budget=4, ea_value_norm=False))
    assert mean_only.score(LayerView(keys=keys, queries=queries)).shape == (2, 20)
    # everything protected (sinks + window): no query or value is read
    assert pol.select([LayerView(keys=keys[:12])], 12).tolist() == list(range(12))


def test_expected_attention_keeps_sinks_and_window(device: torch.device) -> None:
    case = CASES[1]
    p, views, *_ = ea_case(case, device)
    idx = set(get_policy("expected_attention", p).select(views, p.budget).tolist())
    assert len(idx) == p.budget
    assert set(range(p.sink_tokens)) | set(range(case.n - p.window, case.n)) <= idx


# --------------------------------------------------------------------------------------------------
# KeyDiff reference: s_i = -cos(k_i, mean of the normalised keys of the head)
# --------------------------------------------------------------------------------------------------


def ref_keydiff_layer(keys_t, p: PolicyParams, normalised_anchor: bool = True, sign: float = -1.0):
    """Scores [H_kv][n]; `normalised_anchor=False` (the mean of the raw keys) and `sign=+1` (keep
    the keys most similar to the anchor) are the wrong variants."""
    keys = keys_t.double().tolist()
    n, h_kv, d = keys_t.shape
    scores = []
    for h in range(h_kv):
        unit = []
        for i in range(n):
            norm = math.sqrt(dot(keys[i][h], keys[i][h]))
            unit.append([x / norm for x in keys[i][h]])
        src = unit if normalised_anchor else [keys[i][h] for i in range(n)]
        anchor = [sum(u[c] for u in src) / n for c in range(d)]
        a_norm = math.sqrt(dot(anchor, anchor))
        scores.append([sign * dot(unit[i], anchor) / a_norm for i in range(n)])
    return scores, set(range(max(n - p.recent_kept, 0), n))


def keydiff_error_bound(keys_t) -> float:
    """Largest |float32 - float64| of a cosine: the normalised keys' components carry (d + 4) u
    relative error each, the anchor, their mean over n, (n + d + 4) u of its length plus theirs,
    and normalising the anchor divides what it carries by its length (a mean of unit vectors can
    be short); the final dot product adds d u."""
    n, _, d = keys_t.shape
    k = keys_t.double()
    unit = k / k.norm(dim=-1, keepdim=True)
    shortest = unit.mean(dim=0).norm(dim=-1).min().item()
    return (2 * d + 8 + (n + d + 4) / shortest) * U32


def keydiff_case(case: Case, device: torch.device, **variant):
    p = PolicyParams(budget=KEEP, window=WINDOW)
    views, layer_scores, tol = [], [], 0.0
    for layer in range(LAYERS):
        keys, queries, positions = make_layer(case, layer, device)
        views.append(LayerView(keys=keys, queries=queries, positions=positions))
        s, prot = ref_keydiff_layer(keys, p, **variant)
        layer_scores.append(s)
        tol = max(tol, keydiff_error_bound(keys))
    ref, margin = ref_select(layer_scores, prot, case.n, KEEP)
    return p, views, layer_scores, ref, margin, tol


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_keydiff_matches_dense_reference(device: torch.device, case: Case) -> None:
    p, views, layer_scores, ref, margin, tol = keydiff_case(case, device)
    assert_matches_reference(get_policy("keydiff", p), views, layer_scores, ref, margin, tol, device)


def test_keydiff_reference_is_discriminative(device: torch.device) -> None:
    """An anchor from the raw keys, or +cosine (keeping the most typical keys), changes the kept sets."""
    results = [keydiff_case(c, device) for c in CASES]
    ours = [kept(get_policy("keydiff", p), views, KEEP) for p, views, *_ in results]
    assert ours != [keydiff_case(c, device, normalised_anchor=False)[3] for c in CASES]
    assert ours != [keydiff_case(c, device, sign=1.0)[3] for c in CASES]


def test_keydiff_reads_no_queries_and_keeps_the_window(device: torch.device) -> None:
    case = CASES[0]
    p, views, *_ = keydiff_case(case, device)
    bare = [LayerView(keys=v.keys, positions=v.positions) for v in views]
    pol = get_policy("keydiff", p)
    idx = pol.select(bare, p.budget)
    assert torch.equal(idx, pol.select(views, p.budget)) and idx.numel() == p.budget
    assert set(range(case.n - p.window, case.n)) <= set(idx.tolist())


# --------------------------------------------------------------------------------------------------
# Interface, registry, parameters, rules
# --------------------------------------------------------------------------------------------------


def test_registry_names(device: torch.device) -> None:
    assert available_policies() == ALL_POLICIES
    for name in ALL_POLICIES:
        pol = get_policy(name)
        assert pol.name == name
        assert pol.params == PolicyParams()
        assert isinstance(pol, Policy)


def test_unknown_policy_names_the_choices(device: torch.device) -> None:
    with pytest.raises(ValueError) as err:
        get_policy("lru")
    msg = str(err.value)
    assert "lru" in msg
    for name in ALL_POLICIES:
        assert name in msg


def test_duplicate_registration_rejected(device: torch.device) -> None:
    with pytest.raises(ValueError, match="already registered"):

        @register_policy
        class Fake(Policy):  # noqa: F841
            name = "rkv"

            def _score(self, view: LayerView) -> torch.Tensor:
                return torch.zeros(view.n_kv_heads, view.n)


@pytest.mark.parametrize(
    "field, value",
    [
        ("budget", 0),
        ("budget", 1.5),
        ("buffer", -1),
        ("window", 0),
        ("rkv_lambda", -0.1),
        ("rkv_lambda", 1.5),
        ("rkv_lambda", math.nan),
        ("rkv_threshold", 2.0),
        ("rkv_beta", -1),
        ("rkv_exemption", "last"),
        ("pool_kernel", 0),
        ("pool_kernel", 6),
        ("sink_tokens", -1),
        ("evict_chunk", 0),
        ("ea_future_positions", 0),
        ("ea_epsilon", -0.01),
        ("ea_covariance", 1),
        ("ea_value_norm", "yes"),
        ("rope_theta", 0.5),
        ("rope_theta", math.inf),
        ("rope_dim", 7),
        ("rope_dim", -2),
        ("rope_neox", None),
        ("budget", True),
    ],
)
def test_params_validation(device: torch.device, field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyParams(**{field: value})


def test_params_defaults_and_frozen(device: torch.device) -> None:
    p = PolicyParams()
    assert (p.budget, p.buffer, p.window, p.rkv_lambda, p.rkv_threshold, p.rkv_beta) == (
        128, 128, 8, 0.1, 0.5, 1)
    assert p.rkv_exemption == "own"  # Algorithm 1
    assert (p.pool_kernel, p.sink_tokens, p.evict_chunk) == (7, 4, 64)
    # Expected Attention: kvpress 0.5.5's ExpectedAttentionPress defaults
    assert (p.ea_future_positions, p.ea_covariance, p.ea_value_norm, p.ea_epsilon) == (512, True, True, 0.0)
    assert (p.rope_theta, p.rope_dim, p.rope_neox) == (10000.0, 0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget = 3  # type: ignore[misc]


def test_layer_view_validation(device: torch.device) -> None:
    randn = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    with pytest.raises(ValueError):
        LayerView(keys=randn(5, 2))
    with pytest.raises(ValueError):
        LayerView(keys=randn(5, 2, 4), queries=randn(2, 3, 4))  # 3 % 2 != 0
    with pytest.raises(ValueError):
        LayerView(keys=randn(5, 2, 4), positions=torch.arange(4, device=device))
    with pytest.raises(ValueError):
        LayerView(keys=randn(5, 2, 4), stats=torch.zeros(2, 6, device=device))
    view = LayerView(keys=randn(5, 2, 16))
    assert view.scale == pytest.approx(0.25)
    assert view.positions.device == device and view.positions.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "name", ["rkv", "snapkv", "kvcompress", "h2o", "streamingllm", "expected_attention", "keydiff"]
)
def test_amortised_target_length(device: torch.device, name: str) -> None:
    pol = get_policy(name, PolicyParams(budget=16, buffer=8))
    assert pol.target_length(10) is None
    assert pol.target_length(23) is None
    assert pol.target_length(24) == 16
    assert pol.target_length(500) == 16
    pol0 = get_policy(name, PolicyParams(budget=16, buffer=0))
    assert pol0.target_length(16) is None
    assert pol0.target_length(17) == 16


def test_batchmax_averages_a_shared_documents_entries_over_the_queries_that_saw_them(device: torch.device) -> None:
    """A request that started from a shared document of D = 50 tokens (`adapter/documents/__init__.py`)
    holds 6 of its entries (positions < 50) and its own 10 tokens from position 50; its statistic
    has only its own queries, from position 50 on (`LayerView.stats_since`). Every query attends 1
    to every entry it sees, so each entry's average is 1: a document's entry was seen by the 10
    queries since 50, not by the 60 - position since its own. Without `stats_since` (the average
    over all the queries since its own position) the document's entries scored 10 / (60 - p) and
    all ranked below the request's own, the oldest lowest."""
    pol = get_policy("batchmax", PolicyParams(budget=8))
    doc, own = [0, 5, 9, 20, 33, 40], list(range(50, 60))
    positions = torch.tensor(doc + own, device=device)
    n, h_kv = positions.numel(), 2
    seen = torch.arange(n, device=device)[None, :] <= (len(doc) + torch.arange(len(own), device=device))[:, None]
    probs = seen.float()[None].expand(2 * h_kv, -1, -1)  # [H_q, 10 queries, 16 entries], causal
    stats = pol.accumulate(None, probs, h_kv)
    view = LayerView(keys=torch.randn(n, h_kv, 4, device=device), positions=positions, stats=stats, stats_since=50)
    torch.testing.assert_close(pol.score(view), torch.full((h_kv, n), 2.0, device=device))  # the group of 2
    wrong = pol.score(dataclasses.replace(view, stats_since=0))
    assert (wrong[:, : len(doc)] < wrong[:, len(doc) :].min()).all()
    # a request that read its whole prompt (stats_since 0) is scored as before
    whole = LayerView(keys=view.keys, positions=torch.arange(n, device=device), stats=stats)
    expect = stats.double() / (n - torch.arange(n, device=device)).double()  # curr_id + 1 - kv_ids
    torch.testing.assert_close(pol.score(whole), expect.float())


def test_batchmax_target_length_evicts_chunks(device: torch.device) -> None:
    pol = get_policy("batchmax", PolicyParams(budget=128, evict_chunk=64))
    assert pol.target_length(127) is None
    assert pol.target_length(128) == 64
    assert pol.target_length(1000) == 64
    small = get_policy("batchmax", PolicyParams(budget=16, evict_chunk=64))
    assert small.target_length(16) == 8  # chunk clamped to budget // 2
    tiny = get_policy("batchmax", PolicyParams(budget=1))
    assert tiny.target_length(1) is None and tiny.target_length(2) == 1


def test_prefill_target_length(device: torch.device) -> None:
    p = PolicyParams(budget=16)
    for name in ["snapkv", "kvcompress", "h2o", "streamingllm", "batchmax", "expected_attention", "keydiff"]:
        pol = get_policy(name, p)
        assert pol.compress_after_prefill
        assert pol.prefill_target_length(16) is None
        # Batch-Max evicts as Algorithm 1 does at its ceiling: to budget - p (p clamped to 8 here)
        assert pol.prefill_target_length(17) == (8 if name == "batchmax" else 16)
    assert get_policy("rkv", p).prefill_target_length(1000) is None


@pytest.mark.parametrize(
    "name", ["snapkv", "kvcompress", "h2o", "streamingllm", "batchmax", "expected_attention", "keydiff"]
)
def test_no_decode_pass_right_after_the_prefill_pass(name: str, device: torch.device) -> None:
    """What a prompt keeps after prefill is not due for compression again at the first decode step."""
    pol = get_policy(name, PolicyParams(budget=16, buffer=4))
    kept = pol.prefill_target_length(100)
    assert kept is not None and pol.target_length(kept + 1) is None


def test_none_policy_never_compresses(device: torch.device) -> None:
    pol = get_policy("none", PolicyParams(budget=1, buffer=0))
    assert not pol.uses_stats and not pol.compress_after_prefill
    for n in [0, 1, 2, 100, 10**6]:
        assert pol.target_length(n) is None
        assert pol.prefill_target_length(n) is None


def test_score_marks_protected_as_inf_and_bf16_inputs_work(device: torch.device) -> None:
    case = CASES[1]
    keys, queries, positions = make_layer(case, 0, device)
    values = make_values(case, 0, device).bfloat16()
    view = LayerView(keys=keys.bfloat16(), queries=queries.bfloat16(), positions=positions, values=values)
    for name in ["rkv", "snapkv", "kvcompress", "expected_attention", "keydiff"]:
        pol = get_policy(name, PolicyParams(budget=KEEP))
        s = pol.score(view)
        assert s.dtype == torch.float32 and s.shape == (case.h_kv, case.n) and s.device == device
        sinks = pol.params.sink_tokens if name == "expected_attention" else 0
        assert torch.isinf(s[:, :sinks]).all() and torch.isinf(s[:, -WINDOW:]).all()
        assert torch.isfinite(s[:, sinks:-WINDOW]).all()
        assert pol.select([view], KEEP).numel() == KEEP


def test_select_rejects_mismatched_layers(device: torch.device) -> None:
    pol = get_policy("streamingllm")
    with pytest.raises(ValueError):
        views = [LayerView(keys=torch.randn(n, 1, 4, device=device)) for n in (5, 6)]
        pol.select(views, 3)
    with pytest.raises(ValueError):
        pol.select([], 3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(ALL_POLICIES),
    n=st.integers(1, 40),
    keep=st.integers(0, 50),
    h_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 24),
    window=st.integers(1, 10),
    keep_recent=st.sampled_from([0, 0, 5, 16]),
    layers=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_property(device, name, n, keep, h_kv, group, budget, window, keep_recent, layers, seed) -> None:
    """select returns exactly min(keep, n) sorted unique indices, all protected ones if they fit."""
    gen = torch.Generator().manual_seed(seed)
    pol = get_policy(name, PolicyParams(budget=budget, window=window, keep_recent=keep_recent))
    d = 4
    rng = random.Random(seed)
    positions = torch.tensor(sorted(rng.sample(range(3 * n + 1), n)), device=device)
    views = []
    for _ in range(layers):
        keys = torch.randn(n, h_kv, d, generator=gen).to(device)
        queries = torch.randn(min(window, n), h_kv * group, d, generator=gen).to(device)
        values = torch.randn(n, h_kv, d, generator=gen).to(device)
        stats = None
        if pol.uses_stats and name != "kvcompress":
            stats = pol.accumulate(None, random_probs(gen, h_kv * group, 2, n, None).to(device), h_kv)
        recon = torch.rand(h_kv, n, generator=gen).to(device) if pol.uses_reconstruction else None
        views.append(LayerView(keys=keys, queries=queries, positions=positions, stats=stats, values=values,
                               reconstruction=recon))
    idx = pol.select(views, keep)
    assert idx.dtype == torch.int64 and idx.device == device
    lst = idx.tolist()
    assert len(lst) == min(keep, n)
    assert lst == sorted(set(lst))
    assert all(0 <= i < n for i in lst)
    prot = set(torch.nonzero(pol.protected(views[0])).flatten().tolist())
    if len(prot) <= min(keep, n):
        assert prot <= set(lst)
    else:
        assert set(lst) <= prot
    if pol.uses_stats:
        carried = pol.carry_stats(views[0], idx)
        assert carried is None or carried.shape == (h_kv, len(lst))


@pytest.mark.parametrize("name", ["rkv", "snapkv", "kvcompress", "expected_attention", "keydiff"])
def test_keep_recent_protects_more_than_the_window(device: torch.device, name: str) -> None:
    """keep_recent widens what is always kept, beyond the observation window's own tokens."""
    gen = torch.Generator().manual_seed(5)
    n, window, recent = 60, 4, 20
    keys = torch.randn(n, 2, 8, generator=gen).to(device)
    queries = torch.randn(window, 4, 8, generator=gen).to(device)
    views = [LayerView(keys=keys, queries=queries, values=keys.flip(0))]
    pol = get_policy(name, PolicyParams(budget=32, window=window, keep_recent=recent, sink_tokens=0))
    prot = pol.protected(views[0])
    assert prot.device == device
    assert torch.nonzero(prot).flatten().tolist() == list(range(n - recent, n))
    kept = set(pol.select(views, 32).tolist())
    assert set(range(n - recent, n)) <= kept and len(kept) == 32
    # below the window, keep_recent changes nothing
    narrow = get_policy(name, PolicyParams(budget=32, window=window, keep_recent=2))
    plain = get_policy(name, PolicyParams(budget=32, window=window))
    assert torch.equal(narrow.protected(views[0]), plain.protected(views[0]))


@pytest.mark.parametrize("spare_recent", [False, True])
def test_rkv_sampled_redundancy_is_exact_below_and_close_above_the_reference_count(
    device: torch.device, spare_recent: bool
) -> None:
    """Long prompts: eq. (6)'s mean similarity estimated from evenly spaced reference keys."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 2, 16, generator=g)
    keys = base[torch.randint(0, 40, (1500,), generator=g)] + 0.3 * torch.randn(1500, 2, 16, generator=g)
    keys = keys.to(device)
    exact = rkv_module.redundancy_scores(keys, 0.5, 1, spare_recent=spare_recent)
    assert exact.device == device
    # as many references as keys is the exact path; on CUDA, spare_recent's scatter_add_ adds in
    # no fixed order, so two calls may differ in the last bit
    same = rkv_module.redundancy_scores(keys, 0.5, 1, reference_keys=1500, spare_recent=spare_recent)
    if device.type == "cpu":
        assert torch.equal(same, exact)
    else:
        torch.testing.assert_close(same, exact, rtol=1e-5, atol=0.0)
    approx = rkv_module.redundancy_scores(keys, 0.5, 1, reference_keys=512, spare_recent=spare_recent)
    corr = torch.corrcoef(torch.stack([exact.flatten(), approx.flatten()]))[0, 1]
    assert corr > 0.95, corr
    # R-KV keeps the LEAST redundant tokens (eq. 7 subtracts R): compare those
    least_exact = set((-exact[0]).topk(200).indices.tolist())
    least_approx = set((-approx[0]).topk(200).indices.tolist())
    assert len(least_exact & least_approx) / 200 > 0.8


def test_prompt_policy_pairs() -> None:
    """Which policy compresses a prompt: R-KV (decode-time, §3) names SnapKV; the others
    themselves. A prompt policy scoring from a statistic pairs only with a decode policy that
    keeps none it could misread."""
    from sgl_kvc.policies import decode_policies, prompt_policy_error, prompt_policy_name

    assert prompt_policy_name("rkv") == "snapkv"
    assert all(prompt_policy_name(p) == p for p in decode_policies() if p != "rkv")
    ok = [("rkv", "rkv"), ("rkv", "kvcompress"), ("h2o", "snapkv"), ("kvcompress", "streamingllm"),
          ("batchmax", "batchmax"), ("none", "h2o"), ("h2o", "auto")]
    assert all(prompt_policy_error(*pair) is None for pair in ok)
    refused = [("rkv", "h2o"), ("rkv", "batchmax"), ("h2o", "kvcompress"), ("h2o", "batchmax"), ("rkv", "none")]
    assert all(prompt_policy_error(*pair) for pair in refused)
    # the query-agnostic scorers keep no statistic: a prompt policy for every decode policy
    for prompt in ("expected_attention", "keydiff", "kvzip"):
        assert all(prompt_policy_error(decode, prompt) is None for decode in decode_policies())
    # KVzip compresses prompts only: never a request's (decode) policy
    assert "kvzip" not in decode_policies() and prompt_policy_error("kvzip", "auto")


def test_request_state_picks_the_policy_of_each_moment() -> None:
    from sgl_kvc.core.request_state import Budget, ReqKvState

    state = ReqKvState(policy=get_policy("rkv"), budget=Budget(8), prompt_policy="snapkv")
    assert [state.policy_name(m) for m in ("prefill", "chunk", "decode", "preempt")] == ["snapkv", "snapkv", "rkv", "rkv"]
    assert ReqKvState(policy=get_policy("h2o"), budget=Budget(8)).policy_name("prefill") == "h2o"


def test_reads_window_says_which_policies_score_from_the_window_queries(device: torch.device) -> None:
    """A cut between chunks reads the question's queries only for the policies whose scores move
    with the window (`Policy.reads_window`): checked on every registered policy by scoring one
    prompt's view twice, with two different windows (and what else a prompt pass gives it: the
    statistic of a policy that accumulates it while the prompt is read)."""
    g = torch.Generator().manual_seed(3)
    n, h_kv, h_q, d = 40, 2, 4, 8
    keys = torch.randn(n, h_kv, d, generator=g).to(device)
    rest = dict(values=torch.randn(n, h_kv, d, generator=g).to(device),
                stats=torch.rand(h_kv, n, generator=g).to(device),
                reconstruction=torch.rand(h_kv, n, generator=g).to(device))
    windows = [torch.randn(8, h_q, d, generator=g).to(device) for _ in range(2)]
    moved = set()
    for name in ALL_POLICIES:
        pol = get_policy(name)
        given = dict(rest, stats=rest["stats"] if pol.accumulate_prefill else None)
        a, b = (pol.score(LayerView(keys=keys, queries=w, **given)) for w in windows)
        if not torch.equal(a, b):
            moved.add(name)
    assert moved == {name for name in ALL_POLICIES if policy_class(name).reads_window}
    assert moved == {"rkv", "snapkv", "kvcompress", "expected_attention"}
