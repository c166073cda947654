"""The thin layer that touches SGLang internals (pinned to sglang==0.5.23; every internal it
relies on is listed in `sglang_api`).

Everything outside this package (the core, policies, kernels, config, the demo model) is plain
Python and torch. `install()` runs once per SGLang process, from the plugin entry point;
`check()` runs once in the launcher, before serving.
"""

from __future__ import annotations

import logging

from sgl_kvc.adapter.sglang_api import SGLANG_VERSION, Hook
from sgl_kvc.config import KvcConfig

logger = logging.getLogger(__name__)

RADIX_CACHE_BACKEND = "sgl_kvc"


class HookTargetMissing(RuntimeError):
    """A function sgl-kvc hooks does not exist in the installed SGLang (another version?)."""


def hook_table(config: KvcConfig) -> list[Hook]:
    """Every hook sgl-kvc registers for `config`, in registration order (the FP8 pool's fixed
    size before the KV memory's probe of it)."""
    from sgl_kvc.adapter import decode_graphs, hooks
    from sgl_kvc.adapter.documents import chat_documents
    from sgl_kvc.adapter.memory import fp8_pool, kv_memory, unit_pool
    from sgl_kvc.adapter.safety import refusals
    from sgl_kvc.adapter.scheduling import request_guard

    return [
        *refusals.hook_table(config),  # scheduler start-up: models and backends compaction cannot serve
        *hooks.hook_table(config),
        *decode_graphs.hook_table(config),  # --kv-decode-graphs on: the store before SGLang captures
        *fp8_pool.hook_table(config, unit_pool.fp8_unit_pool_class(config)),  # FP8: per-layer or unit layout
        *unit_pool.hook_table(config),  # --kv-head-budget variable / layer
        *kv_memory.hook_table(config),
        *request_guard.hook_table(),  # HTTP process: out-of-vocabulary prompt token ids are a 400
        # HTTP process: a chat document's tokens, from SGLang's own prompt of the request
        *(chat_documents.hook_table() if config.compressing else []),
    ]


def install(config: KvcConfig) -> None:
    """Register sgl-kvc's backends and hooks with SGLang; refuse if a hook target is missing,
    rather than serve with a hook silently not applied (SGLang only logs a failed patch)."""
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        logger.warning("sgl-kvc is written for sglang==%s but found %s; the launcher checks what it "
                       "relies on", SGLANG_VERSION, sglang.__version__)
    from sgl_kvc.adapter import attention
    from sgl_kvc.adapter.documents import radix_cache
    from sgl_kvc.adapter.sglang_api import resolve

    table = hook_table(config)
    missing = []
    for hook in table:
        try:
            resolve(hook.target)
        except (ImportError, AttributeError, ValueError):
            missing.append(hook.target)
    if missing:
        raise HookTargetMissing(f"sgl-kvc cannot hook {', '.join(missing)} in this SGLang; it is "
                                f"written for sglang=={SGLANG_VERSION}")
    radix_cache.register(RADIX_CACHE_BACKEND)
    attention.register()
    for hook in table:
        HookRegistry.register(hook.target, hook.fn, HookType[hook.kind])


def check(config: KvcConfig) -> list[str]:
    """What the installed SGLang does not offer as sgl-kvc relies on it, one line each: every
    internal of `sglang_api.INTERNALS` and every hook target (signatures, attributes), and the
    hooks SGLang did not apply. Call after `load_plugins()`: every process loads the same code,
    so the launcher's check stands for all."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_kvc.adapter.sglang_api import INTERNALS, problems

    table = hook_table(config)
    found = problems([*INTERNALS, *(hook.internal() for hook in table)])
    found += [f"{target}: not patched by SGLang (see the log above)"
              for target in dict.fromkeys(hook.target for hook in table) if target not in HookRegistry._patched]
    return found
