"""R-KV: redundancy-aware decode-time compression (Cai et al., eq. 1-7 and Algorithm 1).

Choices the paper leaves open, and how this module makes them:

* Size: §3.1 keeps B_budget tokens IN TOTAL: the alpha observation tokens plus the top
  B_budget - alpha candidates. Algorithm 1 (lines 46 and 50) would keep B_budget candidates plus
  alpha (B_budget + alpha in total). We follow §3.1, so ``select(views, budget)`` returns exactly
  ``budget`` tokens and the cache oscillates between budget and budget + buffer (Alg. 1 line 2).
* Attention (Alg. 1 line 12): the softmax runs over the N_c candidate keys only (the observation
  tokens are not candidates); all candidates precede all observation queries, so no mask is needed.
  (The public code softmaxes over all keys with a causal mask; ranks can differ slightly.)
* GQA (eq. 3): max over the query group of the LOGITS, then softmax.
* Importance (Alg. 1 lines 14-16): mean over the alpha queries first, then 1-D max pooling with the
  odd kernel ``pool_kernel`` centred on the token (eq. 4's window of half-width W, here W =
  (kernel - 1) / 2 on both sides), over candidates only.
* Redundancy (eq. 5-6 / Alg. 1 lines 18-35): per KV head, over candidates; T = 0.5, beta = 1.
  Exact up to ``rkv_reference_keys`` (1024) candidates; a longer prompt's mean similarity is
  estimated against 1024 evenly spaced candidates (linear, not quadratic, in the prompt).
* Exemption (Alg. 1 lines 25-32): u's similarity to its beta most recent similar tokens leaves u's
  own mean (Alg. 1; eq. 6 as printed). The public code takes it from the recent token's mean
  instead (the newest of similar tokens is then the least redundant, as §3.3's prose describes):
  ``rkv_exemption="recent"`` (``--rkv-exemption recent``). The default stays Algorithm 1's; how the
  two compare is measured in docs/quality.md, "Long generation".
* Head and layer aggregation: mean over KV heads (Alg. 1 line 44), then mean over layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch
from torch import Tensor

from ._ops import gqa_logits, maxpool_tokens
from .base import LayerView, Policy
from .registry import register_policy

_EPS = 1e-8  # R-KV eq. (5) epsilon
# Bound on the similarity block held at once (elements): on a CPU a block that stays in cache
# (4 MB of float32) scores a long prompt faster than large blocks; on a GPU larger blocks mean
# fewer kernel launches.
_SIM_CHUNK_ELEMS: Mapping[str, int] = MappingProxyType({"cpu": 1 << 20})  # by device type
_SIM_CHUNK_ELEMS_DEFAULT = 1 << 24


def redundancy_scores(
    keys: Tensor,
    threshold: float,
    beta: int,
    reference_keys: int | None = None,
    spare_recent: bool = False,
) -> Tensor:
    """R [H_kv, m] of eq. (6) for candidate keys [m, H_kv, d] (rows processed in blocks).

    With ``reference_keys`` < m, each candidate is compared with that many evenly spaced
    candidates only: eq. (6)'s mean similarity estimated from a sample, O(m x reference_keys)
    instead of O(m^2). The beta exemption then applies within the sample.

    Which mean the exemption lowers: by default token u's own (Alg. 1 lines 25-32: S_uv <- 0 for
    u's beta most recent similar v, then the mean of row u). With ``spare_recent``, as the public
    code does (``cal_similarity``: zero [u, last similar of u], then the mean over rows), the
    similarity is taken from the recent token v's mean instead, so among similar tokens the most
    recent is the least redundant (§3.3: "we retain only the beta most recently generated tokens
    among those exhibiting high similarity").
    """
    k = keys.float().transpose(0, 1)  # [H, m, d]
    h, m, _ = k.shape
    k_norm = k / (k.norm(dim=-1, keepdim=True) + _EPS)  # R-KV eq. (5) / Alg. 1 line 19
    if reference_keys is not None and reference_keys < m:
        # Evenly spaced, more than one apart (reference_keys < m), so rounding leaves them
        # distinct: no `unique`, which on a GPU would wait for it.
        ref = torch.linspace(0, m - 1, reference_keys, device=k.device).round().long()
    else:
        ref = torch.arange(m, device=k.device)
    # References most recent first, so that a row's first similar column is its most recent
    # similar key (Alg. 1 line 27's "largest indices v"): a max over booleans finds it, with no
    # [H, m, r] float tensor of indices to rank.
    ref = ref.flip(0)
    k_ref = k_norm[:, ref]  # [H, r, d]
    r = int(ref.numel())
    exact = r == m  # every candidate is a reference: its own entry lies on an anti-diagonal
    s_bar = torch.empty(h, m, dtype=torch.float32, device=k.device)
    # with spare_recent: what each candidate's mean loses to the candidates that spare it
    taken = None
    if spare_recent and beta > 0:
        taken = torch.zeros(h, m, dtype=torch.float32, device=k.device)
    block = _SIM_CHUNK_ELEMS.get(k.device.type, _SIM_CHUNK_ELEMS_DEFAULT)
    rows = max(1, block // max(1, h * r))
    rank = torch.arange(r, 0, -1, dtype=torch.float32, device=k.device)  # recency of each ref
    for start in range(0, m, rows):  # blocks of rows, not a loop over tokens
        stop = min(m, start + rows)
        sim = torch.matmul(k_norm[:, start:stop], k_ref.transpose(1, 2))  # eq. (5): S = K K^T
        # eq. (5): S_ii <- 0 (Alg. 1 lines 21-23); O(rows) writes when exact
        if exact:
            u = torch.arange(stop - start, device=k.device)
            sim[:, u, m - 1 - start - u] = 0.0
        else:
            own = ref[None, :] == torch.arange(start, stop, device=k.device)[:, None]  # [rows, r]
            sim.masked_fill_(own[None], 0.0)
        row_sum = sim.sum(dim=-1)
        if beta > 0:
            similar = sim > threshold  # Alg. 1 line 24: B_uv = [S_uv > T]
            if beta == 1:  # the paper's default: the first similar column, if any
                found, top_idx = similar.max(dim=-1, keepdim=True)
            else:
                top_key, top_idx = torch.where(similar, rank, 0.0).topk(min(beta, r), dim=-1)
                found = top_key > 0
            # Alg. 1 lines 25-31: S_uv <- 0 for the (up to) beta most recent similar v;
            # done by removing those entries from the sum they would enter
            spared = sim.gather(-1, top_idx) * found  # [H, rows, beta]
            # from v's mean (S is symmetric: v's row sum is its column's); on CUDA the atomic adds
            # land in no fixed order, so scores may differ in the last bit from run to run
            if taken is not None:
                taken.scatter_add_(1, ref[top_idx].reshape(h, -1), spared.reshape(h, -1))
            else:
                row_sum -= spared.sum(dim=-1)
        s_bar[:, start:stop] = row_sum / r  # eq. (6) / Alg. 1 line 32: mean similarity
    if taken is not None:
        s_bar -= taken / m  # every candidate u may spare a v; an exact mean when r == m
    return torch.softmax(s_bar, dim=-1)  # eq. (6) / Alg. 1 line 34: R = softmax(S_bar)


@register_policy
class RKVPolicy(Policy):
    name: ClassVar[str] = "rkv"
    uses_stats: ClassVar[bool] = False
    reads_window: ClassVar[bool] = True
    compress_after_prefill: ClassVar[bool] = False  # decode-time method (§3.1)
    # §3: "Different from existing KV cache compression methods [SnapKV, PyramidKV, ...] that
    # focus on the prefilling stage ..., our R-KV focuses on the decoding stage"; its redundancy
    # term (weight 0.9, eq. 7) targets repeated reasoning steps, not a prompt's text. Measured on
    # prompts of four filler styles at budgets 128 and 256, R-KV's own selection kept 23 of the
    # full cache's 58 answers, SnapKV 31 (docs/quality.md, "Prompt and decode policies"), so by
    # default the prompt is SnapKV's and the generated tokens R-KV's.
    prompt_policy: ClassVar[str | None] = "snapkv"

    def score_cost(self, n: int) -> int:
        # Redundancy compares each candidate with up to `rkv_reference_keys` others (eq. 5-6), so
        # a token costs more than one unit (a token of a linear-cost scorer such as SnapKV); the
        # divisor was fitted to timings (docs/architecture.md, "Staged passes").
        return n * (1 + min(n, self.params.rkv_reference_keys) // 48)

    def _score(self, view: LayerView) -> Tensor:
        p = self.params
        n = view.n
        n_cand = n - min(p.window, n)  # Alg. 1 lines 5-7: last alpha tokens are observations
        out = torch.zeros(view.n_kv_heads, n, dtype=torch.float32, device=view.keys.device)
        if n_cand == 0:
            return out
        queries = view.observation_queries(self.name, p.window)
        cand_keys = view.keys[:n_cand]
        logits = gqa_logits(queries, cand_keys, view.scale)  # eq. (2): [H_kv, G, alpha, N_c]
        attn = torch.softmax(logits.amax(dim=1), dim=-1)  # eq. (3): max over group, softmax
        importance = maxpool_tokens(attn.mean(dim=1), p.pool_kernel)  # eq. (4), Alg. 1 l. 14-16
        redundancy = redundancy_scores(  # eq. (5)-(6)
            cand_keys, p.rkv_threshold, p.rkv_beta, p.rkv_reference_keys,
            spare_recent=p.rkv_exemption == "recent",
        )
        lam = p.rkv_lambda
        out[:, :n_cand] = lam * importance - (1.0 - lam) * redundancy  # eq. (7): Z
        return out
