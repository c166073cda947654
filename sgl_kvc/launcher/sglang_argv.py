"""SGLang's argument list for this machine: the user's flags plus the per-device defaults they
did not override (CPU: torch-native attention and sampling, no grammar backend, a modest
`--max-total-tokens`; CUDA: FlashInfer, or SGLang's Triton backend where FlashInfer is missing
or the KV pool is sgl-kvc's own), the default model (SmolLM2, or the `demo` alias's random
model) and the model dtype on a CPU without native bfloat16."""

from __future__ import annotations

import logging
from pathlib import Path

from sgl_kvc.launcher.flags import sglang_flags

# The launcher's one logger, under the name it has always logged as (`python -m sgl_kvc.launch`).
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
