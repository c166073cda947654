"""`python -m sgl_kvc.launch`: SGLang's server launcher with the sgl-kvc plugin loaded.

Every SGLang server flag works and means what it means in SGLang; the flags of `KvcConfig`
are added. Per device defaults are filled in only where the user did not give the flag:
on CPU the torch-native attention and sampling backends, no grammar backend and a modest
`--max-total-tokens`; on CUDA FlashInfer, or SGLang's Triton backend where FlashInfer is not
installed or the KV pool is sgl-kvc's own (FP8, variable budgets). Without `--model-path` the built-in real model,
SmolLM2-135M-Instruct, is served (converted from its packaged GGUF file on first use);
`--model-path demo` serves the tiny random-weight model the fast tests use. Set-ups sgl-kvc
cannot serve correctly are refused with one line (`unsupported`).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from sgl_kvc.compat import standins

standins.install()  # before anything imports SGLang (also re-run in spawned children)

from sgl_kvc.config import HEAD_BUDGET_AUTO, KERNEL_DECODE_ATTENTION, KvcConfig  # noqa: E402
from sgl_kvc.request_settings import RequestCompression, allocation_warning as request_allocation_warning  # noqa: E402

logger = logging.getLogger("sgl_kvc.launch")

# A value of None is a switch (store_true flag).
CPU_DEFAULTS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--grammar-backend": "none",
    "--max-total-tokens": "16384",
    # An idle scheduler otherwise keeps polling, a share of a small CPU machine (docs/architecture.md,
    # "How it plugs into SGLang").
    "--sleep-on-idle": None,
}
GPU_DEFAULTS: dict[str, str | None] = {"--attention-backend": "flashinfer"}
# The CUDA backend where FlashInfer is not installed (SGLang's own fallback on AMD GPUs; the offline
# GPU kit, gpu/README.md) and for sgl-kvc's pools: SGLang's Triton kernels, with sgl-kvc's Triton
# decode kernel over the FP8 and unit pools (adapter/attention.py, `TritonKernelMixin`).
GPU_TRITON_BACKEND = "triton"
# Where `sgl_kernel` is the offline GPU kit's import-only stub (gpu/README.md): SGLang's breakable
# prefill CUDA graphs call `sgl_kernel.weak_ref_tensor`, which only the real sglang-kernel has.
GPU_KIT_DEFAULTS: dict[str, str | None] = {"--disable-prefill-cuda-graph": None}
# The model dtype on a CPU without native bfloat16 (no AVX512-BF16 or AMX), where a bfloat16 or
# float16 model's matrix products are emulated: float32 serves many users and pre-fills faster
# there, one user alone decodes slower (batch-1 decode reads the weights, twice the bytes), and
# a server exists for many requests; the numbers are in docs/benchmarks.md, "CPU dtype".
# `--dtype` overrides it.
EMULATED_BF16_DTYPE = "float32"
# `--model-path demo`: the tiny random-weight Llama (fast tests; its answers are noise).
DEMO_ALIAS = "demo"


def has_flag(argv: list[str], flag: str) -> bool:
    """Whether `argv` sets `flag`, as `--flag`, `--flag VALUE` or `--flag=VALUE` (literally: the
    launcher's own argument lists; the user's SGLang flags are read by `sglang_flags`)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


@dataclass(frozen=True)
class SGLangFlags:
    """The user's SGLang flags as SGLang's own parser reads them (`prepare_server_args`, before
    `ServerArgs` fills in what it derives): any spelling SGLang accepts (an alias, an abbreviation
    such as `--tp 2`, `--flag=VALUE`) and a `--config` YAML file's values, the command line over
    the file. Every decision the launcher takes from SGLang's flags reads them here, so that what
    it refuses or chooses is what SGLang will serve."""

    values: argparse.Namespace  # every flag's value (SGLang's parser default where not given)
    given: frozenset[str]  # the destinations set on the command line or in the --config file
    dests: dict[str, str]  # option string -> destination

    def get(self, flag: str) -> Any:
        """The value of `flag` (any of its option strings: `--tp-size`, `--tensor-parallel-size`)."""
        return getattr(self.values, self.dests[flag])

    def sets(self, flag: str) -> bool:
        """Whether the user gave `flag` (any spelling, on the command line or in its file)."""
        return self.dests[flag] in self.given


def sglang_flags(argv: Sequence[str]) -> SGLangFlags:
    """`SGLangFlags` of the SGLang flags `argv` (parsed once per argument list); a flag SGLang's
    parser refuses, or a bad `--config` file, is a usage error here, in one line."""
    return _parse_sglang_flags(tuple(argv))


@functools.lru_cache(maxsize=64)
def _parse_sglang_flags(argv: tuple[str, ...]) -> SGLangFlags:
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    # SGLang's own parser, as `prepare_server_args` builds it; no flag required (the launcher gives
    # the default model itself, `build_sglang_argv`), and no usage dump before a one-line error.
    parser = argparse.ArgumentParser(prog="python -m sgl_kvc.launch", usage=argparse.SUPPRESS, add_help=False)
    ServerArgs.add_cli_args(parser)
    actions = [a for a in parser._actions if a.option_strings]  # argparse lists them nowhere public
    for action in actions:
        action.required = False
    args = list(argv)
    if "--config" in args:
        try:
            args = ConfigArgumentMerger(parser).merge_config_with_args(args)
        except (OSError, ValueError) as e:
            parser.error(f"--config: {e}")
    values = parser.parse_args(args)
    for action in actions:  # parsed again without defaults: what is left was given
        action.default = argparse.SUPPRESS
    given = frozenset(vars(parser.parse_args(args)))
    return SGLangFlags(values, given, {o: a.dest for a in actions for o in a.option_strings})


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _gpu_capability() -> tuple[int, int] | None:
    """The GPU's compute capability, or None where it cannot be read."""
    import torch

    try:
        major, minor = torch.cuda.get_device_capability()
    except (AssertionError, RuntimeError):
        return None
    return int(major), int(minor)


def flashinfer_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def default_attention_backend(on_gpu: bool, fp8_kv: bool = False, unit_pool: bool = False,
                              flashinfer: bool = True) -> str:
    """The attention backend a server gets without `--attention-backend`. `flashinfer`: whether
    FlashInfer is installed (on a GPU)."""
    if not on_gpu:
        return str(CPU_DEFAULTS["--attention-backend"])
    if fp8_kv or unit_pool:
        # sgl-kvc's FP8 pool stores codes and scales, and the heads of a packed request (variable
        # per-head budgets) hold different numbers of entries: FlashInfer reads neither. In the
        # Triton backend sgl-kvc's kernel runs decode and extends read the rows they need
        # dequantized; SGLang itself keeps the model's dtype (`auto`).
        return GPU_TRITON_BACKEND
    return str(GPU_DEFAULTS["--attention-backend"]) if flashinfer else GPU_TRITON_BACKEND


def build_sglang_argv(
    argv: list[str], on_gpu: bool, compressing: bool = False, fp8_kv: bool = False,
    kv_memory_gb: bool = False, unit_pool: bool = False, native_bf16: bool = True, flashinfer: bool = True,
    gpu_kit: bool = False, decode_graphs: bool = False,
) -> list[str]:
    """SGLang's argument list: the user's flags plus the defaults they did not override.
    `native_bf16`: whether this CPU multiplies bfloat16 natively (see `EMULATED_BF16_DTYPE`);
    `flashinfer`: whether FlashInfer is installed; `gpu_kit`: whether `sgl_kernel` is the GPU kit's
    stub (`GPU_KIT_DEFAULTS`); `decode_graphs`: a compressing server's decode steps replay SGLang's
    CUDA graphs (`KvcConfig.decode_graphs`)."""
    from sgl_kvc.adapter import RADIX_CACHE_BACKEND

    flags = sglang_flags(argv)
    out = list(argv)
    defaults = dict(GPU_DEFAULTS if on_gpu else CPU_DEFAULTS)
    if on_gpu and gpu_kit:
        defaults.update(GPU_KIT_DEFAULTS)
    defaults["--attention-backend"] = default_attention_backend(on_gpu, fp8_kv, unit_pool, flashinfer)
    if kv_memory_gb:
        defaults.pop("--max-total-tokens", None)  # the KV memory decides the pool's size
    if compressing and not flags.sets("--disable-overlap-schedule"):
        # Compaction rewrites request rows between steps; the overlap scheduler would prepare
        # the next step while the previous one still reads them.
        out.append("--disable-overlap-schedule")
    if compressing and on_gpu and decode_graphs and not flags.sets("--disable-cuda-graph"):
        # A decode step reads only buffers (core/graph_step.py); a prefill's observation and its
        # per-request tables run Python per request, which a prefill graph would not replay.
        logger.info("sgl-kvc: decode steps replay SGLang's CUDA graphs (--kv-decode-graphs on); "
                    "prefill CUDA graphs off")
        defaults["--disable-prefill-cuda-graph"] = None
    elif compressing and on_gpu and not flags.sets("--disable-cuda-graph"):
        # Off unless asked for (`--kv-decode-graphs on`) until a GPU run has shown them equal to
        # eager decode for every policy that captures (docs/architecture.md, "Decode CUDA graphs").
        logger.warning("sgl-kvc: decode CUDA graphs disabled (--disable-cuda-graph) for a "
                       "compressing policy (--kv-decode-graphs on replays them)")
        out.append("--disable-cuda-graph")
    if compressing and not flags.sets("--disable-radix-cache"):
        # The tree compaction's radix rule is written against (adapter/documents/radix_cache.py);
        # --policy none keeps SGLang's own choice.
        defaults["--radix-cache-backend"] = RADIX_CACHE_BACKEND
    model = flags.get("--model-path")
    if model is None:
        # The built-in default: a real pretrained model that works offline (converted on first use).
        from sgl_kvc.model import SMOLLM2_MODEL_NAME, ensure_smollm2

        defaults["--model-path"] = str(ensure_smollm2())
        defaults["--served-model-name"] = SMOLLM2_MODEL_NAME
    elif model == DEMO_ALIAS:
        from sgl_kvc.model import DEMO_MODEL_NAME, ensure_demo_model

        out = _drop_flag(_drop_flag(out, "--model-path"), "--model")
        defaults["--model-path"] = str(ensure_demo_model())
        defaults["--served-model-name"] = DEMO_MODEL_NAME
    if not on_gpu and not native_bf16 and not flags.sets("--dtype"):
        if float32_fits(defaults.get("--model-path") or model):
            defaults["--dtype"] = EMULATED_BF16_DTYPE
    if flags.sets("--disable-cuda-graph") or "--disable-cuda-graph" in out:  # both graphs off already
        defaults.pop("--disable-prefill-cuda-graph", None)
    for flag, value in defaults.items():
        # (the demo model's path is the launcher's: its alias was dropped above)
        if not flags.sets(flag) or (flag == "--model-path" and model == DEMO_ALIAS):
            out += [flag] if value is None else [flag, value]
    return out


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def float32_fits(model_path: str, available: int | None = None) -> bool:
    """Whether the model's weights in float32 take at most half of the available memory.
    Checkpoints are 16-bit, so float32 doubles them: an 8B model goes from 16 to 32 GB. A path
    whose weight files cannot be read (not a folder) counts as fitting: SGLang reports it."""
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        return True
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return 2 * size <= available // 2


def parse_args(argv: list[str]) -> tuple[KvcConfig, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_kvc.launch",
        add_help=False,
        description="SGLang's server with KV-cache compression. All SGLang flags apply.",
    )
    KvcConfig.add_cli_args(parser)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print("\nSGLang server flags (all accepted):\n")
        from sglang.srt.server_args import prepare_server_args

        prepare_server_args(["--help"])  # prints SGLang's help and exits
    ns, rest = parser.parse_known_args(argv)
    try:
        config = KvcConfig.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits
    if config.fp8_kv is None and config.kv_cache_dtype != "auto":
        # `--kv-cache-dtype` is SGLang's flag; values other than our FP8 ones are SGLang's.
        rest = [*rest, "--kv-cache-dtype", config.kv_cache_dtype]
        config = replace(config, kv_cache_dtype="auto")
    backend = sglang_flags(rest).get("--attention-backend")
    if config.fp8_kv and backend not in (None, *KVC_POOL_BACKENDS):
        parser.error(
            f"--kv-cache-dtype {config.fp8_kv} needs --attention-backend {' or '.join(KVC_POOL_BACKENDS)} "
            f"(sgl-kvc's FP8 pool stores codes and scales, which {backend} does not read)"
        )

    on_gpu = _cuda_available()
    flashinfer = flashinfer_installed() if on_gpu else True
    config, line = resolve_head_budget(config, rest, on_gpu, flashinfer, _gpu_capability() if on_gpu else None)
    if line:
        logger.warning(line)
    default = default_attention_backend(on_gpu, config.fp8_kv is not None, config.variable_budget, flashinfer)
    problem = unsupported(config, rest, default_backend=default)
    if problem:
        parser.error(problem)
    return config, rest


# The attention backends that read sgl-kvc's own pools (FP8, and the unit pool of variable budgets).
KVC_POOL_BACKENDS: tuple[str, ...] = ("torch_native", "triton")


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


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag VALUE` / `flag=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def parallel_ranks(argv: list[str]) -> int:
    """Scheduler processes (and devices) one server uses: data x tensor x pipeline parallel ranks,
    as SGLang reads its flags among the server's flags `argv` (`sglang_flags`)."""
    parser = argparse.ArgumentParser(add_help=False)
    KvcConfig.add_cli_args(parser)
    flags = sglang_flags(parser.parse_known_args(argv)[1])  # (sgl-kvc's own flags are not SGLang's)
    return int(flags.get("--dp-size")) * int(flags.get("--tp-size")) * int(flags.get("--pp-size"))


def cpu_threads_bind(ranks: int, cpus: list[int], numa_nodes: int) -> str | None:
    """A value for SGLANG_CPU_OMP_THREADS_BIND where SGLang cannot start without one: it gives
    every CPU rank one NUMA node of its own and refuses more ranks than nodes (`--dp-size 2` on
    a one-node machine). The CPUs are split into `ranks` contiguous groups (one CPU each,
    shared round-robin, where there are fewer CPUs than ranks). None where SGLang's own
    placement applies."""
    if ranks <= max(numa_nodes, 1) or not cpus:
        return None
    if len(cpus) < ranks:
        groups = [[cpus[i % len(cpus)]] for i in range(ranks)]
    else:
        size = len(cpus) // ranks
        groups = [cpus[i * size:(i + 1) * size] for i in range(ranks - 1)]
        groups.append(cpus[(ranks - 1) * size:])

    def spell(group: list[int]) -> str:
        contiguous = group == list(range(group[0], group[-1] + 1))
        if len(group) == 1:
            return str(group[0])
        return f"{group[0]}-{group[-1]}" if contiguous else ",".join(map(str, group))

    return "|".join(spell(g) for g in groups)


def _set_cpu_threads_bind(argv: list[str]) -> None:
    if os.environ.get(THREADS_BIND_ENV):
        return  # the user placed the ranks
    from sglang.srt.utils import get_cpu_ids_by_node

    ranks, cpus = parallel_ranks(argv), sorted(os.sched_getaffinity(0))
    bind = cpu_threads_bind(ranks, cpus, len(get_cpu_ids_by_node()))
    if bind is None:
        return
    os.environ[THREADS_BIND_ENV] = bind  # inherited by the scheduler processes
    # SGLang applies the bind only on CPUs with AMX; elsewhere every rank would start one
    # OpenMP thread per core and the ranks would contend for them (docs/scaling.md measures it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(cpus) // ranks)))
    logger.info("sgl-kvc: %s=%s, OMP_NUM_THREADS=%s (more CPU ranks than NUMA nodes)",
                THREADS_BIND_ENV, bind, os.environ["OMP_NUM_THREADS"])


# `SGLKVC_CPU_FORK=0`: a CPU server's scheduler and detokenizer processes are spawned, as SGLang does.
CPU_FORK_ENV = "SGLKVC_CPU_FORK"


def _os_threads() -> set[str]:
    """This process's OS threads (Linux: /proc/self/task; empty elsewhere)."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def fork_is_safe(baseline: set[str], now: set[str], python_threads: int) -> bool:
    """Whether this process may fork SGLang's workers: no Python thread but this one and no OS
    thread started since `baseline` (taken before the launcher did any work but imports). A thread
    that exists at a fork is missing in the child with whatever it held: an OpenMP pool that a
    torch operation started (converting a model) hangs the child's first parallel region."""
    return bool(baseline) and python_threads == 1 and now <= baseline


def _fork_workers_on_cpu(baseline: set[str]) -> None:
    """On a CPU, SGLang's scheduler and detokenizer are forked from this process, which has already
    imported SGLang, instead of spawned as fresh interpreters that import it again (a demo-model
    server was healthy after 12 s instead of 20, on a 2-core Xeon): after SGLang's own choice of `spawn`
    (`_set_envs_and_config`), where `fork_is_safe`. Not on a GPU (CUDA does not survive a fork)."""
    import multiprocessing
    import threading

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def after_set_envs(result, server_args, *args, **kwargs):
        if getattr(server_args, "device", None) == "cpu" and fork_is_safe(
            baseline, _os_threads(), threading.active_count()
        ):
            multiprocessing.set_start_method("fork", force=True)
            logger.info("sgl-kvc: SGLang's worker processes are forked from the launcher (%s=0: spawned)",
                        CPU_FORK_ENV)
        return result

    HookRegistry.register("sglang.srt.entrypoints.engine._set_envs_and_config", after_set_envs, HookType.AFTER)
    HookRegistry.apply_hooks()


def _native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX) and PyTorch's kernels
    may use it (`ATEN_CPU_CAPABILITY=avx2` caps them at AVX2, as on a CPU without it); True if
    unknown."""
    import torch

    try:
        if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
            return False
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: say nothing
        return True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    on_gpu = _cuda_available()
    if not on_gpu:
        # Before SGLang is first imported (`parse_args` reads its flags with its parser): its
        # device checks are cached at import.
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    config, rest = parse_args(argv)
    gpu_kit = False
    if not on_gpu:
        _set_cpu_threads_bind(rest)
    else:
        import torch

        problem = gpu_unsupported(config, torch.cuda.get_device_capability())
        try:
            import sgl_kernel  # (stand-ins never answer on a GPU machine)

            gpu_kit = bool(getattr(sgl_kernel, "__sgl_kvc_gpu_stub__", False))
        except ImportError as e:
            problem = problem or str(e)
        if problem:
            sys.exit(f"python -m sgl_kvc.launch: error: {problem}")
    if on_gpu and (warning := torch_native_on_gpu(config, rest)):
        logger.warning(warning)
    if warning := allocation_warning(config):
        logger.warning(warning)
    gpu_kit = on_gpu and gpu_kit
    native_bf16 = on_gpu or _native_bf16()
    flashinfer = not on_gpu or flashinfer_installed()
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app

    # SGLang's imports (and torch's) start idle threads of their own; what starts one after this
    # (building the default or demo model runs torch's OpenMP pool) rules a fork out (`fork_is_safe`).
    threads_before_work = _os_threads()
    sglang_argv = build_sglang_argv(
        rest, on_gpu, config.compressing, fp8_kv=config.fp8_kv is not None,
        kv_memory_gb=config.kv_cache_memory_gb is not None, unit_pool=config.variable_budget,
        native_bf16=native_bf16, flashinfer=flashinfer, gpu_kit=gpu_kit, decode_graphs=config.decode_graphs,
    )
    if config.graphs_refusal is not None:
        logger.warning("sgl-kvc: --kv-decode-graphs on: %s; decode CUDA graphs off", config.graphs_refusal)
    config.to_env()  # read by the plugin in this process and in SGLang's worker processes

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    if not on_gpu and os.environ.get(CPU_FORK_ENV, "1") != "0":
        _fork_workers_on_cpu(threads_before_work)
    from sgl_kvc.adapter import check

    problems = check(config)
    if problems:
        sys.exit("python -m sgl_kvc.launch: error: the installed SGLang is not the one sgl-kvc is "
                 "written for:\n  " + "\n  ".join(problems))
    server_args = prepare_server_args(sglang_argv)
    from sgl_kvc.server import mount

    mount(app)
    if not flashinfer and not sglang_flags(rest).sets("--attention-backend"):
        # After prepare_server_args: SGLang configures logging there.
        logger.info("sgl-kvc: FlashInfer is not installed: --attention-backend %s (SGLang's Triton kernels)",
                    server_args.attention_backend)
    if not native_bf16 and not sglang_flags(rest).sets("--dtype"):
        # After prepare_server_args: SGLang configures logging there.
        if has_flag(sglang_argv, "--dtype"):
            logger.info("sgl-kvc: --dtype %s: this CPU has no native bfloat16 (AVX512-BF16 or AMX); "
                        "--dtype bfloat16 decodes one request alone faster", EMULATED_BF16_DTYPE)
        else:
            logger.warning("sgl-kvc: this CPU has no native bfloat16 (AVX512-BF16 or AMX), but the model "
                           "in float32 would take over half of the free memory: its own dtype is kept")
    logger.info(
        "sgl-kvc: policy=%s (prompts: %s), dtype=%s, kv cache=%s, prefix cache backend=%s, "
        "attention backend=sgl_kvc(%s)",
        config.policy, config.prompt_policy_name if config.compressing else "-", server_args.dtype,
        config.fp8_kv or getattr(server_args, "kv_cache_dtype", "auto"),
        server_args.radix_cache_backend or "SGLang default",
        server_args.attention_backend,
    )
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
