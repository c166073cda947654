"""`--kv-head-budget auto` made explicit before the server starts: `policy` (sgl-kvc's unit pool)
where the server can have it, else `uniform` (SGLang's own pool), with the line that says which
and why (`resolve_head_budget`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from sgl_kvc.config import HEAD_BUDGET_AUTO, KERNEL_DECODE_ATTENTION, KvcConfig
from sgl_kvc.launcher.flags import sglang_flags
from sgl_kvc.launcher.refusals import KVC_POOL_BACKENDS, gpu_unsupported
from sgl_kvc.launcher.sglang_argv import DEMO_ALIAS, default_attention_backend


def unit_pool_unavailable(config: KvcConfig, argv: list[str], on_gpu: bool, flashinfer: bool = True,
                          capability: tuple[int, int] | None = None) -> str | None:
    """Why a compressing server with SGLang flags `argv` cannot have the unit pool, in a few words;
    None if it can. `flashinfer`: whether FlashInfer is installed (on a GPU: a server that names no
    backend keeps FlashInfer, which reads SGLang's own pool only); `capability`: the GPU's."""
    if config.kv_selection != "per-head":
        return f"--kv-selection {config.kv_selection}"
    if config.kv_decode_attention not in KERNEL_DECODE_ATTENTION:
        return f"--kv-decode-attention {config.kv_decode_attention}"
    flags = sglang_flags(argv)
    tp = flags.get("--tp-size")
    if tp != 1:
        return f"--tp-size {tp}"
    main = flags.get("--attention-backend") or default_attention_backend(
        on_gpu, config.fp8_kv is not None, False, flashinfer)
    for flag in ("--attention-backend", "--decode-attention-backend", "--prefill-attention-backend"):
        value = flags.get(flag) or main
        if value not in KVC_POOL_BACKENDS:
            return f"{flag} {value}"
    if on_gpu and capability is not None and gpu_unsupported(replace(config, kv_head_budget="policy"), capability):
        return f"a GPU of compute capability {capability[0]}.{capability[1]}"
    model = flags.get("--model-path")
    if model is not None and model != DEMO_ALIAS:
        return attention_the_unit_pool_cannot_serve(Path(model).expanduser() / "config.json")
    return None


def attention_the_unit_pool_cannot_serve(config_json: Path) -> str | None:
    """What of a model's attention, as its `config.json` describes it (or its `text_config`'s, a
    multimodal model's language model), sgl-kvc's per-head decode kernel does not implement, in a
    few words; None where it says nothing of the kind, or cannot be read (a model id SGLang
    downloads). A logit cap (`attn_logit_softcapping`) and a sliding window named per layer
    (`layer_types`, or a `sliding_window_pattern`) are what SGLang's models build windowed layers
    from; a `sliding_window` alone, SGLang's Llama, Mistral, Qwen2 and Phi-3 do not apply. The
    scheduler checks the layers SGLang built (`unit_pool.unsupported_model`) and refuses what this
    did not foresee, naming `--kv-head-budget uniform`."""
    import json

    try:
        top = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    for part in (top, top.get("text_config")):
        if not isinstance(part, dict):
            continue
        cap = part.get("attn_logit_softcapping")
        if isinstance(cap, (int, float)) and cap > 0:
            return f"a logit cap in the model's attention (attn_logit_softcapping {cap} in its config.json)"
        layers = part.get("layer_types")
        if (isinstance(layers, list) and "sliding_attention" in layers) or (
                part.get("sliding_window_pattern") and part.get("sliding_window")):
            return f"a sliding window in the model's attention ({part.get('sliding_window')} tokens in its config.json)"
    return None


def resolve_head_budget(config: KvcConfig, argv: list[str], on_gpu: bool, flashinfer: bool = True,
                        capability: tuple[int, int] | None = None) -> tuple[KvcConfig, str | None]:
    """`--kv-head-budget auto` made explicit: `policy` (the unit pool; KVzip gets its one sort over
    every head, every other policy uniform rows) where the server can have the unit pool, else
    `uniform`; and the line the launcher logs about it (None: nothing to say)."""
    if config.kv_head_budget != HEAD_BUDGET_AUTO:
        return config, None
    if not config.compressing:
        return config, None  # no pool of sgl-kvc's: `auto` is uniform (`KvcConfig.variable_budget`)
    why = unit_pool_unavailable(config, argv, on_gpu, flashinfer, capability)
    if why is None:
        return replace(config, kv_head_budget="policy"), (
            "sgl-kvc: --kv-head-budget policy (auto): the unit pool; KVzip sorts every head at once, "
            "the other policies keep --kv-budget per head (--kv-head-budget uniform: SGLang's own pool)")
    return replace(config, kv_head_budget="uniform"), (
        f"sgl-kvc: --kv-head-budget uniform (auto): {why} rules the unit pool out, so KVzip keeps "
        "the same tokens in every head")

