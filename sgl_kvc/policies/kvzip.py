"""KVzip (Kim et al. 2025, arXiv 2505.23416; kvpress `KVzipPress`): keep what the model needs to
reconstruct the context.

* Score (§3.2): the largest attention any query of a teacher-forced pass that repeats the context
  ("Repeat the previous context exactly.", then the context's tokens) pays an entry, maximised
  over the query heads of its KV group. The pass runs inside the scheduler before the policy
  chooses (`sgl_kvc/core/reconstruction.py` computes the score, the adapter runs the pass); the
  policy reads it from ``LayerView.reconstruction``. It never reads the question: one compressed
  context serves every question about it.
* Allocation (§3.3): one threshold over every layer, head and entry (kvpress sorts them all
  together), wherever the pool lets heads keep different numbers (``--kv-head-budget variable`` or
  ``layer``). With uniform budgets (the default server) a per-head top-k loses the facts to a copy
  head's flat scores, so every head keeps the same tokens, sorted once by their mean score over
  every layer and head: it needs about 1.5x the entries of the one sort (docs/quality.md, "Which
  allocation each policy gets").
* Protected: the system prompt and whatever follows the context, which the pass does not score
  (+inf in the score: the authors keep the system prompt; kvpress keeps its first ``sink_tokens``),
  and the recent window (``recent_kept``) as the other prompt policies here.
* A prompt policy only: the score needs the pass, which runs at the prompt moments (after prefill,
  between chunks). Decoding is compressed by the request's decode policy.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from .base import LayerView, Policy
from .registry import register_policy


@register_policy
class KVzipPolicy(Policy):
    name: ClassVar[str] = "kvzip"
    uses_stats: ClassVar[bool] = False
    compress_after_prefill: ClassVar[bool] = True
    uses_reconstruction: ClassVar[bool] = True
    prompt_only: ClassVar[bool] = True
    question_free: ClassVar[bool] = True
    # KVzip's scores are each entry's attention while the model repeats its context: the paper and
    # kvpress keep the top ratio of them over every head at once. Per layer (or per head) a copy
    # head, which scores most of its context near 1, crowds out the facts (docs/quality.md,
    # "Which allocation each policy gets": 1 of 8 pass keys per layer, 8 of 8 in one sort).
    global_sort: ClassVar[bool] = True

    def _score(self, view: LayerView) -> Tensor:
        if view.reconstruction is None:
            raise ValueError("policy 'kvzip' needs the scores of its reconstruction pass (LayerView.reconstruction)")
        return view.reconstruction.float()

    def protected(self, view: LayerView) -> Tensor:
        mask = super().protected(view)
        if view.reconstruction is not None:
            mask |= torch.isinf(view.reconstruction).all(dim=0)  # what the pass never scored
        return mask
