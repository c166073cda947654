"""Make a host-device sync visible on a machine whose only device is the CPU.

On CUDA, an operation whose result the host must read (`.item()`, `int(t)`, `bool(t)`,
`.tolist()`) or whose output shape depends on the data (`nonzero`, boolean-mask indexing,
`unique`, `repeat_interleave` without `output_size`) makes the host wait until the GPU has run
everything queued before it. Inside a decode forward that costs every layer the GPU's whole
queue; none of it is visible on a CPU, where there is no queue.

Two ways to see them here:

* `SyncGuard`: raises `HostSync` on any such operation on a device tensor (one not on the CPU).
  The tests run a decode step with its device data on `meta` (no data: every read of it fails
  anyway) and its host-side plans on the CPU, so the guard names what the GPU would wait for.
* `SyncCounter`: counts such operations on any tensor, CPU included, for code that must run
  on real data (a compression pass); a test then bounds the count.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Operations that always make the host read device data (or size an output from it).
_ALWAYS = {
    aten._local_scalar_dense.default: "a read to the host (.item(), int(t), bool(t), float(t))",
    aten.nonzero.default: "nonzero (a data-dependent shape)",
    aten.masked_select.default: "masked_select (a data-dependent shape)",
    aten._unique2.default: "unique (a data-dependent shape)",
    aten._unique.default: "unique (a data-dependent shape)",
    aten.unique_dim.default: "unique (a data-dependent shape)",
    aten.unique_consecutive.default: "unique_consecutive (a data-dependent shape)",
    aten.equal.default: "torch.equal (a bool read to the host)",
    aten.is_nonzero.default: "a bool read to the host",
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_METHODS = {torch.Tensor.tolist: "tolist() (a read to the host)"}


class HostSync(RuntimeError):
    """An operation that makes the host wait for the device ran where none may."""


def _tensors(values: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(values)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why `func(*args, **kwargs)` (an ATen operation) would make the host wait, or None."""
    if func in _ALWAYS:
        return _ALWAYS[func]
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(t is not None and t.dtype == torch.bool for t in indices):
            return f"{func} with a boolean mask (a data-dependent shape)"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size (a data-dependent shape)"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "_Modes") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self.owner.found(reason, _tensors((args, kwargs)))
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: "_Modes") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METHODS:
            self.owner.found(_METHODS[func], _tensors((args, kwargs)))
        return func(*args, **kwargs)


class _Modes:
    def __enter__(self) -> "_Modes":
        self._function, self._dispatch = _Function(self), _Dispatch(self)
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)

    def found(self, reason: str, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError


class SyncGuard(_Modes):
    """Raises `HostSync` on a sync-making operation on a tensor not on the CPU."""

    def found(self, reason: str, tensors: list[torch.Tensor]) -> None:
        if any(t.device.type != "cpu" for t in tensors):
            raise HostSync(reason)


class SyncCounter(_Modes):
    """Counts sync-making operations on any tensor (`reasons`, one entry each)."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def found(self, reason: str, tensors: list[torch.Tensor]) -> None:
        self.reasons.append(reason)


class LaunchCounter(TorchDispatchMode):
    """Counts the ATen operations on device tensors (not on the CPU) that would launch a kernel:
    views launch nothing. `ops`: their names in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and any(t.device.type != "cpu" for t in _tensors((args, kwargs, out))):
            self.ops.append(str(func.overloadpacket))
        return out


# Operations that allocate and launch nothing.
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default}


class KernelCounter(LaunchCounter):
    """`LaunchCounter` without the operations that only allocate (`torch.empty` and its kin):
    the kernels a GPU would run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _ALLOCATIONS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class AllocationCounter(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside it on a device (not the CPU), above
    what was held when it began: every operation's new (non-view) output counts from its
    creation until it is freed. On `meta` (no data) this measures what a GPU would allocate."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def _freed(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for t in _tensors(out):
            if t.device.type != "cpu" and t._base is None:
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, n)
        return out
