"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens.

The first ``sink_tokens`` cached tokens (4) are protected; the rest rank by recency (logical
position), so ``select(views, k)`` keeps the sinks and the k - sinks most recent tokens. Sinks keep
their original RoPE positions (positions are logical). Trimming is amortised like the others
(once n >= budget + buffer, back to budget).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy
from .registry import register_policy


@register_policy
class StreamingLLMPolicy(Policy):
    name: ClassVar[str] = "streamingllm"
    uses_stats: ClassVar[bool] = False
    compress_after_prefill: ClassVar[bool] = True
    question_free: ClassVar[bool] = True

    def protected(self, view: LayerView) -> Tensor:
        mask = torch.zeros(view.n, dtype=torch.bool, device=view.keys.device)
        mask[: self.params.sink_tokens] = True
        return mask

    def _score(self, view: LayerView) -> Tensor:
        # recency: later logical position = higher score (float32 holds every position below 2^24
        # exactly, far past any context length)
        recency = view.positions.float()
        return recency.expand(view.n_kv_heads, view.n)
