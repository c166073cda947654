"""Expected Attention from the moments of the whole prompt's queries, accumulated chunk by chunk.

The reference is kvpress 0.5.5's `ExpectedAttentionPress`, re-written in float64 from its source
(`get_query_statistics`, `apply_avg_rope`, `score`): the mean and covariance (divided by N) of the
pre-RoPE queries of the context but its first n_sink, both moved by the mean RoPE matrix
Rbar = mean_t (cos(t) I + sin(t) P) over t = T..T+F-1, expected logits
K mu / sqrt(d) + K Sigma K^T / (2d) over the non-sink keys, softmax, mean over the query group,
(score + epsilon) ||v||. The policy gets its statistics from `QueryMoments`, fed the queries as
the model hands them to attention (after RoPE, float32) in 2-3 chunks; wrong variants (the
window's queries alone, the post-RoPE queries' moments) must disagree with the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvc.core.query_moments import QueryMoments
from sgl_kvc.policies import LayerView, PolicyParams, get_policy

pytestmark = pytest.mark.usefixtures("single_thread")

H_KV, GROUP, D = 2, 3, 16
N = 150  # prompt tokens read so far; T = N
CHUNKS = [(0, 60), (60, 110), (110, 150)]
THETA = 10000.0
TOL = 2e-4  # relative, on scores of float32 data against the float64 reference


def _params(**kw) -> PolicyParams:
    return PolicyParams(budget=20, window=8, ea_future_positions=64, rope_theta=THETA, **kw)


def _model_rope(pre: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What the model hands to attention: pre-RoPE queries [e, H, d] rotated as SGLang's
    `RotaryEmbedding` rotates them (NeoX layout; float32 angles t x inv_freq, its cos/sin cache),
    in float32."""
    inv_freq = 1.0 / (THETA ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    ang = (positions.float()[:, None] * inv_freq)[:, None, :].double()
    x1, x2 = pre[..., : D // 2], pre[..., D // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1).float()


def _data(seed: int = 0):
    """Pre-RoPE queries [N, H_q, d] (float64: a mean per head plus correlated noise), the model's
    post-RoPE queries, and a cache of 70 keys/values at increasing positions ending at N - 1."""
    g = torch.Generator().manual_seed(seed)
    h_q = H_KV * GROUP
    mean = 2.0 * torch.randn(h_q, D, generator=g, dtype=torch.float64)
    mix = torch.randn(h_q, D, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    pre = mean + torch.einsum("hij,nhj->nhi", mix, torch.randn(N, h_q, D, generator=g, dtype=torch.float64))
    post = _model_rope(pre, torch.arange(N))
    n = 70
    keys = torch.randn(n, H_KV, D, generator=g)
    values = torch.randn(n, H_KV, D, generator=g) * (0.5 + torch.rand(n, H_KV, 1, generator=g))
    positions = torch.sort(torch.randperm(N - 1, generator=g)[: n - 1]).values
    positions = torch.cat([positions, torch.tensor([N - 1])])
    return pre, post, keys, values, positions


def kvpress_scores(pre: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, T: int, p: PolicyParams,
                   first: int = 0) -> torch.Tensor:
    """kvpress's ExpectedAttentionPress in float64: `pre` [S, H_q, d] the pre-RoPE queries of the
    context from logical position `first` on (kvpress: first = 0, all of them). Scores
    [H_kv, n], the sinks' columns 0."""
    q = pre.double()[max(0, p.sink_tokens - first):]  # hidden_states[:, n_sink:]
    mu = q.mean(dim=0)  # [H_q, d]
    centred = q - mu
    cov = torch.einsum("shi,shj->hij", centred, centred) / q.shape[0]
    # apply_avg_rope: R = cos I + sin P over positions T..T+F-1 (HF cos/sin: the half angles repeated)
    inv_freq = 1.0 / (p.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    t = torch.arange(T, T + p.ea_future_positions, dtype=torch.float64)
    freqs = torch.cat([t[:, None] * inv_freq, t[:, None] * inv_freq], dim=-1)  # [F, d]
    eye = torch.eye(D, dtype=torch.float64)
    P = torch.zeros(D, D, dtype=torch.float64)
    P[D // 2 :, : D // 2], P[: D // 2, D // 2 :] = torch.eye(D // 2), -torch.eye(D // 2)
    R = (freqs.cos()[:, :, None] * eye + freqs.sin()[:, :, None] * P).mean(dim=0)
    mu = mu @ R.T
    cov = R @ cov @ R.T
    sinks = p.sink_tokens
    k = keys.double()[sinks:]  # [m, H_kv, d]
    k_rep = k.repeat_interleave(GROUP, dim=1)  # repeat_kv: query head h uses KV head h // G
    scores = torch.einsum("mhd,hd->hm", k_rep, mu) / math.sqrt(D)
    if p.ea_covariance:
        scores = scores + torch.einsum("mhi,hij,mhj->hm", k_rep, cov, k_rep) / D / 2
    scores = torch.softmax(scores, dim=-1).view(H_KV, GROUP, -1).mean(dim=1)
    if p.ea_value_norm:
        scores = (scores + p.ea_epsilon) * values.double()[sinks:].norm(dim=-1).T
    return torch.nn.functional.pad(scores, (sinks, 0))


def _moments(post: torch.Tensor, p: PolicyParams, chunks=CHUNKS, prerope=None) -> QueryMoments:
    policy = get_policy("expected_attention", p)
    m = QueryMoments(1, p.sink_tokens, p.ea_covariance, prerope or policy.prerope_queries)
    for a, b in chunks:
        m.add(0, post[a:b], torch.arange(a, b), a)
    return m


def _view(keys, values, positions, post, m: QueryMoments | None, window: int = 8) -> LayerView:
    mean, cov = (None, None) if m is None else m.statistics(0)
    return LayerView(keys=keys, queries=post[-window:], positions=positions, values=values,
                     query_mean=mean, query_cov=cov)


def _ours(p: PolicyParams, view: LayerView) -> torch.Tensor:
    """The policy's scores, protected tokens (sinks, window) zeroed as in the reference's."""
    pol = get_policy("expected_attention", p)
    scores = pol.score(view).double()
    prot = pol.protected(view)
    return scores.masked_fill(prot, 0.0)


def _rel(ours: torch.Tensor, ref: torch.Tensor, p: PolicyParams, n: int) -> float:
    """Largest relative difference over the scored (unprotected) columns."""
    cols = torch.arange(p.sink_tokens, n - p.recent_kept)
    a, b = ours[:, cols], ref[:, cols]
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


@pytest.mark.parametrize("option", [{}, {"ea_covariance": False}, {"ea_value_norm": False, "ea_epsilon": 0.01}])
def test_moments_over_chunks_match_kvpress(option: dict) -> None:
    p = _params(**option)
    pre, post, keys, values, positions = _data()
    ref = kvpress_scores(pre, keys, values, N, p)
    ours = _ours(p, _view(keys, values, positions, post, _moments(post, p)))
    assert _rel(ours, ref, p, keys.shape[0]) < TOL


def test_merged_moments_equal_one_pass_over_the_prompt() -> None:
    """Chan's pairwise merge over 3 chunks = the mean and covariance of all the queries at once
    (float64 reference on the pre-RoPE queries, the sinks left out)."""
    p = _params()
    pre, post, *_ = _data(1)
    mean, cov = _moments(post, p).statistics(0)
    q = pre[p.sink_tokens :]
    ref_mean = q.mean(dim=0)
    ref_cov = torch.einsum("shi,shj->hij", q - ref_mean, q - ref_mean) / q.shape[0]
    assert torch.allclose(mean.double(), ref_mean, rtol=0, atol=1e-5 * ref_mean.abs().max())
    assert torch.allclose(cov.double(), ref_cov, rtol=0, atol=1e-5 * ref_cov.abs().max())
    one = _moments(post, p, chunks=[(0, N)]).statistics(0)
    assert torch.allclose(one[1], cov, rtol=0, atol=1e-5 * ref_cov.abs().max())


def test_wrong_statistics_disagree_with_kvpress() -> None:
    """The window's 8 queries alone, or the post-RoPE queries' moments, are not kvpress's."""
    p = _params()
    pre, post, keys, values, positions = _data()
    ref = kvpress_scores(pre, keys, values, N, p)
    n = keys.shape[0]
    window = _ours(p, _view(keys, values, positions, post, None))
    post_rope = _ours(p, _view(keys, values, positions, post, _moments(post, p, prerope=lambda q, pos: q.float())))
    last_chunk = _ours(p, _view(keys, values, positions, post, _moments(post, p, chunks=CHUNKS[-1:])))
    for wrong in (window, post_rope, last_chunk):
        assert _rel(wrong, ref, p, n) > 100 * TOL


def test_a_reused_prefix_counts_only_the_queries_computed() -> None:
    """A request that reused a cached prefix of 60 tokens computed only the queries from 60 on:
    its moments are kvpress's statistics over those (`first` = 60: no sink among them)."""
    p = _params()
    pre, post, keys, values, positions = _data(2)
    ours = _ours(p, _view(keys, values, positions, post, _moments(post, p, chunks=CHUNKS[1:])))
    assert _rel(ours, kvpress_scores(pre[60:], keys, values, N, p, first=60), p, keys.shape[0]) < TOL
    assert _rel(ours, kvpress_scores(pre, keys, values, N, p), p, keys.shape[0]) > 100 * TOL


def test_sinks_are_left_out_whichever_chunk_holds_them() -> None:
    """Positions below sink_tokens never count, also when a chunk starts among them."""
    p = _params()
    _, post, *_ = _data(3)
    m = _moments(post, p, chunks=[(0, 2), (2, 9), (9, 30)])
    assert m.counts[0] == 30 - p.sink_tokens
    whole = _moments(post, p, chunks=[(0, 30)])
    assert torch.allclose(m.statistics(0)[0], whole.statistics(0)[0], atol=1e-5)
    assert torch.allclose(m.statistics(0)[1], whole.statistics(0)[1], atol=1e-4)
    tiny = _moments(post, p, chunks=[(0, 3)])
    assert tiny.counts[0] == 0 and tiny.statistics(0) == (None, None)  # the window's queries then


def test_per_head_views_score_as_the_layer() -> None:
    """`LayerView.head` hands each KV head its query group's moments."""
    p = _params()
    _, post, keys, values, positions = _data(4)
    view = _view(keys, values, positions, post, _moments(post, p))
    pol = get_policy("expected_attention", p)
    whole = pol.score(view)
    for h in range(H_KV):
        assert torch.allclose(pol.score(view.head(h))[0], whole[h], rtol=1e-5, atol=0)


def test_prerope_undoes_the_models_rotation() -> None:
    pre, post, *_ = _data(5)
    back = get_policy("expected_attention", _params()).prerope_queries(post, torch.arange(N))
    assert torch.allclose(back.double(), pre, rtol=0, atol=1e-5 * pre.abs().max())
