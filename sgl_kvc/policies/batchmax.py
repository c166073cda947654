"""Batch-Max average attention (Metel et al. 2025, §3.2 and Algorithm 1).

* Statistic: ``sum_weights`` += attention of every processed query (prefill blocks and decode
  steps), summed over the query group of the KV head (eq. 9-style GQA aggregation; a constant
  factor G per KV head, so the ranking is the mean over the group).
* Score: ``ave_weights = sum_weights / (curr_id + 1 - kv_ids)`` where ``kv_ids`` are the logical
  positions and ``curr_id`` is the position of the newest cached token (its query was the last
  one accumulated). This assumes every query since a token existed was accumulated
  (``accumulate_prefill`` is True).
* No recency window: the division removes the bias (§3.2), so nothing is protected.
* Decode (Algorithm 1): once the cache holds ``budget`` tokens (|kv| = ceil(kv)), evict
  ``evict_chunk`` (p = 64) of them: target = budget - p, with p clamped to budget // 2 (our
  addition, for budgets the paper never used: it ran ceil(kv) >= 896). The cache then ranges over
  [budget - p, budget]. A prompt over the budget is trimmed after prefill as Algorithm 1 trims
  the cache when it reaches ``budget``, to ``budget - p``: the next eviction is p decode steps
  later, not at the first one.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy, pad_stats
from .registry import register_policy


@register_policy
class BatchMaxPolicy(Policy):
    name: ClassVar[str] = "batchmax"
    aliases: ClassVar[tuple[str, ...]] = ("avgattn",)  # its name before; accepted for a release
    uses_stats: ClassVar[bool] = True
    contribution_power: ClassVar[int] = 1  # `contribution` below
    accumulate_prefill: ClassVar[bool] = True
    compress_after_prefill: ClassVar[bool] = True

    def protected(self, view: LayerView) -> Tensor:
        return torch.zeros(view.n, dtype=torch.bool, device=view.keys.device)

    def _score(self, view: LayerView) -> Tensor:
        if view.stats is None:
            raise ValueError("policy 'batchmax' needs accumulated attention (LayerView.stats)")
        sums = pad_stats(view.stats, view.n)
        pos = view.positions.to(torch.float64)
        # positions are [n] or, per head, [H_kv, n]: curr_id is the newest token any head holds
        # Batch-Max §3.2: curr_id + 1 - kv_ids, the queries each entry was seen by. An entry older
        # than the statistic's first query (a shared document's, `LayerView.stats_since`) was seen
        # by the queries since then only: divided by all the queries since its own position, a
        # document's entries would all rank below the request's own, the oldest lowest.
        seen_by = (pos.max() + 1.0 - pos.clamp_min(float(view.stats_since))).clamp_min(1.0)
        return (sums.double() / seen_by).float()  # Batch-Max §3.2: ave_weights

    def contribution(self, grouped: Tensor) -> Tensor:
        return grouped.sum(dim=(-3, -2))  # Batch-Max §3.2: sum_weights += sum_i attn[i]

    def target_length(self, n: int) -> int | None:
        p = self.params
        if n < p.budget:
            return None
        # Batch-Max Algorithm 1: if |kv| = ceil(kv), remove p KV pairs. p is clamped to budget // 2
        # so that a small budget never collapses the cache to a handful of tokens.
        chunk = min(p.evict_chunk, max(p.budget // 2, 1))
        target = max(p.budget - chunk, 1)
        return target if target < n else None

    def prefill_target_length(self, n: int) -> int | None:
        # Algorithm 1's eviction, once the prompt is over the budget: trimmed to the budget itself,
        # the cache would be at its ceiling and the first decode step would evict again.
        return self.target_length(n) if n > self.params.budget else None
