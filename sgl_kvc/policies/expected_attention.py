"""Expected Attention (Devoto, Jeblick, Jégou 2025, arXiv 2510.00636; kvpress ExpectedAttentionPress).

A key is scored by the attention that FUTURE queries are expected to pay it, not by the attention of
the queries seen so far: future queries are modelled as Gaussian, q ~ N(mu, Sigma), from the
statistics of recent queries moved to the coming positions, and E[exp(s q.k)] has a closed form
(the Gaussian moment-generating function). That suits the chunk moment, where a prompt is compressed
before its question is read.

Steps (the paper's method, in kvpress 0.5.5's order; the formulas are written next to each step):

1. Query statistics. kvpress (``get_query_statistics``, its docstring's steps 1-3) takes the mean mu~
   and covariance Sigma~ of the pre-RoPE queries of the whole prompt but its first ``n_sink``, and
   moves them to the coming positions with Rbar = (1/F) sum_{t=T}^{T+F-1} R(t) (T = the prompt's
   length, F = ``ea_future_positions``; ``apply_avg_rope``): mu = Rbar mu~, Sigma = Rbar Sigma~
   Rbar^T. Here they come, when the caller gives them (``LayerView.query_mean``, ``query_cov``),
   from every query of the prompt read so far, accumulated chunk by chunk
   (`sgl_kvc.core.query_moments`, which undoes RoPE with :func:`prerope_queries`; a prefix reused
   from the radix tree was never computed, and only the rest of the prompt counts); the
   covariance term is then k^T Rbar Sigma~ Rbar^T k = (Rbar^T k)^T Sigma~ (Rbar^T k), with
   Rbar^T k one complex multiplication per rotated pair of k. Otherwise (a decode-time pass, a
   prompt no longer than its sinks) they come from the last ``window`` observation queries
   (``LayerView.queries``, after RoPE, at the last q logical positions p_j): each is moved to the
   future, q_j was rotated by R(p_j), a future query at position t is R(t) q~_j = R(t - p_j) q_j,
   and averaging over t = T..T+F-1 gives a_j = Rbar_j q_j with Rbar_j = (1/F) sum_t R(t - p_j):
   on each rotated pair of dimensions a multiplication by the mean phasor
   (1/F) sum_t e^{i (t - p_j) theta}. Since every Rbar_j equals Rbar R(-p_j), mean(a_j) = Rbar mu~
   and cov(a_j) = Rbar Sigma~ Rbar^T over the window's queries. Only the offsets t - p_j (F plus
   the window's span at most) enter those angles, so no large position loses precision. RoPE
   parameters (base, rotary dimensions, layout) are the served model's (``PolicyParams.rope_*``,
   filled in by the adapter); scaled RoPE variants (Llama 3, YaRN) are advanced with the unscaled
   frequencies base^(-2i/r).
2. Covariance. From the window's q queries, Sigma = (1/q) sum_j c_j c_j^T (c_j = a_j - mu; kvpress
   also divides by the sample count), so k^T Sigma k = (1/q) sum_j (c_j.k)^2: q dot products per
   key, never a d x d matrix; a rank <= q - 1 estimate from q (8) samples. From the whole prompt,
   a d x d matrix per query head (d^2 per key and head, kvpress's cost). Either is a non-negative
   term that cannot overflow the softmax (logits are shifted by their max). It stays on by
   default (kvpress ``use_covariance=True``); ``ea_covariance=False`` keeps the mean term alone.
3. Expected logits, then softmax over keys: l_i = s mu.k_i + (s^2 / 2) k_i^T Sigma k_i (s the
   softmax scale, 1/sqrt(d): kvpress's mu.k/sqrt(d) + k^T Sigma k / (2d)), normalised over every
   key but the sinks (kvpress's softmax domain; the observation window takes part).
4. GQA: the mean over the query group of each query head's normalised expected attention (kvpress
   averages the group), so each KV head's scores still sum to 1 before step 5.
5. Value norm: (E[a_i] + epsilon) * ||v_i|| (kvpress ``use_vnorm``, ``epsilon``), the expected
   size of the token's contribution to the residual stream; ``LayerView.values`` is read from the
   pool for this policy only (``uses_values``).

Defaults are kvpress 0.5.5's (``kvpress/presses/expected_attention_press.py``): n_future_positions
512, n_sink 4 (``sink_tokens``), use_covariance and use_vnorm True, epsilon 0.0 (its leaderboard
entry, wrapped in AdaKV, passes epsilon=1e-2; its LUKV press 2e-2). The first ``sink_tokens``
tokens are always kept (kvpress gives them the top score) and, as the other prompt-time policies
here, the observation window (``recent_kept``), which kvpress does not protect.
Prefill-time method; in decode the same amortised budget + buffer rule as the others.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy, PolicyParams
from .registry import register_policy


def mean_future_phasor(
    offsets: Tensor, params: PolicyParams, head_dim: int
) -> tuple[Tensor, Tensor]:
    """Real and imaginary parts [..., r/2] (float32) of (1/F) sum_{s<F} e^{i (offset + s) theta_i}
    for integer ``offsets`` [...] (future position minus the query's), theta_i = base^(-2i/r)
    the model's rotary frequencies, r its rotary dimensions, F = ``ea_future_positions``."""
    r = params.rope_dim or head_dim
    if r > head_dim:
        raise ValueError(f"rope_dim={r} exceeds the head dimension {head_dim}")
    device = offsets.device
    # float64: F x r/2 angles of up to F + window radians, averaged once per call
    theta = params.rope_theta ** (-torch.arange(0, r, 2, dtype=torch.float64, device=device) / r)
    steps = torch.arange(params.ea_future_positions, dtype=torch.float64, device=device)
    future = steps[:, None] * theta  # the average R-bar over the next F positions (kvpress step 2)
    w_re, w_im = future.cos().mean(dim=0), future.sin().mean(dim=0)
    own = offsets.to(torch.float64)[..., None] * theta  # R(T - p_j): from the query to T
    c, s = own.cos(), own.sin()
    return (c * w_re - s * w_im).float(), (s * w_re + c * w_im).float()


def rope_angles(positions: Tensor, params: PolicyParams, head_dim: int) -> Tensor:
    """The angles [..., r/2] (float32) by which the model's RoPE rotated the queries at
    ``positions`` [...], computed as SGLang's ``RotaryEmbedding`` computes its cos/sin cache
    (float32: inv_freq = 1 / base^(2i/r), angle = t x inv_freq, one rounded product), so that
    undoing them cancels the model's own rotation up to the rounding of cos, sin and the products,
    where float64 angles would differ from the model's by up to t x 2^-24 radians."""
    r = params.rope_dim or head_dim
    inv_freq = 1.0 / (
        params.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=positions.device) / r)
    )
    return positions.to(torch.float32)[..., None] * inv_freq


def prerope_queries(queries: Tensor, positions: Tensor, params: PolicyParams) -> Tensor:
    """The float32 queries [e, H, d] before RoPE, from ``queries`` after it at logical ``positions``
    [e]: RoPE is a rotation per pair of dimensions, q = R(p) q~, so q~ = R(p)^T q = R(-p) q, each
    pair multiplied by e^{-i p theta} (the same angles as the model's, `rope_angles`). Exact for
    the plain RoPE the model runs with; dimensions past the rotary ones pass unchanged."""
    angles = rope_angles(positions, params, queries.shape[-1])[:, None, :]  # [e, 1, r/2]
    return rotate_pairs(queries.float(), angles.cos(), -angles.sin(), params.rope_dim, params.rope_neox)


def rotate_pairs(x: Tensor, re: Tensor, im: Tensor, rope_dim: int, neox: bool) -> Tensor:
    """Multiply each rotated pair of dimensions of x [..., d] by the complex number re + i im
    ([..., r/2], broadcast): the pair (x1, x2) becomes (x1 re - x2 im, x1 im + x2 re), a RoPE
    rotation when |re + i im| = 1. Dimensions past the rotary ones are left as they are."""
    r = rope_dim or x.shape[-1]
    if neox:  # Llama / GPT-NeoX: dimension i pairs with i + r/2
        x1, x2 = x[..., : r // 2], x[..., r // 2 : r]
    else:  # GPT-J: dimension 2i pairs with 2i + 1
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
    y1, y2 = x1 * re - x2 * im, x1 * im + x2 * re
    rotated = torch.cat([y1, y2], dim=-1) if neox else torch.stack([y1, y2], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., r:]], dim=-1)


@register_policy
class ExpectedAttentionPolicy(Policy):
    name: ClassVar[str] = "expected_attention"
    uses_stats: ClassVar[bool] = False
    reads_window: ClassVar[bool] = True
    uses_values: ClassVar[bool] = True
    uses_query_moments: ClassVar[bool] = True
    compress_after_prefill: ClassVar[bool] = True

    def prerope_queries(self, queries: Tensor, positions: Tensor) -> Tensor:
        return prerope_queries(queries, positions, self.params)

    def protected(self, view: LayerView) -> Tensor:
        mask = super().protected(view)  # the observation window
        mask[: self.params.sink_tokens] = True  # kvpress n_sink: scored above every other token
        return mask

    def _score(self, view: LayerView) -> Tensor:
        p = self.params
        n, h_kv, d = view.keys.shape
        sinks = min(p.sink_tokens, n)
        out = torch.zeros(h_kv, n, dtype=torch.float32, device=view.keys.device)
        if n <= sinks + p.recent_kept:  # everything is protected
            return out
        if p.ea_value_norm and view.values is None:
            raise ValueError(f"policy {self.name!r} needs the cached values (LayerView.values)")
        keys = view.keys.float()[sinks:]  # the sinks are kept and take no part (kvpress)
        scale = float(view.scale)
        if view.query_mean is not None:
            logits = self._prompt_logits(view, keys, scale)
        else:
            logits = self._window_logits(view, keys, scale)
        expected = torch.softmax(logits, dim=-1)  # normalised over the keys (kvpress's softmax)
        expected = expected.mean(dim=1)  # Step 4, GQA: mean over the query group
        if p.ea_value_norm:  # Step 5: (E[a_i] + epsilon) ||v_i||
            norms = view.values[sinks:].float().norm(dim=-1).transpose(0, 1)  # [H_kv, n - sinks]
            expected = (expected + p.ea_epsilon) * norms
        out[:, sinks:] = expected
        return out

    def _prompt_logits(self, view: LayerView, keys: Tensor, scale: float) -> Tensor:
        """Expected logits [H_kv, G, n - sinks] from the moments of the prompt's pre-RoPE queries
        (step 1, kvpress's statistics over the whole prompt read so far)."""
        p = self.params
        h_kv, d = view.n_kv_heads, keys.shape[-1]
        mu = view.query_mean.float().reshape(h_kv, -1, d)  # [H_kv, G, d], pre-RoPE
        pos = view.positions
        # T, the position after the last token (kvpress: q_len), per KV head: [H_kv]
        nxt = (pos[..., -1] + 1).reshape(-1).expand(h_kv)
        re, im = mean_future_phasor(nxt, p, d)  # Rbar(T) = (1/F) sum_{s<F} R(T + s): [H_kv, r/2]
        mu = rotate_pairs(mu, re[:, None], im[:, None], p.rope_dim, p.rope_neox)  # mu = Rbar mu~
        logits = torch.einsum("kgd,nkd->kgn", mu, keys) * scale
        if p.ea_covariance and view.query_cov is not None:
            # k^T (Rbar Sigma~ Rbar^T) k = (Rbar^T k)^T Sigma~ (Rbar^T k); Rbar^T: the conjugate phasor
            moved = rotate_pairs(keys, re, -im, p.rope_dim, p.rope_neox)  # [n, H_kv, d]
            cov = view.query_cov.float().reshape(h_kv, -1, d, d)  # [H_kv, G, d, d]
            sk = torch.einsum("kgde,nke->kgnd", cov, moved)
            quad = (sk * moved.transpose(0, 1)[:, None]).sum(dim=-1)  # [H_kv, G, n]
            logits = logits + quad * (scale * scale / 2)
        return logits

    def _window_logits(self, view: LayerView, keys: Tensor, scale: float) -> Tensor:
        """Expected logits [H_kv, G, n - sinks] from the observation window's queries (step 1's
        fallback)."""
        p = self.params
        h_kv, d = view.n_kv_heads, keys.shape[-1]
        queries = view.observation_queries(self.name, p.window)  # [q, H_q, d], after RoPE
        q = queries.shape[0]
        # Every query lies past the sinks here (n > sinks + window), as kvpress's statistics do.
        queries = queries.reshape(q, h_kv, -1, d)  # [q, H_kv, G, d]: query head h -> KV head h // G
        pos = view.positions
        query_pos = pos[..., -q:]  # [q], or [H_kv, q] per head
        offsets = (pos[..., -1:] + 1) - query_pos  # T - p_j: from each query to the next position
        if offsets.dim() == 2:
            offsets = offsets.transpose(0, 1)[:, :, None]  # [q, H_kv, 1]
        else:
            offsets = offsets[:, None, None]  # [q, 1, 1]
        re, im = mean_future_phasor(offsets, p, d)
        # Step 1: a_j = Rbar_j q_j, the query moved to the average of the next F positions
        moved = rotate_pairs(queries, re, im, p.rope_dim, p.rope_neox)  # [q, H_kv, G, d]
        mu = moved.mean(dim=0)  # mean of the future query distribution
        # Step 3: the Gaussian moment-generating function, E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2)
        logits = torch.einsum("kgd,nkd->kgn", mu, keys) * scale
        if p.ea_covariance and q > 1:
            centred = moved - mu  # c_j; Sigma = (1/q) sum_j c_j c_j^T (step 2)
            proj = torch.einsum("qkgd,nkd->kgqn", centred, keys)
            logits = logits + proj.square().mean(dim=2) * (scale * scale / 2)  # k^T Sigma k
        return logits
