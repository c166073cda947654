"""Moving kept KV entries inside a pool (plain torch; the SGLang side that allocates, frees and
rewrites rows is `sgl_kvc.adapter.moments.compaction`).

A pool here is anything with `get_kv_buffer(layer_id) -> (K, V)` of [slots, H_kv, d] (SGLang's
MHA pools, the FP8 pool's `Fp8Rows`) and `start_layer` / `layer_num`; the unit pool is also
read flat ([units, d], `unit_buffers()`). Every move gathers before it scatters, so sources may
sit in destinations (KV-Compress Alg. 1's MoveCache, done as gather + scatter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from sgl_kvc.policies import HeadSelection


def move_units_many(pool: Any, moves: Sequence[tuple[Tensor, Tensor, Tensor]]) -> None:
    """Per request (row, indices, dest), per layer l and KV head h: entry j of (l, h) <- entry
    indices[l, h, j] of the row, written to slot dest[j]. One gather + scatter per layer and
    buffer for all requests (they own disjoint slots, so their moves do not interfere). Works on
    SGLang's tensors and on the FP8 pool's `Fp8Rows` (codes and scales move together, no
    re-quantization)."""
    start = int(getattr(pool, "start_layer", 0))
    num_layers, num_heads = int(moves[0][1].shape[0]), int(moves[0][1].shape[1])
    device = moves[0][0].device
    heads = torch.arange(num_heads, device=device)[:, None]  # [H, 1]
    dest = torch.cat([d for _, _, d in moves])
    dst = dest[None, :].expand(num_heads, int(dest.numel()))
    for layer in range(num_layers):
        src = torch.cat([row[indices[layer]] for row, indices, _ in moves], dim=1)  # [H, sum k]
        for buf in pool.get_kv_buffer(start + layer):
            buf[dst, heads] = buf[src, heads]


@dataclass(frozen=True)
class UnitMoves:
    """Where a packed request's kept entries go on the unit pool (KV-Compress §4.2)."""

    src: Tensor  # units the kept entries are read from, in (layer, head, column) order
    dst: Tensor  # units they are written to
    table: Tensor  # the request's new tables [L, H_kv, max_keep] (0 past each head's length)


def packed_slots(selection: HeadSelection) -> int:
    """Slots a packed request fills: G = ceil(total / (L x H_kv)) (KV-Compress §5.1)."""
    per_slot = selection.num_layers * selection.num_heads
    return -(-selection.total // per_slot)


def unit_moves(selection: HeadSelection, units: Tensor, dest: Tensor) -> UnitMoves:
    """Kept entry e (in (layer, head, column) order of `selection` over the tables `units`
    [L, H_kv, N]) goes to unit e of the packed slots `dest` [G]: units of slot t fill first."""
    per_slot = selection.num_layers * selection.num_heads
    if units.shape[-1] != selection.n:
        raise ValueError(f"a selection over {selection.n} columns for tables of {units.shape[-1]}")
    valid = selection.valid()
    src = units.gather(-1, torch.where(valid, selection.indices, 0))[valid]
    rel = torch.arange(src.numel(), device=dest.device)
    dst = dest[rel // per_slot] * per_slot + rel % per_slot
    table = torch.zeros_like(selection.indices)
    table[valid] = dst  # (layer, head, column) order, as src
    return UnitMoves(src=src, dst=dst, table=table)


def move_unit_entries(unit_pools: Sequence[Any], moves: Sequence[UnitMoves]) -> None:
    """Apply several requests' `UnitMoves` to the flat K and V unit pools at once (the gather
    completes before the scatter)."""
    src = torch.cat([m.src for m in moves])
    dst = torch.cat([m.dst for m in moves])
    for buf in unit_pools:
        buf[dst] = buf[src]
