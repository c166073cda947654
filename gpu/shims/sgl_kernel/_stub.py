"""The machinery of the `sgl_kernel` stub: raising placeholders and a finder for any submodule.

Kept stdlib-only and free of torch: SGLang imports `sgl_kernel` at module level all over its
CUDA branches, and only the names a served request actually reaches must be real.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable

# SGLang's quantization/utils.py imports `sgl_kernel.scalar_type` in a try and falls back to a
# mock on ImportError; a stub module there would hand it placeholders instead of its mock types.
MISSING_SUBMODULES: frozenset[str] = frozenset({"scalar_type"})

HINT = ("this environment has only the sgl-kvc GPU-kit stub of sgl_kernel (no sglang-kernel "
        "wheel). Serve with SGLANG_FORCE_FUSED_OP_BACKEND=torch (gpu/env.sh) and "
        "--attention-backend triton or torch_native, or install the real sglang-kernel.")


class SglKernelStubCalled(RuntimeError):
    """A stub `sgl_kernel` function was called: this code path needs the real kernels."""


class StubObject:
    """What any `from sgl_kernel[.sub] import name` gives: harmless until called."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, attr: str) -> "StubObject":
        if attr.startswith("__"):  # keep copy/pickle/inspect probes from seeing a protocol
            raise AttributeError(attr)
        return StubObject(f"{self._qualname}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise SglKernelStubCalled(f"{self._qualname} was called, but {HINT}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stub {self._qualname}>"


# Submodules that exist as files: `from sgl_kernel import utils` must give the module, and
# importlib asks the package's `__getattr__` before it imports a submodule named in a fromlist.
FILE_SUBMODULES: frozenset[str] = frozenset({"utils", "kvcacheio", "quantization"})


def module_getattr(module_name: str) -> Callable[[str], Any]:
    """A module-level `__getattr__` (PEP 562) that hands out stubs for any public name."""

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        if module_name == "sgl_kernel" and attr in FILE_SUBMODULES:
            return importlib.import_module(f"sgl_kernel.{attr}")
        return StubObject(f"{module_name}.{attr}")

    return __getattr__


class _StubModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package: its own submodules resolve here too
        module.__getattr__ = module_getattr(spec.name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _SubmoduleFinder(importlib.abc.MetaPathFinder):
    """Serves `sgl_kernel.<anything>` that has no file of its own. First on `sys.meta_path`:
    a finder further down could claim these names before it, e.g. sgl_kvc's CPU stand-ins,
    which `sgl_kvc.launch` installs and which refuse `sgl_kernel` on a GPU machine."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if not fullname.startswith("sgl_kernel."):
            return None
        parts = fullname.split(".")
        if parts[1] in MISSING_SUBMODULES:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (left out of the sgl-kvc GPU-kit stub on purpose)",
                name=fullname)
        if len(parts) == 2 and parts[1] in FILE_SUBMODULES:
            return None  # the package's own file, found by the path finder
        return importlib.machinery.ModuleSpec(fullname, _StubModuleLoader(), is_package=True)


def install_submodule_finder() -> None:
    if not any(isinstance(f, _SubmoduleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleFinder())
