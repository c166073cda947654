"""SnapKV (Li et al. 2024): attention of an observation window, pooled, window kept.

* Window w = ``window`` (8 as in KV-Compress's SnapKV baseline; 32 also common). The last w
  tokens are the observation window and are always kept.
* Attention: each query head's softmax over ALL n keys with a causal mask inside the window (as the
  SnapKV code does), summed over the window queries (KV-Compress eq. 7), for candidates only.
* GQA: mean over the query group (SnapKV-style GQA ports average the group; R-KV appendix A.2),
  applied before pooling.
* Max pooling with kernel ``pool_kernel`` (7) over the candidates only (SnapKV code pools
  ``attn[..., :-w]``; KV-Compress eq. 8).
* Prefill-time method; in decode the same amortised budget + buffer rule as the others.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from ._ops import causal_window_probs, maxpool_tokens
from .base import LayerView, Policy
from .registry import register_policy


@register_policy
class SnapKVPolicy(Policy):
    name: ClassVar[str] = "snapkv"
    uses_stats: ClassVar[bool] = False
    reads_window: ClassVar[bool] = True
    compress_after_prefill: ClassVar[bool] = True

    def _score(self, view: LayerView) -> Tensor:
        p = self.params
        n = view.n
        n_cand = n - min(p.window, n)
        out = torch.zeros(view.n_kv_heads, n, dtype=torch.float32, device=view.keys.device)
        if n_cand == 0:
            return out
        queries = view.observation_queries(self.name, p.window)
        probs = causal_window_probs(queries, view.keys, view.scale)  # [H_kv, G, q, n]
        votes = probs[..., :n_cand].sum(dim=2)  # KV-Compress eq. (7): sum over window queries
        votes = votes.mean(dim=1)  # GQA: mean over the query group
        out[:, :n_cand] = maxpool_tokens(votes, p.pool_kernel)  # KV-Compress eq. (8) pooling
        return out
