"""What the machine the launcher runs on has: CUDA and its compute capability, FlashInfer, and
native bfloat16 on a CPU. Each probe imports what it reads only when called. Callers read them
through this module (`machine.cuda_available()`), so that a test can stand a GPU in by patching
them here."""

from __future__ import annotations


def cuda_available() -> bool:
    """Whether torch sees a CUDA device."""
    import torch

    return torch.cuda.is_available()


def gpu_capability() -> tuple[int, int] | None:
    """The GPU's compute capability, or None where it cannot be read."""
    import torch

    try:
        major, minor = torch.cuda.get_device_capability()
    except (AssertionError, RuntimeError):
        return None
    return int(major), int(minor)


def flashinfer_installed() -> bool:
    """Whether FlashInfer is installed (found on the path, not imported)."""
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def native_bf16() -> bool:
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
