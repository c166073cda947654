"""KV-Compress (Rehg 2024), KVC-w with L2 aggregation and continual compression.

* Prefill metric (KVC-w, §4.3): squared attention of the w = ``window`` observation queries,
  summed over the queries and over the query group of each KV head (eq. 10 with squared A, as
  eq. 19 does for KVC-full), then max pooling with p = ``pool_kernel`` (eq. 8) over all n tokens.
  Attention: each query head's softmax over all n keys, causal mask inside the window.
* Continual compression (eq. 20): ``accumulate`` adds the squared attention of every decode query,
  summed over the group, to the metric; ``carry_stats`` after the prefill compression seeds the
  statistic with the pooled prefill metric M^(pool) of the kept tokens, so the statistic is exactly
  M^(cc) of eq. 20. ``accumulate_prefill`` is False: prefill queries enter only via M^(pool).
* ``score`` uses the statistic when present (eq. 20) and the observation queries otherwise
  (first compression, eq. 10 + 8). The observation window (last w tokens) is always kept.
* One top-k over the head-averaged metric (the paper's per-head budgets, §4.2, need per-head
  tables; the per-head scores are returned by ``score`` for that later).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ._ops import causal_window_probs, maxpool_tokens
from .base import LayerView, Policy, pad_stats
from .registry import register_policy


@register_policy
class KVCompressPolicy(Policy):
    name: ClassVar[str] = "kvcompress"
    uses_stats: ClassVar[bool] = True
    reads_window: ClassVar[bool] = True
    contribution_power: ClassVar[int] = 2  # `contribution` below
    accumulate_prefill: ClassVar[bool] = False
    compress_after_prefill: ClassVar[bool] = True
    variable_sort: ClassVar[bool] = True  # §4.2: evicts the lowest metrics across every layer and head

    def prefill_metric(self, view: LayerView) -> Tensor:
        """M^(pool) [H_kv, n] from the observation-window queries (eq. 10 squared, eq. 8)."""
        p = self.params
        queries = view.observation_queries(self.name, p.window)
        probs = causal_window_probs(queries, view.keys, view.scale)  # [H_kv, G, q, n]
        metric = probs.square().sum(dim=(1, 2))  # eq. (10) with squared attention (L2, §4.3)
        return maxpool_tokens(metric, p.pool_kernel)  # eq. (8): max pooling, size p

    def _score(self, view: LayerView) -> Tensor:
        if view.stats is not None:
            return pad_stats(view.stats, view.n)  # eq. (20): M^(cc)
        if view.n <= self.params.recent_kept:  # everything is protected
            return torch.zeros(view.n_kv_heads, view.n, device=view.keys.device)
        return self.prefill_metric(view)

    def contribution(self, grouped: Tensor) -> Tensor:
        return grouped.square().sum(dim=(-3, -2))  # eq. (20): + sum_i sum_{h in H_k} A^2

    def carry_stats(self, view: LayerView, keep: Tensor) -> Tensor | None:
        if view.stats is not None:
            return pad_stats(view.stats, view.n)[:, keep]
        if view.queries is None or view.queries.shape[0] == 0:
            return None
        return self.prefill_metric(view)[:, keep]  # seeds eq. (20) with M^(pool)
