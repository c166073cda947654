"""KeyDiff (Park et al. 2025, arXiv 2504.15364; kvpress KeyDiffPress): keep the most distinctive keys.

Geometrically distinctive keys tend to receive high attention, so KeyDiff ranks a key by how far its
direction lies from the KV head's average key direction; it reads no query at all, which suits the
chunk moment, where a prompt is compressed before its question is read.

* Anchor (the paper's mu(K^) = (1/n) sum_i k_i / ||k_i||): the mean of the normalised keys of the
  KV head, over every cached entry of the head (kvpress: the whole cache it compresses).
* Score (the paper's s_i = -CosSim(mu(K^), k_i)): minus the cosine similarity of each key with the
  anchor; the keys least similar to it are kept. The paper evicts block by block as a prompt is
  read, which is what the chunk moment does between chunks.
* GQA: keys belong to the KV head; no query group is involved.
* Protected: the observation window (``recent_kept``), as the other prompt-time policies here (not in
  the paper, which scores every key; kvpress protects nothing either). No sinks: neither the paper
  nor kvpress keeps any (a sink's key, far from the others, tends to score high by itself).
* Scores lie in [-1, 1] in every head, so the variable and layer budgets compare heads directly.
Prefill-time method; in decode the same amortised budget + buffer rule as the others.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy
from .registry import register_policy

_EPS = 1e-8  # norm floor, torch.nn.functional.cosine_similarity's


@register_policy
class KeyDiffPolicy(Policy):
    name: ClassVar[str] = "keydiff"
    uses_stats: ClassVar[bool] = False
    compress_after_prefill: ClassVar[bool] = True
    question_free: ClassVar[bool] = True

    def _score(self, view: LayerView) -> Tensor:
        keys = view.keys.float()  # [n, H_kv, d]
        unit = keys / keys.norm(dim=-1, keepdim=True).clamp_min(_EPS)  # k_i / ||k_i||
        anchor = unit.mean(dim=0)  # mu(K^) per KV head: [H_kv, d]
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        return -torch.einsum("nhd,hd->hn", unit, anchor)  # s_i = -CosSim(mu(K^), k_i)
