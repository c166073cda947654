"""The thin layer that touches SGLang internals (pinned to sglang==0.5.23).

Everything outside this package (policies, kernels, config, the demo model) is plain Python and
torch. `install()` runs once per SGLang process, from the plugin entry point.
"""

from __future__ import annotations

import logging

from sgl_kvc.config import KvcConfig

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
RADIX_CACHE_BACKEND = "sgl_kvc"


def install(config: KvcConfig) -> None:
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        logger.warning(
            "sgl-kvc is pinned to sglang==%s but found %s; hooks may not apply",
            SGLANG_VERSION,
            sglang.__version__,
        )
    from sgl_kvc.adapter import (
        attention, fp8_pool, hooks, memory_budget, radix_cache, request_guard, unit_pool,
    )

    radix_cache.register(RADIX_CACHE_BACKEND)
    attention.register()
    fp8_pool.register(config, unit_pool.fp8_unit_pool_class(config))  # FP8: per-layer or unit layout
    unit_pool.register(config)  # --kv-head-budget variable in the model's dtype
    memory_budget.register(config)  # after fp8_pool: it reads the budget that one may fix
    hooks.register(config)
    request_guard.register()  # HTTP process: out-of-vocabulary prompt token ids are a 400


def verify_applied(config: KvcConfig) -> list[str]:
    """Hook targets SGLang did not patch (its registry only logs a failed patch); call after
    `load_plugins()`. Every process loads the same code, so the launcher's check stands for all."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_kvc.adapter import hooks, request_guard

    wanted = [target for target, _, _ in hooks.hook_table(config)] + [request_guard.TARGET]
    return [t for t in wanted if t not in HookRegistry._patched]
