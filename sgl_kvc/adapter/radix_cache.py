"""The prefix cache of a compressing server: SGLang's Python `RadixCache`.

Registered with SGLang's `register_radix_cache_backend` as `sgl_kvc` and selected by the
launcher (`--radix-cache-backend sgl_kvc`) for compressing policies only; `--policy none` keeps
SGLang's own choice. Compaction's radix rule (the tree holds only full, exact KV; a compacting
request copies what it keeps of its tree-owned prefix and drops its lock,
`adapter/compaction.py`) is written against this class's locking and eviction
(`inc_lock_ref` / `dec_lock_ref`, `evict`), which is why compressing servers pin it rather than
SGLang's default `UnifiedRadixCache`.
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    default_radix_cache_factory,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

logger = logging.getLogger(__name__)


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
    return RadixCache(ctx.params)


def register(name: str) -> None:
    if get_radix_cache_factory(name) is None:
        register_radix_cache_backend(name, create)
