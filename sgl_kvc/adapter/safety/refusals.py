"""Start-up refusals a compressing server makes in the scheduler process, where the model and the
attention backends SGLang built are known (the launcher refuses what the flags alone show).

Compaction models one layout: every attention layer keeps full-attention KV of each token in
page-size-1 slots, observed by sgl-kvc's wrapper of the attention backend. A model with sliding-
window layers beside full ones (hybrid SWA), MLA's compressed latent cache, or state-space layers
has KV that compaction would cut wrongly; a backend sgl-kvc does not wrap (a split prefill /
decode pair becomes SGLang's hybrid backend) leaves the observation store unattached, and every
compressing request would fail at its first compression. Either is refused in one line before
the server takes a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.config import KvcConfig

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"


def unsupported_layout(use_mla: bool, hybrid_swa: bool, state_space: bool, policy: str) -> str | None:
    """Why a model with this KV layout cannot be compressed, in one line; None if it can."""
    what = ("MLA attention (a compressed latent KV cache)" if use_mla else
            "sliding-window layers beside full-attention ones (hybrid SWA)" if hybrid_swa else
            "state-space layers" if state_space else None)
    if what is None:
        return None
    return (f"--policy {policy} does not support this model: it uses {what}, whose KV sgl-kvc's "
            "compaction does not model (serve it with --policy none)")


def unattached_backend(backend: Any, policy: str) -> str | None:
    """Why the attention backend SGLang built cannot be observed, in one line; None if it can."""
    from sgl_kvc.adapter.attention import WRAPPED_BACKENDS, is_kvc_backend

    if is_kvc_backend(backend):
        return None
    return (f"--policy {policy} observes attention through sgl-kvc's wrapper of the "
            f"{' or '.join(WRAPPED_BACKENDS)} backend, but this server built {type(backend).__name__} "
            "(a different --prefill-attention-backend and --decode-attention-backend?): use one "
            "attention backend for both")


def _refuse_layout(policy: str) -> Callable[..., Any]:
    def hook(result: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
        if not kvc.is_draft_worker:
            problem = unsupported_layout(bool(kvc.use_mla_backend), bool(kvc.is_hybrid_swa),
                                         kvc.mambaish_config is not None, policy)
            if problem:
                raise SystemExit(f"sgl-kvc: {problem}")
        return result

    return hook


def _refuse_unattached(policy: str) -> Callable[..., Any]:
    def hook(result: Any, runner: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        if not runner.is_draft_worker:
            for backend in (runner.attn_backend, runner.decode_attn_backend):
                problem = None if backend is None else unattached_backend(backend, policy)
                if problem:
                    raise SystemExit(f"sgl-kvc: {problem}")
        return result

    return hook


def hook_table(config: KvcConfig) -> list[Hook]:
    if not config.compressing:
        return []
    return [
        Hook(f"{_CONFIGURATOR}.configure", _refuse_layout(config.policy), "AFTER", (),
             "refuse a model whose KV layout compaction does not model"),
        Hook(f"{_RUNNER}.init_attention_backends", _refuse_unattached(config.policy), "AFTER", (),
             "refuse an attention backend the observation store cannot attach to"),
    ]
