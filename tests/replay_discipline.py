"""Run a decode step the way a CUDA graph replays it, on a machine whose only device is the CPU.

A CUDA graph holds the kernels one run of a step launched, with the addresses they read and wrote,
and replays exactly those: no Python runs again, so a decision the code made from the batch's
contents (which requests, how wide, which branch) is the first step's forever, a buffer allocated
anew is not the one the graph writes, and a value read back to the host is the first step's value.
None of it shows on a CPU, where nothing is captured.

`ReplayCheck` makes it show. The first step is recorded (every ATen operation, its arguments, and
for every tensor it reads either the operation of this step that made it or the buffer it lives
in); each later step is then run twice from the same state: eagerly, as the code runs it (its
operations recorded again), and by replaying the first step's operations on the same buffers (no
Python of the step runs, only the recorded operations, as a graph replays them). A step passes
when

* its operations, their shapes, strides, dtypes and scalar arguments, and the storages of the
  buffers they touch are the first step's (`Violation.kind` "operations");
* no operation reads a value back to the host: `item`, `tolist`, `nonzero`, a bool of a tensor,
  a data-dependent shape ("host read");
* a tensor made from host values (`torch.tensor(list)`) holds the first step's values, which is
  what a graph replays ("host values");
* every buffer the replay wrote holds, byte for byte, what the eager run wrote ("replay").

What a step reads that the code prepares between steps (the batch's rows and lengths, a row's
tables after a compaction) must be written into buffers by `prepare`, outside the step, as
SGLang's graph runner copies a batch into its static inputs before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from sync_guard import sync_reason

aten = torch.ops.aten
_LIFT = {aten.lift_fresh.default, aten.lift_fresh_copy.default}


@dataclass(frozen=True)
class Violation:
    step: int
    kind: str  # "operations", "host read", "host values", "replay"
    detail: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.kind}: {self.detail}"


@dataclass
class _Tmp:
    """An operation's output of this step: output `j` of operation `k`."""

    k: int
    j: int


@dataclass
class _Alias:
    """A tensor made outside the dispatcher (`as_subclass`, a subclass's own wrapping) over the
    storage of output `j` of operation `k`, with its own view of it."""

    k: int
    j: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Op:
    func: Any
    spec: Any  # the pytree spec of (args, kwargs)
    leaves: list[Any]  # the leaves, tensors replaced by `_Tmp` or kept (a buffer's tensor)


@dataclass
class _Recording:
    ops: list[_Op] = field(default_factory=list)
    signature: list[tuple] = field(default_factory=list)
    host_reads: list[str] = field(default_factory=list)
    written: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # buffers written, by address
    keep: list[Any] = field(default_factory=list)  # every tensor seen: ids stay unique while recording


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Record(TorchDispatchMode):
    def __init__(self, rec: _Recording) -> None:
        super().__init__()
        self.rec = rec
        self.made: dict[int, _Tmp] = {}  # id of a tensor this step made -> where
        self.storages: dict[int, _Tmp] = {}  # address of a storage this step made -> where

    def _leaf(self, x: Any) -> tuple[Any, Any]:
        """(the leaf as the replay holds it, its part of the signature)."""
        if not isinstance(x, torch.Tensor):
            return x, ("value", repr(x))
        self.rec.keep.append(x)
        where = (tuple(x.shape), tuple(x.stride()), str(x.dtype))
        tmp = self.made.get(id(x))
        if tmp is not None:
            return tmp, ("tmp", tmp.k, tmp.j, *where)
        owner = self.storages.get(_storage_key(x))
        if owner is not None:
            alias = _Alias(owner.k, owner.j, tuple(x.shape), tuple(x.stride()), x.storage_offset())
            return alias, ("alias", owner.k, owner.j, x.storage_offset(), *where)
        return x, ("buffer", _storage_key(x), x.storage_offset(), *where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self.rec.host_reads.append(f"{func}: {reason}")
        leaves, spec = tree_flatten((args, kwargs))
        held, sig = zip(*(self._leaf(x) for x in leaves)) if leaves else ((), ())
        if func in _LIFT:  # a tensor made from host values: a graph holds these values
            t = args[0]
            sig = (("host values", str(t.dtype), tuple(t.shape), tuple(t.flatten().tolist())),)
        for i, schema_arg in enumerate(func._schema.arguments):
            if schema_arg.alias_info is not None and schema_arg.alias_info.is_write:
                target = args[i] if i < len(args) else kwargs.get(schema_arg.name)
                if isinstance(target, torch.Tensor) and id(target) not in self.made:
                    self.rec.written[_storage_key(target)] = target.untyped_storage()
        k = len(self.rec.ops)
        self.rec.ops.append(_Op(func, spec, list(held)))
        self.rec.signature.append((str(func), tuple(sig)))
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        for j, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and id(t) not in self.made and not _is_input(t, leaves):
                self.made[id(t)] = _Tmp(k, j)
                self.storages.setdefault(_storage_key(t), _Tmp(k, j))
                self.rec.keep.append(t)
        return out


def _is_input(t: torch.Tensor, leaves: list[Any]) -> bool:
    """Whether `t` is one of the operation's own arguments (an in-place operation returns it)."""
    return any(t is x for x in leaves)


class _HostReads(TorchFunctionMode):
    """`tolist()` never reaches the dispatcher."""

    def __init__(self, rec: _Recording) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.rec.host_reads.append("tolist() (a read to the host)")
        return func(*args, **(kwargs or {}))


def _record(forward: Callable[[], None]) -> _Recording:
    rec = _Recording()
    with _HostReads(rec), _Record(rec):
        forward()
    return rec


def _replay(rec: _Recording) -> None:
    """The recorded operations again, on the same buffers, with no Python of the step."""
    outputs: list[list[Any]] = []
    for op in rec.ops:
        leaves = [_held(x, outputs) for x in op.leaves]
        args, kwargs = tree_unflatten(leaves, op.spec)
        out = op.func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        outputs.append(outs)


def _held(x: Any, outputs: list[list[Any]]) -> Any:
    if isinstance(x, _Tmp):
        return outputs[x.k][x.j]
    if isinstance(x, _Alias):
        return outputs[x.k][x.j].as_strided(x.size, x.stride, x.offset)
    return x


def _snapshot(storages: dict[int, torch.UntypedStorage]) -> dict[int, torch.UntypedStorage]:
    return {key: s.clone() for key, s in storages.items()}


def _restore(storages: dict[int, torch.UntypedStorage], saved: dict[int, torch.UntypedStorage]) -> None:
    for key, s in storages.items():
        s.copy_(saved[key])


def _bytes(s: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)


def _first_difference(a: list[tuple], b: list[tuple]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"operation {i}: {x[0]} {_short(x[1])} became {y[0]} {_short(y[1])}"
    return f"{len(a)} operations became {len(b)}"


def _short(sig: tuple) -> str:
    text = repr(sig)
    return text if len(text) < 240 else text[:240] + "..."


class ReplayCheck:
    """Steps of `forward` under the replay discipline (module doc). `prepare(step)` writes a step's
    inputs into the buffers `forward` reads (it runs outside the step, unrecorded); `forward()`
    runs one step. `run(steps)` returns every violation found."""

    def __init__(self, prepare: Callable[[int], None], forward: Callable[[], None]) -> None:
        self.prepare, self.forward = prepare, forward

    def run(self, steps: int) -> list[Violation]:
        found: list[Violation] = []
        self.prepare(0)
        captured = _record(self.forward)
        found += [Violation(0, "host read", r) for r in captured.host_reads]
        for step in range(1, steps):
            self.prepare(step)
            buffers = dict(captured.written)
            saved = _snapshot(buffers)
            eager = _record(self.forward)
            found += [Violation(step, "host read", r) for r in eager.host_reads]
            if eager.signature != captured.signature:
                kind = "host values" if _values_differ(captured.signature, eager.signature) else "operations"
                found.append(Violation(step, kind, _first_difference(captured.signature, eager.signature)))
            new = set(eager.written) - set(buffers)
            if new:
                found.append(Violation(step, "operations", f"{len(new)} buffers written that the first step did not"))
            wanted = {key: _bytes(s).clone() for key, s in buffers.items()}
            _restore(buffers, saved)
            _replay(captured)
            for key, s in buffers.items():
                if not torch.equal(_bytes(s), wanted[key]):
                    found.append(Violation(step, "replay", f"a buffer of {s.nbytes()} bytes differs from the eager step's"))
        return found


def _values_differ(a: list[tuple], b: list[tuple]) -> bool:
    """Whether the first difference of two signatures is in a tensor made from host values."""
    for x, y in zip(a, b):
        if x != y:
            return any(part and part[0] == "host values" for part in (*x[1], *y[1]) if isinstance(part, tuple))
    return False

