"""Decode attention that reads a request row in place: what a captured decode step runs.

One query per request. Request b's KV head h reads, in layer l, first the packed entries its
head keeps (the unit pool's packed requests: `PackedLayer`, the units `table[start[r, h] :][:
lens[r, h]]` of its row r), then its row's tail: positions `packed[r]` to its length of SGLang's
`req_to_token[r]`, the same slot in every head (unit slot x `slot_units` + `layer_units` + h: on
the unit pool L x H_kv and l x H_kv; over a slot cache viewed flat, `flat_heads`, H_kv and 0).
Everything it reads is a buffer (the rows, the lengths, the layout written between steps), so its
operations and their shapes depend on the batch size and `width` only, never on the batch's
contents, and nothing is read back to the host: a CUDA graph of it replays any later batch of
that size (`core/packed_rows.py`).

This is the torch version: every (request, head) padded to `width` columns (>= its packed
entries plus its tail) and masked, softmax in float32. On CUDA the Triton kernel of
`triton_row_decode.py` runs the same contract with no padding (its grid is the batch's requests,
heads and a fixed number of splits, each split's columns found on the device), so it needs no
`width`. The CPU runs this version in its tests and with `--kv-decode-graphs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedLayer:
    """One layer's view of `core/packed_rows.PackedRows`: the arena `table` [C + 1] int32 (its
    last entry a pad), each row's heads' first entry `start` [R, H_kv] and count `lens` [R, H_kv]
    in it, and the row positions `packed` [R] the packed entries take (its tail starts there)."""

    table: Tensor
    start: Tensor
    lens: Tensor
    packed: Tensor


def tail_units(slots: Tensor, slot_units: int, layer_units: int, heads: int) -> Tensor:
    """Units of token slots [..., n] in every KV head h of one layer: slot x `slot_units` +
    `layer_units` + h. Returns [..., H_kv, n] int64."""
    h = torch.arange(heads, device=slots.device, dtype=torch.int64)
    return slots.to(torch.int64).unsqueeze(-2) * slot_units + layer_units + h[:, None]


def row_units(req_to_token: Tensor, rows: Tensor, seq_lens: Tensor, packed: PackedLayer | None, width: int,
              heads: int, slot_units: int, layer_units: int) -> tuple[Tensor, Tensor]:
    """(units [b, H_kv, width] int64, valid [b, H_kv, width]) of the batch's rows (see the module
    doc); a column past a head's entries reads unit 0 (SGLang's padding slot: finite)."""
    r = rows.to(torch.int64)
    n = seq_lens.to(torch.int64)
    cols = torch.arange(width, device=rows.device, dtype=torch.int64)
    last = req_to_token.shape[1] - 1
    if packed is None:  # a row is its tail, from its first position, the same slot in every head
        slots = req_to_token[r[:, None], cols.clamp(max=last)[None, :]]  # [b, W]
        units = tail_units(slots, slot_units, layer_units, heads)
        valid = (cols[None, :] < n[:, None]).unsqueeze(1).expand(-1, heads, -1)
        return torch.where(valid, units, 0), valid
    first = packed.packed[r].to(torch.int64)  # [b]: where the tail starts in the row
    own = packed.lens[r].to(torch.int64)  # [b, H]: packed entries per head
    at = packed.start[r].to(torch.int64)
    valid = cols < (own + (n - first)[:, None])[..., None]  # [b, H, W]
    in_table = cols < own[..., None]
    pad = packed.table.shape[0] - 1
    table = packed.table[torch.where(in_table, at[..., None] + cols, pad)].to(torch.int64)
    position = (first[:, None, None] + cols - own[..., None]).clamp(0, last)
    slots = req_to_token[r[:, None, None], position]  # [b, H, W]
    heads_idx = torch.arange(heads, device=rows.device, dtype=torch.int64)[None, :, None]
    tail = slots.to(torch.int64) * slot_units + layer_units + heads_idx
    units = torch.where(in_table, table, tail)
    return torch.where(valid, units, 0), valid


def _gather(pool: Any, units: Tensor) -> Tensor:
    """pool rows at units [b, H, W] -> float32 [b, H, W, dim] (an FP8 pool dequantizes on read)."""
    rows = pool[units.reshape(-1)]
    return rows.reshape(*units.shape, -1).float()


def row_decode(
    q: Tensor, k_pool: Any, v_pool: Any, req_to_token: Tensor, rows: Tensor, seq_lens: Tensor, scale: float,
    out: Tensor, *, heads: int, width: int, slot_units: int, layer_units: int, packed: PackedLayer | None = None,
) -> None:
    """Decode attention of q [b, H_q, d] into `out` [b, H_q, d_v] (in place, its dtype), over flat
    pools K [U, d], V [U, d_v] (tensors, or FP8 `Fp8Rows`) of `heads` KV heads, rows read as the
    module doc says, each head padded to `width` columns. Query head h reads KV head h // G."""
    b, h_q, d = q.shape
    h_kv = heads
    units, valid = row_units(req_to_token, rows, seq_lens, packed, width, h_kv, slot_units, layer_units)
    keys, values = _gather(k_pool, units), _gather(v_pool, units)  # [b, H, W, d]
    qg = q.float().reshape(b, h_kv, h_q // h_kv, d)
    logits = torch.matmul(qg, keys.transpose(-1, -2)).mul_(scale)  # [b, H, G, W]
    logits.masked_fill_(~valid[:, :, None, :], -math.inf)
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # an empty head: every weight 0
    weights = torch.exp(logits - top)
    total = weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    o = torch.matmul(weights / total, values)  # [b, H, G, d_v]
    out.copy_(o.reshape(b, h_q, -1))

