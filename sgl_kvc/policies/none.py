"""``none``: never compresses (plain SGLang behaviour)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy
from .registry import register_policy


@register_policy
class NoPolicy(Policy):
    name: ClassVar[str] = "none"

    def _score(self, view: LayerView) -> Tensor:
        # Only reached if a caller forces select(): keep the most recent tokens.
        return view.positions.float().expand(view.n_kv_heads, view.n)

    def protected(self, view: LayerView) -> Tensor:
        return view.positions.new_zeros(view.n, dtype=torch.bool)

    def target_length(self, n: int) -> int | None:
        return None

    def prefill_target_length(self, n: int) -> int | None:
        return None
