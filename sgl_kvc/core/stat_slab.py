"""Attention statistics of a decode step's requests, in one tensor per step.

H2O, Batch-Max and KV-Compress keep a statistic per cached entry of every layer and KV head, to
which each decode step adds the attention its query paid (`Policy.contribution`). Kept as one
tensor per (request, layer), a step would touch B x L tensors: one view or copy each, a host cost
that grows with the batch (and a kernel per request where they are gathered). Instead a decode
step writes the statistics of ALL its requests into one *slab* [H_kv, L, total] (`StepSlab`):
request k owns the columns [start_k, start_k + n_k) of every layer, and its statistic in layer l
is the view slab[:, l, start_k : start_k + n_k] (`SlabStats`, made only when read).

A step plans its slab on the host (`plan_slab`), then copies every request's previous statistic
into it: those that were in the previous step's slab with one gather from it (a fixed number of
operations), the others (first decode step after prefill, a compaction's carried statistics, a
layer written on its own) layer by layer. Each layer's attention then adds to its own
columns in place (`add_attention`: the Triton kernel of `kernels/triton_stats.py` on CUDA, the
torch version here elsewhere), so a layer whose update does not run keeps its previous values.
What the slab costs is counted where the KV memory is sized (`adapter/memory/kv_memory.py`): the
previous and the current step's slab are alive together.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc.core.host import to_device
from sgl_kvc.core.stat_group import StatGroup

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState
    from sgl_kvc.kernels.per_head_attention import DecodeLogits
    from sgl_kvc.policies import Policy


class SlabStats(Sequence):
    """One request's statistic per layer id (`state.stats`), as its columns of a step's slab:
    layer l (>= `first`) reads slab[:, l - first, start : start + width], [H_kv, width] float32;
    layers below `first` (another pipeline stage's) read None. Writing a layer (a prefill's
    accumulation, a failure's fallback) turns it into its own list of per-layer tensors first."""

    __slots__ = ("slab", "start", "width", "first", "_own")

    def __init__(self, slab: Tensor, start: int, width: int, first: int) -> None:
        self.slab, self.start, self.width, self.first = slab, start, width, first
        self._own: list[Tensor | None] | None = None

    def __len__(self) -> int:
        return self.first + int(self.slab.shape[1])

    def __getitem__(self, layer: int) -> Tensor | None:  # type: ignore[override]
        if self._own is not None:
            return self._own[layer]
        if layer < 0:
            layer += len(self)
        if not 0 <= layer < len(self):
            raise IndexError(layer)
        if layer < self.first:
            return None
        return self.slab[:, layer - self.first, self.start : self.start + self.width]

    def __iter__(self) -> Iterator[Tensor | None]:
        return (self[layer] for layer in range(len(self)))

    def __setitem__(self, layer: int, value: Tensor | None) -> None:
        if self._own is None:
            self._own = list(self)
        self._own[layer] = value

    @property
    def in_slab(self) -> bool:
        """Whether every layer still reads the slab (none was written on its own)."""
        return self._own is None


@dataclass(frozen=True)
class StepSlab:
    """The statistics of one decode step (see the module doc): `slab` [H_kv, L, total] float32
    on the device, the requests whose statistics it holds and each one's first column."""

    slab: Tensor
    states: tuple["ReqKvState", ...]
    starts: tuple[int, ...]
    lens: tuple[int, ...]


def plan_slab(
    states: Sequence["ReqKvState"], lens: Sequence[int], first_layer: int, num_layers: int, kv_heads: int,
    device: torch.device,
) -> StepSlab:
    """A new slab for `states` (their columns in this order, `lens[k]` each: the entries they
    hold in this step), their previous statistics copied in, and their `stats` pointed at it.
    Host work per request, not per column or layer: the columns to copy are expanded on the
    device."""
    layers = num_layers - first_layer
    starts = tuple(itertools.accumulate((0,) + tuple(lens[:-1])))
    total = sum(lens)
    slab = torch.zeros(kv_heads, layers, total, dtype=torch.float32, device=device)
    by_slab: dict[int, tuple[Tensor, list[int], list[int], list[int]]] = {}  # previous slab: its runs
    own: list[Tensor] = []  # per-layer tensors of their own (or none), their runs in the flat slab
    own_dst: list[int] = []
    own_widths: list[int] = []
    for state, start, n in zip(states, starts, lens):
        old = state.stats
        if isinstance(old, SlabStats) and old.in_slab:
            w = min(old.width, n)
            if w:
                _, src, dst, widths = by_slab.setdefault(id(old.slab), (old.slab, [], [], []))
                src.append(old.start)
                dst.append(start)
                widths.append(w)
            continue
        for local in range(layers):
            layer = first_layer + local
            t = old[layer] if layer < len(old) else None
            if t is not None and (w := min(int(t.shape[1]), n)):
                own.append(t[:, :w])
                own_dst.append(local * total + start)
                own_widths.append(w)
    for base, src, dst, widths in by_slab.values():  # one gather from the previous slab
        src_cols, dst_cols = _runs(src, dst, widths, device)
        slab.index_copy_(2, dst_cols, base.index_select(2, src_cols))
    if own:  # one concatenation of the others
        _, dst_cols = _runs(own_dst, own_dst, own_widths, device)
        slab.view(kv_heads, layers * total).index_copy_(1, dst_cols, torch.cat(own, dim=1).float())
    for state, start, n in zip(states, starts, lens):
        state.stats = SlabStats(slab, start, n, first_layer)
    return StepSlab(slab=slab, states=tuple(states), starts=starts, lens=tuple(lens))


def _runs(src: list[int], dst: list[int], widths: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """The columns of runs of `widths` starting at `src` and at `dst`: expanded on the host by
    vectorized operations (no loop over columns), sent to the device in one copy."""
    total = sum(widths)
    n = torch.tensor(widths, dtype=torch.int64, device="cpu")
    owner = torch.repeat_interleave(torch.arange(len(widths), device="cpu"), n, output_size=total)
    offset = torch.arange(total, device="cpu") - (torch.cumsum(n, 0) - n)[owner]
    starts = torch.tensor([src, dst], dtype=torch.int64, device="cpu")[:, owner] + offset
    src_cols, dst_cols = to_device(starts, device).unbind(0)
    return src_cols, dst_cols


def plan_group(
    policy: "Policy", rows: Sequence[int], lse_rows: Sequence[int], starts: Sequence[int], lens: Sequence[int],
    device: torch.device,
) -> StatGroup:
    """The group's per-member tensors (see `StatGroup`), from host-side lists, in one copy."""
    m = len(lens)
    packed = to_device(torch.tensor([*rows, *lse_rows, *starts, *lens], dtype=torch.int64, device="cpu"), device)
    rows_d, lse_d, starts_d, lens_d = packed.split([m, m, m, m])
    return StatGroup(policy=policy, rows=rows_d, lse_rows=lse_d, starts=starts_d, lens=lens_d, total=sum(lens),
                     max_len=max(lens, default=0))


def add_attention(
    slab: Tensor, local_layer: int, group: StatGroup, probs: Tensor | None = None,
    logits: "DecodeLogits | None" = None,
) -> None:
    """Add what layer `local_layer`'s attention contributes to the group's statistics, in place
    in the slab: from `probs` [k, H_kv, G, N] (the block's statistics rows, 0 past each length),
    or from `logits` (a kernel's scaled logits of those rows and every request's log-sum-exp)."""
    if logits is not None and _kernel_device(slab) and group.policy.contribution_power in (1, 2):
        kernels = _triton_stats()
        if kernels is not None:
            kernels.add_contribution(slab, local_layer, group, logits)
            return
    if probs is None:
        probs = torch.exp(logits.logits[group.rows] - logits.lse[group.lse_rows].unsqueeze(-1))
    else:
        probs = probs[group.rows]
    if probs.shape[-1] < group.max_len:  # a layer's tables narrower than the widest request's columns
        probs = torch.nn.functional.pad(probs, (0, group.max_len - probs.shape[-1]))
    added = group.policy.contribution(probs.unsqueeze(3))  # [m, H_kv, N]
    member, column, slab_cols = group.columns()
    cols = added.permute(1, 0, 2)[:, member, column]  # [H_kv, sum(lens)]
    slab.select(1, local_layer).index_add_(1, slab_cols, cols)


def _kernel_device(t: Tensor) -> bool:
    """Whether `t` is where the Triton kernel runs compiled (CUDA)."""
    return t.is_cuda


def _triton_stats() -> Any:
    try:
        from sgl_kvc.kernels import triton_stats
    except ImportError:  # no triton: the torch version serves
        return None
    return triton_stats
