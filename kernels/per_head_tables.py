"""The tables and plans the per-head attention kernels read (`per_head_attention`, the PyTorch
reference and CPU path; `triton_per_head`, the CUDA kernels): plain dataclasses, no kernel code,
so that both import them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SPLIT_COLUMNS = 512  # table columns per split of the Triton decode kernel (one program each)


@dataclass(frozen=True)
class HeadTables:
    """Index tables of B requests x H_kv KV heads over one layer's flat pool.

    units:     int64 [B, H_kv, N]: unit of the j-th kept token of (request b, head h), in cache
               order (increasing logical position); entries at j >= lengths[b, h] are ignored.
    lengths:   int64 [B, H_kv]: tokens held by each (request, head); may be 0.
    positions: int64 [B, H_kv, N] or None: logical (RoPE) position of each entry. Needed by
               :func:`per_head_extend` only (decode queries see every cached token).
    heads_per_slot: 0, or the KV heads of a slot cache read through `flat_heads`: then `units`
               is [B, 1, N], each request's SLOTS, shared by its heads (head h of slot s is unit
               s x heads_per_slot + h), and `lengths` is [B, heads_per_slot]. One table per
               request instead of one per head (`row_tables`).
    row_index: None, or int64 [B]: request b's table is row `row_index[b]` of `units` (then
               [R, 1, >= N] slot tables: SGLang's `req_to_token`, read in place, no table made),
               its first `columns` columns.
    """

    units: Tensor
    lengths: Tensor
    positions: Tensor | None = None
    heads_per_slot: int = 0
    row_index: Tensor | None = None
    columns: int = 0

    def __post_init__(self) -> None:
        if self.units.dim() != 3:
            raise ValueError(f"units must be [B, H_kv, N], got {tuple(self.units.shape)}")
        heads = self.heads_per_slot or int(self.units.shape[1])
        if self.heads_per_slot and self.units.shape[1] != 1:
            raise ValueError(f"slot tables must be [B, 1, N], got {tuple(self.units.shape)}")
        requests = int(self.units.shape[0]) if self.row_index is None else int(self.row_index.shape[0])
        if self.row_index is not None and (not self.heads_per_slot or self.columns > self.units.shape[2]):
            raise ValueError("a table read by row index is a slot table of at most its rows' width")
        if tuple(self.lengths.shape) != (requests, heads):
            raise ValueError(f"lengths must be {(requests, heads)}, got {tuple(self.lengths.shape)}")
        if self.positions is not None and (self.heads_per_slot or self.positions.shape != self.units.shape):
            raise ValueError(
                f"positions must be {tuple(self.units.shape)} per-head tables, got {tuple(self.positions.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.lengths.shape[1])

    @property
    def width(self) -> int:
        """Columns of every table (the longest one's, padding included)."""
        return self.columns if self.row_index is not None else int(self.units.shape[2])

    def head_units(self) -> Tensor:
        """int64 [B, H_kv, N]: the unit of every (request, head, column), slot tables expanded."""
        if not self.heads_per_slot:
            return self.units
        units = self.units if self.row_index is None else self.units[self.row_index, :, : self.columns]
        heads = torch.arange(self.heads_per_slot, dtype=torch.int64, device=self.units.device)
        return units.to(torch.int64) * self.heads_per_slot + heads[None, :, None]

    def valid(self) -> Tensor:
        """Bool [B, H_kv, N]: which table entries are real."""
        cols = torch.arange(self.width, device=self.units.device)
        return cols < self.lengths.unsqueeze(-1)


@dataclass(frozen=True)
class LogitRows:
    """Which requests of a decode call keep their attention logits (those whose policy keeps
    statistics): `slots[b]` is request b's row of the returned logits, -1 for none; `rows` the
    requests that have one, in increasing order (`slots[rows] = 0, 1, ...`), `count` their number
    and `width` their widest table, how wide the logits are (a longer request without statistics
    widens none of them). Planned on the host once per decode step (`core/decode.py`)."""

    slots: Tensor  # int64 [B]
    rows: Tensor  # int64 [count]
    count: int
    width: int  # columns of the logits: the widest of those requests' tables


@dataclass(frozen=True)
class SplitPlan:
    """How the Triton decode kernel splits a call's requests: `plan` int64 [2B], each request's
    number of splits of `SPLIT_COLUMNS` columns, then the first of its parts in the kernel's
    workspace (only requests of several splits have parts); `total` those parts and `most` the
    largest number of splits (host-side). Planned once per decode step (`core/decode.py`,
    `split_plan`), so that the workspace follows the entries, not the longest request times the
    batch."""

    plan: Tensor
    total: int
    most: int


@dataclass(frozen=True)
class DecodeLogits:
    """What a decode call returns for the statistics: the scaled logits [count, H_kv, G, N]
    (float32; entries past a head's length are unspecified) and the log-sum-exp [B, H_kv, G] of
    every request, so that p = exp(logit - lse)."""

    logits: Tensor
    lse: Tensor
