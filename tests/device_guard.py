"""Make a device mix visible on a machine whose only device is the CPU.

On a CPU machine every tensor is on the CPU, so library code that builds a tensor without naming
its device (`torch.arange(n)` next to data on CUDA) passes every test and raises on the first
GPU. `DeviceGuard` is a `TorchFunctionMode` that, while a test runs:

* sends every tensor that sgl-kvc's own code (`sgl_kvc/`, `kernels/`) creates without a device
  to the `meta` device, where it has no data: the code under test keeps its data on the CPU,
  so such a tensor meets CPU tensors and fails there, or fails when it is read;
* refuses any torch call whose tensor operands sit on different devices (0-dim CPU tensors
  excepted, as torch itself allows them as scalars), wherever it is called from.

Code that builds a host-side tensor on purpose says `device="cpu"`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import sgl_kvc
import sgl_kvc.kernels

# The functions that make a tensor on the default device when given none (torch's own list, the
# one `torch.set_default_device` redirects).
try:
    from torch.utils._device import _device_constructors

    CONSTRUCTORS = frozenset(_device_constructors())
except ImportError:  # pragma: no cover - older torch
    CONSTRUCTORS = frozenset({
        torch.arange, torch.empty, torch.empty_strided, torch.eye, torch.full, torch.linspace,
        torch.logspace, torch.ones, torch.rand, torch.randint, torch.randn, torch.randperm,
        torch.range, torch.scalar_tensor, torch.tensor, torch.zeros, torch.as_tensor,
    })

LIBRARY_ROOTS: tuple[str, ...] = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sgl_kvc, sgl_kvc.kernels)
)


class DeviceMix(RuntimeError):
    """A torch call mixed devices, or read a tensor sgl-kvc made without naming its device."""


def _devices(values: Any) -> set[torch.device]:
    leaves, _ = tree_flatten(values)
    return {
        t.device for t in leaves
        if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")
    }


class DeviceGuard(TorchFunctionMode):
    def __init__(self, roots: tuple[str, ...] = LIBRARY_ROOTS) -> None:
        super().__init__()
        self.roots = roots

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        caller = sys._getframe(1)
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        if func in CONSTRUCTORS and kwargs.get("device") is None and caller.f_code.co_filename.startswith(self.roots):
            kwargs["device"] = "meta"  # no device named: it must not meet the CPU data below
        devices = _devices((args, kwargs))
        if len(devices) > 1:
            name = getattr(func, "__name__", str(func))
            raise DeviceMix(f"{name} at {where} mixes devices {sorted(str(d) for d in devices)}; "
                            "a tensor was made without the device of the data it works on")
        try:
            return func(*args, **kwargs)
        except NotImplementedError as e:
            if "meta" in str(e):
                raise DeviceMix(f"{where} reads a tensor made without naming its device ({e})") from e
            raise
