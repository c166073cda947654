"""Import-only stand-ins for `sgl_kernel` and `torchvision` on machines that lack them.

SGLang 0.5.23 imports both at module level on paths the CPU server goes through (the scheduler,
the radix cache, the torch-native attention backend), although serving a text model on CPU
never calls into them: sgl-kernel's CPU build is not on the package registry, and the
registry's torchvision is CUDA-linked and breaks the CPU torch.

`install()` appends a finder at the END of `sys.meta_path`, so it is consulted only when no
real package could be found: where the real `sgl_kernel` / `torchvision` import, they win.
A name imported from a stand-in module (`from sgl_kernel import x`) is a `StandIn` object that
is harmless to import, to pass around or to read attributes of, but raises when called, after
recording the call in the file named by `SGLKVC_STANDIN_LOG` (if set). Any other attribute
lookup on a stand-in module fails as on a module without it, so `hasattr(sgl_kernel, name)`
and `getattr(..., None)` feature probes see the feature absent. Imports are recorded in the
log too, so a test can show that the stand-ins were in use and that a full request cycle
called none of them.

Stand-ins exist for CPU serving only: on a machine with a CUDA GPU a missing `sgl_kernel` is a
missing install (its kernels are needed there), so importing it fails with the install hint.

This module is imported from a `.pth` file in every process of the environment (the server
spawns its scheduler and detokenizer as fresh interpreters): it must stay stdlib-only and cheap.
"""

from __future__ import annotations

import dis
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

STANDIN_ROOTS: tuple[str, ...] = ("sgl_kernel", "torchvision")
LOG_ENV = "SGLKVC_STANDIN_LOG"
GPU_HINT = ("sgl_kernel is not installed, and this machine has a CUDA GPU that needs its kernels: "
            "install the GPU build (`make install` on this machine, or pip install -e '.[gpu]')")


def _record(event: str, name: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{event} {name} pid={os.getpid()}\n")


class StandInCalled(RuntimeError):
    """A stand-in function was called: the real package is needed for this code path."""


class StandIn:
    """Placeholder for any object a stand-in module is asked for."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, attr: str) -> "StandIn":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._qualname}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _record("call", self._qualname)
        raise StandInCalled(
            f"{self._qualname} was called, but only an import stand-in is installed "
            f"(the real package could not be imported on this machine)."
        )

    def __repr__(self) -> str:
        return f"<stand-in {self._qualname}>"


def _importing_from(frame: types.FrameType | None) -> bool:
    """Whether `frame` is executing `from module import name`: the IMPORT_FROM instruction, or
    importlib resolving the names of a `from package import ...` (`_handle_fromlist`)."""
    if frame is None:
        return False
    if frame.f_code.co_name == "_handle_fromlist":
        return True
    for instruction in dis.get_instructions(frame.f_code):
        if instruction.offset == frame.f_lasti:
            return instruction.opname == "IMPORT_FROM"
    return False


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or not _importing_from(sys._getframe(1)):
            raise AttributeError(f"stand-in module {self.__name__!r} has no attribute {attr!r}")
        return StandIn(f"{self.__name__}.{attr}")


class _RefusingLoader(importlib.abc.Loader):
    """Fails the import with the install hint (a GPU machine without sgl_kernel)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        raise ImportError(GPU_HINT, name=spec.name)

    def exec_module(self, module: types.ModuleType) -> None:  # pragma: no cover - never reached
        raise ImportError(GPU_HINT, name=module.__name__)


def _gpu_present() -> bool:
    """Whether this process sees a CUDA GPU (asked only when a stand-in is about to be used:
    SGLang has imported torch by then)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []  # a package, so that any submodule also resolves here
        module.__version__ = "0.0.0+sgl-kvc-standin"
        module.__sgl_kvc_standin__ = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        _record("import", module.__name__)


class _StandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        root = fullname.split(".", 1)[0]
        if root not in STANDIN_ROOTS:
            return None
        if root == "sgl_kernel" and _gpu_present():
            return importlib.machinery.ModuleSpec(fullname, _RefusingLoader())
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=True)


def install() -> None:
    """Make the stand-ins importable; a no-op if already installed or disabled."""
    if os.environ.get("SGLKVC_NO_STANDINS"):
        return
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return
    sys.meta_path.append(_StandInFinder())


def is_standin(module: types.ModuleType) -> bool:
    return bool(getattr(module, "__sgl_kvc_standin__", False))


PTH_NAME = "sgl_kvc_standins.pth"
PTH_LINE = "import sgl_kvc.compat.standins as _s; _s.install()\n"


def write_pth(site_packages: str) -> str:
    """Write the `.pth` hook that installs the stand-ins in every interpreter start."""
    path = os.path.join(site_packages, PTH_NAME)
    with open(path, "w", encoding="utf-8") as f:
        f.write(PTH_LINE)
    return path


if __name__ == "__main__":
    import sysconfig

    print(write_pth(sysconfig.get_paths()["purelib"]))
