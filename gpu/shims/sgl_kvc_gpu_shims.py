"""Post-import patches that let SGLang 0.5.23 serve on CUDA without sgl-kernel (sgl-kvc GPU kit).

Loaded by `sgl_kvc_gpu_shims.pth` in every interpreter of the environment: SGLang spawns its
scheduler and detokenizer as fresh interpreters, and each must get the patches. Active by default
once installed (the kit is only installed on such machines); `SGLKVC_GPU_SHIMS=0` turns it off.

A meta-path finder wraps `exec_module` of two SGLang modules and patches them right after they
ran (P2 and P3 of the feasibility study, shared/gpu-serve/FEASIBILITY.md):
- `sglang.srt.layers.dual_gemm`: `DualGemm._select_mode` imports the CuTe-DSL dual GEMM (needs
  nvidia-cutlass-dsl, absent) whenever `is_cuda()`; it is only ever used on sm100 -> None.
- `sglang.srt.mem_cache.memory_pool`: `_set_kv_buffer_impl` looks up the module global
  `can_use_store_cache` on every KV store; True means a JIT (nvcc) build of `store_cache`, which is
  retried on every call when it fails -> False, the plain `k_cache[idx] = k` path.

Stdlib only and cheap: it runs at every interpreter start.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

ENV = "SGLKVC_GPU_SHIMS"


def _no_dual_gemm(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _no_store_cache(*args: Any, **kwargs: Any) -> bool:
    return False


def patch_dual_gemm(module: Any) -> None:
    module.DualGemm._select_mode = _no_dual_gemm


def patch_memory_pool(module: Any) -> None:
    module.can_use_store_cache = _no_store_cache


PATCHES: dict[str, Callable[[Any], None]] = {
    "sglang.srt.layers.dual_gemm": patch_dual_gemm,
    "sglang.srt.mem_cache.memory_pool": patch_memory_pool,
}


class _PatchingLoader:
    """Delegates everything to the real loader; runs the patch after `exec_module`."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader = loader
        self._patch = patch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class PostImportHook:
    """A meta-path finder that patches the modules in `patches` once each has been executed."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = dict(patches)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:  # the finders after this one find the real module
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def enabled(environ: Any = None) -> bool:
    return (os.environ if environ is None else environ).get(ENV, "1") != "0"


def install(patches: dict[str, Callable[[Any], None]] | None = None) -> PostImportHook | None:
    """Put the hook first on `sys.meta_path` (once); None when disabled by `SGLKVC_GPU_SHIMS=0`."""
    if not enabled():
        return None
    for finder in sys.meta_path:
        if isinstance(finder, PostImportHook) and patches is None:
            return finder
    hook = PostImportHook(PATCHES if patches is None else patches)
    sys.meta_path.insert(0, hook)
    return hook
