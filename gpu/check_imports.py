"""Import check of an environment the GPU kit was installed into (run by install.sh and by
`make gpu-kit-check`, with gpu/env.sh's variables set).

    python gpu/check_imports.py                  # as the machine is
    python gpu/check_imports.py --simulate-cuda  # a CPU machine posing as an H100 (sm90)

`--simulate-cuda` makes torch report CUDA before anything imports SGLang, so SGLang's
`if _is_cuda:` module-level imports (sgl_kernel submodules and the like) run against the stub;
nothing is instantiated, so no CUDA call is ever made. Either way it checks that `sgl_kernel` is
the kit's stub and that the post-import patches of `sgl_kvc_gpu_shims` were applied.
Prints every failure with its traceback; exit status 1 if any.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from typing import Callable

# sgl_kvc.launch first, as `python -m sgl_kvc.launch` does: it installs sgl_kvc's import
# stand-ins (torchvision where the real one is missing, as in the CPU check venv).
MODULES: tuple[str, ...] = (
    "sgl_kvc.launch",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.torch_native_backend",
    "sgl_kvc.adapter",  # what the plugin installs into the scheduler process
    # --kv-decode-graphs on: its hooks, and the Triton kernel a captured decode step runs
    "sgl_kvc.adapter.decode_graphs", "sgl_kvc.kernels.triton_row_decode",
)
CUDA_MODULES: tuple[str, ...] = (
    "sglang.srt.models.llama", "sglang.srt.layers.dual_gemm",
    # what capturing decode CUDA graphs imports (`DecodeCudaGraphRunner._forks_draft_metadata_prep`)
    "sglang.srt.layers.attention.deepseek_v4_backend",
)


def simulate_cuda() -> None:
    """torch as on the target H100, for import-time branches only (no kernel can run)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100"
    torch.version.cuda = "13.0"


def check_stub() -> None:
    import sgl_kernel
    from sgl_kernel.flash_attn import flash_attn_varlen_func  # noqa: F401 - no file: the finder's
    from sgl_kernel.utils import is_arch_support_pdl

    assert getattr(sgl_kernel, "__sgl_kvc_gpu_stub__", False), f"not the kit's stub: {sgl_kernel}"
    assert is_arch_support_pdl() is False


def check_patches() -> None:
    from sglang.srt.layers.dual_gemm import DualGemm
    from sglang.srt.mem_cache import memory_pool

    assert DualGemm._select_mode(None, None, 4096) is None, "DualGemm._select_mode not patched"
    assert memory_pool.can_use_store_cache(256, 256) is False, "can_use_store_cache not patched"


def check_model_registry() -> None:
    """Every model file the slim wheel kept imports (SGLang's registry would only log a failure
    and go on without that model), and the architectures the kit serves are there."""
    from sglang.srt.models.registry import import_model_classes

    archs = import_model_classes.__wrapped__("sglang.srt.models", strict=True)
    missing = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} - set(archs)
    assert not missing, f"architectures missing from the registry: {sorted(missing)}"


def check_sees_cuda() -> None:
    from sglang.srt.utils import is_cuda

    assert is_cuda(), "sglang.srt.utils.is_cuda() is False: the simulation came too late"


def run(label: str, step: Callable[[], object]) -> bool:
    start = time.perf_counter()
    try:
        step()
    except BaseException:  # noqa: BLE001 - SystemExit from an import is a failure too
        print(f"FAIL {label} ({time.perf_counter() - start:.1f} s)", flush=True)
        traceback.print_exc()
        return False
    print(f"ok   {label} ({time.perf_counter() - start:.1f} s)", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--simulate-cuda", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.simulate_cuda:
        simulate_cuda()
    modules = MODULES + (CUDA_MODULES if args.simulate_cuda else ())
    results = [run(f"import {m}", lambda m=m: importlib.import_module(m)) for m in modules]
    results.append(run("sgl_kernel is the kit's stub", check_stub))
    results.append(run("shim patches applied", check_patches))
    results.append(run("model registry (strict)", check_model_registry))
    stubs = sorted(m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel."))
    print(f"sgl_kernel stub modules imported: {', '.join(stubs)}", flush=True)
    if args.simulate_cuda:
        results.append(run("SGLang took its CUDA branches", check_sees_cuda))
    failed = results.count(False)
    mode = "simulated CUDA (sm90)" if args.simulate_cuda else "as is"
    print(f"import check ({mode}): {len(results) - failed} passed, {failed} failed "
          f"in {time.perf_counter() - start:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
