"""The prefix cache backend: SGLang's `RadixCache` plus this project's bookkeeping.

Registered with SGLang's `register_radix_cache_backend` and selected by the launcher with
`--radix-cache-backend sgl_kvc`. For now the tree behaves exactly like SGLang's Python
`RadixCache`; it adds per-request accounting of prompt tokens and prefix hits, read by
`/v1/kvc/stats`. The compression rule (the tree holds only full, exact KV) builds on this class.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    default_radix_cache_factory,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

logger = logging.getLogger(__name__)


@dataclass
class PrefixStats:
    """Prompt tokens of finished requests, and how many of them came from the tree."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0


class KvcRadixCache(RadixCache):
    def __init__(self, params) -> None:
        super().__init__(params)
        self.prefix_stats = PrefixStats()

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        # Retracted requests are released too, and again when they finish: count at finish only.
        # SGLang computes `cached_tokens` once per request, at its first admission.
        if req.finished():
            self.prefix_stats.requests += 1
            self.prefix_stats.prompt_tokens += len(req.origin_input_ids)
            self.prefix_stats.hit_tokens += req.cached_tokens


def create(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    unsupported = {
        "--disable-radix-cache": ctx.disable_radix_cache,
        "hybrid SWA model": ctx.is_hybrid_swa,
        "hybrid SSM model": ctx.is_hybrid_ssm,
        "--enable-hierarchical-cache": ctx.enable_hierarchical_cache,
    }
    reasons = [k for k, v in unsupported.items() if v]
    if reasons:
        logger.warning("sgl-kvc prefix cache not used (%s): SGLang's default applies", reasons)
        return default_radix_cache_factory(ctx)
    return KvcRadixCache(ctx.params)


def register(name: str) -> None:
    if get_radix_cache_factory(name) is None:
        register_radix_cache_backend(name, create)
