"""Set-ups sgl-kvc cannot serve correctly, refused in one line (`unsupported`, from the SGLang
flags as SGLang reads them; `gpu_unsupported`, from the GPU's compute capability), and those it
serves but warns about once at start-up (`torch_native_on_gpu`, `allocation_warning`). What only
the model and backends SGLang built show is refused in the scheduler process
(`adapter/safety/refusals.py`)."""

from __future__ import annotations

from sgl_kvc.config import KvcConfig
from sgl_kvc.launcher.flags import sglang_flags
from sgl_kvc.request_settings import RequestCompression, allocation_warning as request_allocation_warning

# The attention backends that read sgl-kvc's own pools (FP8, and the unit pool of variable budgets).
KVC_POOL_BACKENDS: tuple[str, ...] = ("torch_native", "triton")


def allocation_warning(config: KvcConfig) -> str | None:
    """A server whose own prompt policy is KVzip with uniform head budgets: served, but KVzip's
    scores are for one sort over every head (`request_settings.allocation_warning`, which every such
    request's response carries too)."""
    warning = request_allocation_warning(RequestCompression(), config)
    return None if warning is None else f"sgl-kvc: {warning}"


def torch_native_on_gpu(config: KvcConfig, argv: list[str]) -> str | None:
    """The warning the launcher logs where a GPU serves FP8 KV storage or variable / layer budgets
    on the torch_native backend the user asked for: its prefill runs SGLang's SDPA loop one request
    at a time (the Triton backend, the default there, reads those pools too). None otherwise."""
    what = " and ".join(
        ([f"--kv-cache-dtype {config.fp8_kv}"] if config.fp8_kv else [])
        + ([f"--kv-head-budget {config.kv_head_budget}"] if config.variable_budget else [])
    )
    if not what or sglang_flags(argv).get("--attention-backend") != "torch_native":
        return None
    return (f"sgl-kvc: {what} on --attention-backend torch_native: its prefill runs one request at a "
            "time (the default on a GPU, triton, reads sgl-kvc's pools too)")


def unsupported(config: KvcConfig, argv: list[str], default_backend: str = "torch_native") -> str | None:
    """Why SGLang flags `argv` (as SGLang reads them, `sglang_flags`) cannot run with `config`, in
    one line; None if they can. `default_backend`: the attention backend the launcher gives a
    server without the flag."""
    from sgl_kvc.adapter.attention import WRAPPED_BACKENDS

    flags = sglang_flags(argv)
    needs_kvc_layout = config.compressing or config.fp8_kv is not None
    page_size = flags.get("--page-size")
    if needs_kvc_layout and page_size not in (None, 1):
        what = f"--policy {config.policy}" if config.compressing else f"--kv-cache-dtype {config.fp8_kv}"
        return (f"{what} needs --page-size 1 (compaction rewrites single-token slots); "
                f"got --page-size {page_size}")
    disaggregation = flags.get("--disaggregation-mode")
    if config.fp8_kv and not config.compressing and disaggregation not in (None, "null"):
        return (f"--kv-cache-dtype {config.fp8_kv} does not support --disaggregation-mode "
                f"{disaggregation}: SGLang's KV transfer moves the pool's buffers, not sgl-kvc's "
                "FP8 pool's codes and scales")
    if not config.compressing:
        return None
    for flag in ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"):
        value = flags.get(flag)
        if value is not None and value not in WRAPPED_BACKENDS:
            return (f"--policy {config.policy} observes attention through the "
                    f"{' or '.join(WRAPPED_BACKENDS)} backend; {flag} {value} is not supported "
                    "with a compressing policy (use --policy none with it)")
    main = flags.get("--attention-backend") or default_backend
    split = {flag: flags.get(flag) or main for flag in ("--prefill-attention-backend", "--decode-attention-backend")}
    if len(set(split.values())) > 1:
        return (f"--policy {config.policy} needs one attention backend for prefill and decode (sgl-kvc "
                "observes both through it); got " + ", ".join(f"{f} {v}" for f, v in split.items()))
    for flag in ("--attention-backend", "--decode-attention-backend"):
        value = flags.get(flag)
        if config.variable_budget and value not in (None, *KVC_POOL_BACKENDS):
            return (f"--kv-head-budget {config.kv_head_budget} needs the {' or '.join(KVC_POOL_BACKENDS)} "
                    f"attention backend (sgl-kvc's kernel reads the per-head tables); got {flag} {value}")
    if flags.get("--speculative-algorithm") not in (None, "None", "none"):
        return (f"--policy {config.policy} does not support speculative decoding "
                "(--speculative-algorithm): draft batches would see physical positions")
    if flags.get("--enable-mixed-chunk"):
        return (f"--policy {config.policy} does not support --enable-mixed-chunk: mixed "
                "prefill+decode batches would give compacted requests physical positions")
    pp = flags.get("--pp-size")
    if pp != 1:
        return (f"--policy {config.policy} does not support --pp-size {pp}: each pipeline stage holds "
                "other layers, and sgl-kvc's ranks agree on compactions and failures within the "
                "tensor-parallel group only (use --tp-size or --dp-size)")
    dtype = flags.get("--kv-cache-dtype")
    if dtype in _BLOCK_SCALED_KV:
        return f"--policy {config.policy} does not support --kv-cache-dtype {dtype}: {_BLOCK_SCALED_KV[dtype]}"
    tp = flags.get("--tp-size")
    if config.variable_budget and tp != 1:
        return (f"--kv-head-budget {config.kv_head_budget} does not support --tp-size {tp}: staged "
                "passes are priced from each rank's own tables, so ranks could finish a pass in "
                "different steps (use --kv-head-budget uniform with tensor parallelism)")
    for flag, why in _COMPRESSION_BREAKERS.items():
        value = flags.get(flag)
        if flags.sets(flag) and str(value) not in _OFF_VALUES.get(flag, ("False",)):
            shown = flag if value is True else f"{flag} {value}"
            return f"--policy {config.policy} does not support {shown}: {why}"
    return None


# SGLang features a compressing server refuses: each assumes what compaction changes.
_COMPRESSION_BREAKERS: dict[str, str] = {
    "--enable-dp-attention": "attention data-parallel ranks share one scheduler's decisions, which "
    "the per-rank score reducer and the radix rule do not cover",
    "--attn-dp-size": "attention data-parallel ranks share one scheduler's decisions, which the "
    "per-rank score reducer and the radix rule do not cover",
    "--disaggregation-mode": "prefill/decode disaggregation transfers KV rows between servers, and "
    "a compacted row is not the prompt's KV",
    "--enable-lmcache": "LMCache stores and restores KV by prompt tokens; compacted KV is not theirs",
    "--enable-flexkv": "FlexKV stores and restores KV by prompt tokens; compacted KV is not theirs",
    "--enable-hierarchical-cache": "the hierarchical cache offloads and reloads rows by prompt "
    "tokens; compacted KV is not theirs",  # (also spelled --enable-hicache)
    "--enable-pdmux": "prefill/decode multiplexing splits batches in ways compaction does not see",
}
# SGLang's block-scaled KV dtypes: compaction moves entries with the pool's K and V buffers.
_BLOCK_SCALED_KV: dict[str, str] = {
    "nvfp4": "SGLang's FP4 pool hands out a dequantized copy of its buffers, so entries moved into "
    "it would be lost (use fp8_e4m3 / fp8_e5m2, sgl-kvc's FP8 pool)",
    "fp4_mx_block16": "SGLang's FP4 pool hands out a dequantized copy of its buffers, so entries moved "
    "into it would be lost (use fp8_e4m3 / fp8_e5m2, sgl-kvc's FP8 pool)",
    "mxfp8": "SGLang's MXFP8 pool keeps block scales beside its buffers, which a compaction would not "
    "move with the entries (use fp8_e4m3 / fp8_e5m2, sgl-kvc's FP8 pool)",
}
# Flags with a value, and the values that leave the feature off (a switch: False).
_OFF_VALUES: dict[str, tuple[str, ...]] = {
    "--attn-dp-size": ("1",),
    "--disaggregation-mode": ("null",),
}


def gpu_unsupported(config: KvcConfig, capability: tuple[int, int]) -> str | None:
    """Why this CUDA GPU (compute capability) cannot serve `config`, in one line; None if it can.
    Variable budgets decode through sgl-kvc's Triton kernel (`kernels/triton_per_head.py`),
    which needs bfloat16 (sm80+) and, reading FP8 codes, the FP8 conversions of sm89+."""
    if not config.variable_budget:
        return None
    need = (8, 9) if config.fp8_kv else (8, 0)
    if tuple(capability) < need:
        what = f"--kv-head-budget {config.kv_head_budget}" + (f" with --kv-cache-dtype {config.fp8_kv}" if config.fp8_kv else "")
        return (f"{what} needs a GPU of compute capability {need[0]}.{need[1]} or newer for sgl-kvc's "
                f"Triton decode kernel; this one is {capability[0]}.{capability[1]}")
    return None

