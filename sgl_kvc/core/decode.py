"""One decode step of a compressing server: its plan, made once from the scheduler's host-side
batch, and the batched attention every layer runs through it.

The plan cuts the step's requests into blocks (longest first, so a block pads to similar
lengths; padded keys bounded by `DECODE_BLOCK_ELEMS`) and gathers their slots, or their per-head
tables on the unit pool, once for every layer. Attention is one padded computation per block
(`kernels/decode_attention.py`, or `kernels/per_head_attention.py` through per-head tables),
and the softmax attention it computed feeds the statistics of the requests that keep them
(H2O, Batch-Max, KV-Compress): they pay no second q·K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc.core.host import host_tensor, to_device
from sgl_kvc.core.request_state import block_tables
from sgl_kvc.kernels.decode_attention import decode_attention, decode_probs
from sgl_kvc.kernels.per_head_attention import HeadTables, fast_per_head_decode
from sgl_kvc.policies import Policy

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState

DECODE_BLOCK_ELEMS = 1 << 22  # bound on the padded float32 keys of one block of a decode step


@dataclass(frozen=True)
class StatGroup:
    """Requests of one decode block whose policies share a statistic (one policy class): what
    one step adds to their statistics is computed for all of them at once."""

    policy: Policy
    local: Tensor | None  # their indices in the block (None: the whole block)
    states: tuple["ReqKvState", ...]
    lens: tuple[int, ...]  # statistic columns of each (cache entries; table width when packed)


@dataclass(frozen=True)
class DecodeBlock:
    """Requests of a decode step padded to the longest of them."""

    index: Tensor  # [b] their indices in the batch
    slots: Tensor | None  # [b, n_max] int64: slot of entry j of each (its first slot past its length)
    pad: Tensor | None  # [b, n_max] bool: True past each request's length
    groups: tuple[StatGroup, ...]
    # On the unit pool (variable budgets) the block is read through per-head tables instead
    # (and `slots` / `pad` are None):
    units: Tensor | None = None  # [L, b, H_kv, N] int64, unit of entry j of each (layer, head)
    lens: Tensor | None = None  # [L, b, H_kv] entries of each (layer, head)
    # Per layer, its widest head in the block (CPU only: read without a device sync). Budgets
    # differ between layers, so the padded torch kernel reads each layer only that wide.
    widths: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DecodeStep:
    """One decode step's plan, used by every layer: its requests in blocks, their slots
    gathered once. `attends`: the blocks hold every request of the batch and sgl-kvc's kernel
    computes the step's attention; otherwise they hold only the requests that keep statistics."""

    blocks: tuple[DecodeBlock, ...]
    attends: bool
    size: int  # requests in the batch
    first_layer: int = 0  # layer ids of this rank start here (tables are indexed from it)

    @property
    def has_stats(self) -> bool:
        return any(block.groups for block in self.blocks)

    @classmethod
    def build(
        cls, rows: list[int], lens: list[int], states: dict[int, "ReqKvState"], req_to_token: Tensor,
        token_elems: int, attends: bool, units: tuple[int, int] | None = None, first_layer: int = 0,
    ) -> "DecodeStep":
        """`rows`/`lens`: the batch's `req_to_token` rows and their lengths (slots), in batch
        order (host-side lists: no device sync); `token_elems`: key elements per slot and layer
        (H_kv x d), which sizes the blocks; `units`: (layers, KV heads) of the unit pool, whose
        blocks get per-head tables (as wide as their widest table)."""
        stats = {i for i, row in enumerate(rows) if (s := states.get(row)) is not None and s.policy.uses_stats}
        picked = list(range(len(rows))) if attends else sorted(stats)
        row_lens = lens
        if units is not None:
            # A packed head may hold more entries than the row has slots: its width counts.
            lens = [n if (s := states.get(row)) is None else s.table_width(n) for row, n in zip(rows, lens)]
        picked.sort(key=lambda i: -lens[i])
        device = req_to_token.device
        per_block = max(1, DECODE_BLOCK_ELEMS // max(1, token_elems))  # padded entries per block
        blocks = []
        start = 0
        while start < len(picked):
            n_max = max(1, lens[picked[start]])
            end = start + max(1, min(len(picked) - start, per_block // n_max))
            members = picked[start:end]
            start = end
            b_rows = host_tensor([rows[i] for i in members], device)
            by_class: dict[type, list[int]] = {}
            for j, i in enumerate(members):
                if i in stats:
                    by_class.setdefault(type(states[rows[i]].policy), []).append(j)
            groups = tuple(
                StatGroup(
                    policy=states[rows[members[js[0]]]].policy,
                    local=None if len(js) == len(members) else host_tensor(js, device),
                    states=tuple(states[rows[members[j]]] for j in js),
                    lens=tuple(lens[members[j]] for j in js),
                )
                for js in by_class.values()
            )
            index = host_tensor(members, device)
            if units is not None:  # read through per-head tables: no slot rows to gather
                m_rows = [row_lens[i] for i in members]
                block_units, block_lens = block_tables(
                    [states.get(rows[i]) for i in members], req_to_token[b_rows, : max(1, max(m_rows))],
                    m_rows, *units, n_max,
                )
                widths = None
                if block_lens.device.type == "cpu":  # on CUDA the Triton kernel walks each head's length
                    widths = tuple(max(1, w) for w in block_lens.amax(dim=(1, 2)).tolist())
                blocks.append(DecodeBlock(index=index, slots=None, pad=None, groups=groups,
                                          units=block_units, lens=block_lens, widths=widths))
                continue
            b_lens = torch.tensor([lens[i] for i in members], dtype=torch.int64, device="cpu")
            pad = to_device(torch.arange(n_max, device="cpu")[None, :] >= b_lens[:, None], device)
            slots = req_to_token[b_rows, :n_max].long()
            # Padding reads the request's own first entry: finite, so its weight 0 stays 0 (the
            # kernel does not mask the values; a stale slot may hold anything).
            slots = torch.where(pad, slots[:, :1], slots)
            blocks.append(DecodeBlock(index=index, slots=slots, pad=pad, groups=groups))
        return cls(blocks=tuple(blocks), attends=attends, size=len(rows), first_layer=first_layer)

    # --- attention through the plan -----------------------------------------------------------
    def attend(
        self, layer: int, q: Tensor, k_cache: Any, v_cache: Any, scale: float, out: Tensor,
        unit_pools: tuple[Any, Any] | None = None,
    ) -> None:
        """The step's decode attention of layer id `layer` (q: [B, H_q, d], one query per
        request) into `out` [B, H_q, d_v], one batched computation per block; the attention it
        computed feeds the statistics of the requests that keep them. `unit_pools`: the flat K
        and V unit pools, read by blocks planned through per-head tables."""
        for block in self.blocks:
            if block.units is not None:  # per-head tables over the unit pool
                local = layer - self.first_layer
                units, width = block.units[local], block.units.shape[-1]
                if block.widths is not None:
                    units = units[..., : block.widths[local]]
                tables = HeadTables(units=units, lengths=block.lens[local])
                k_units, v_units = unit_pools
                if not block.groups:  # no statistics to feed: the kernel writes no probabilities
                    out[block.index] = fast_per_head_decode(q[block.index], k_units, v_units, tables, scale)
                    continue
                o, probs = fast_per_head_decode(q[block.index], k_units, v_units, tables, scale, return_probs=True)
                if probs.shape[-1] < width:  # statistics columns span the block
                    probs = torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
            else:
                o, probs = decode_attention(q[block.index], k_cache, v_cache, block.slots, block.pad, scale)
            out[block.index] = o
            _add_stats(layer, block, probs)

    def accumulate(self, layer: int, q: Tensor, key_buffer: Any, scale: float) -> None:
        """Statistics only (another kernel computed the attention): the softmax attention of the
        step's statistics requests over their own keys, one padded computation per block."""
        for block in self.blocks:
            probs = decode_probs(q[block.index], key_buffer, block.slots, block.pad, scale)
            _add_stats(layer, block, probs)


def _add_stats(layer: int, block: DecodeBlock, probs: Tensor) -> None:
    """probs: [b, H_kv, G, n_max] of the block's requests."""
    for g in block.groups:
        # What this step adds, for all of the group's requests in one computation; then per
        # request only its old statistic (widened by the new token) is added.
        grouped = (probs if g.local is None else probs[g.local]).unsqueeze(3)
        added = g.policy.contribution(grouped)  # [k, H_kv, n_max], a new tensor
        for k, (state, n) in enumerate(zip(g.states, g.lens)):
            new = added[k, :, :n]  # a view: each request's slice is its own
            old = state.stats[layer]
            if old is not None:
                new[:, : old.shape[1]] += old
            state.stats[layer] = new
