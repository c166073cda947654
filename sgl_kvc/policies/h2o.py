"""H2O (Zhang et al. 2023): heavy hitters by accumulated attention plus a recent window.

* Statistic: the sum of attention each token has received from every query so far (prefill
  included), summed over the query group of its KV head (KV-Compress eq. 6 / eq. 9).
* Split as in the original: the most recent ``budget // 2`` tokens are protected (recent window),
  the other ``budget - budget // 2`` slots go to the heaviest hitters. The recent window is sized
  from ``params.budget``, whatever ``keep`` a caller passes to ``select``.
* Decode: amortised (trim to budget once n >= budget + buffer) instead of the original's one
  eviction per step, which would run a compaction every decode step; with buffer=0 it is the
  original per-step rule.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy, pad_stats
from .registry import register_policy


@register_policy
class H2OPolicy(Policy):
    name: ClassVar[str] = "h2o"
    uses_stats: ClassVar[bool] = True
    contribution_power: ClassVar[int] = 1  # `contribution` below
    accumulate_prefill: ClassVar[bool] = True
    compress_after_prefill: ClassVar[bool] = True

    def recent_size(self) -> int:
        return self.params.budget // 2

    def protected(self, view: LayerView) -> Tensor:
        mask = torch.zeros(view.n, dtype=torch.bool, device=view.keys.device)
        mask[max(view.n - self.recent_size(), 0):] = True
        return mask

    def _score(self, view: LayerView) -> Tensor:
        if view.stats is None:
            raise ValueError("policy 'h2o' needs accumulated attention (LayerView.stats)")
        return pad_stats(view.stats, view.n)

    def contribution(self, grouped: Tensor) -> Tensor:
        return grouped.sum(dim=(-3, -2))  # sum over queries and the query group (eq. 9)
