"""Engine-agnostic KV-cache eviction policies (plain torch; no SGLang import here).

Importing this package registers every policy; use :func:`get_policy` / :func:`available_policies`.
"""

from __future__ import annotations

from . import (  # noqa: F401  (register)
    batchmax, expected_attention, h2o, keydiff, kvcompress, kvzip, none, rkv, snapkv, streamingllm,
)
from .batchmax import BatchMaxPolicy
from ._ops import gqa_logits
from .base import RKV_EXEMPTIONS, LayerView, Policy, PolicyParams
from .expected_attention import ExpectedAttentionPolicy
from .h2o import H2OPolicy
from .keydiff import KeyDiffPolicy
from .kvcompress import KVCompressPolicy
from .kvzip import KVzipPolicy
from .none import NoPolicy
from .per_head import (
    BUDGET_MODES,
    DEFAULT_SELECTION,
    SELECTIONS,
    HeadSelection,
    carry_stats_per_head,
    select_from_scores,
    select_per_head,
    token_scores,
)
from .registry import (
    AUTO,
    available_policies,
    canonical_policy,
    decode_policies,
    get_policy,
    policy_class,
    prompt_policy_error,
    prompt_policy_name,
    register_policy,
)
from .rkv import RKVPolicy
from .snapkv import SnapKVPolicy
from .streamingllm import StreamingLLMPolicy

__all__ = [
    "AUTO",
    "BUDGET_MODES",
    "DEFAULT_SELECTION",
    "RKV_EXEMPTIONS",
    "SELECTIONS",
    "BatchMaxPolicy",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "HeadSelection",
    "KeyDiffPolicy",
    "KVCompressPolicy",
    "KVzipPolicy",
    "LayerView",
    "NoPolicy",
    "Policy",
    "PolicyParams",
    "RKVPolicy",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "available_policies",
    "canonical_policy",
    "carry_stats_per_head",
    "decode_policies",
    "get_policy",
    "gqa_logits",
    "policy_class",
    "prompt_policy_error",
    "prompt_policy_name",
    "register_policy",
    "select_from_scores",
    "select_per_head",
    "token_scores",
]
