"""One decode step of a compressing server: its plan, made once from the scheduler's host-side
batch, and the batched attention every layer runs through it.

Where the attention kernel pads (the torch kernels, on a CPU), the plan cuts the step's requests
into blocks (longest first, so a block pads to similar lengths; padded keys bounded by
`DECODE_BLOCK_ELEMS`) and gathers their slots, or their per-head tables on the unit pool, once
for every layer. Attention is one padded computation per block (`kernels/decode_attention.py`,
or `kernels/per_head_attention.py` through per-head tables).

Where it pads nothing (`fused`: the Triton kernel on CUDA), the step is ONE block of every
request in batch order, read through per-head tables (a slot cache is viewed as a unit pool,
`flat_heads`): a layer's attention is one kernel launch and a fixed few torch operations,
whatever the batch size.

The softmax attention a kernel computed feeds the statistics of the requests that keep them
(H2O, Batch-Max, KV-Compress): they pay no second q·K, and the kernel writes probabilities only
for them. A step's statistics are updated per policy class in a fixed number of operations
(`_add_stats`); the requests' statistics are then views of one new tensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc.core.host import host_tensor, to_device
from sgl_kvc.core.request_state import block_tables
from sgl_kvc.kernels.decode_attention import decode_attention, decode_probs
from sgl_kvc.kernels.per_head_attention import HeadTables, fast_per_head_decode, flat_heads, row_tables
from sgl_kvc.policies import Policy

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState

DECODE_BLOCK_ELEMS = 1 << 22  # bound on the padded float32 keys of one block of a decode step


@dataclass(frozen=True)
class StatGroup:
    """Requests of one decode block whose policies share a statistic (one policy class): what
    one step adds to their statistics is computed for all of them at once.

    Their new statistics are one tensor [H_kv, sum(lens)] (request k's columns start at
    `starts[k]`), gathered from the step's contribution at (`rows`, `cols`); each request's
    previous statistic, `widths[k]` columns wide (0: none), is added at `old_cols` (host-side
    plans, sent to the device once for every layer)."""

    policy: Policy
    local: Tensor | None  # their rows in the block's probabilities (None: all of them)
    states: tuple["ReqKvState", ...]
    lens: tuple[int, ...]  # statistic columns of each (cache entries; table width when packed)
    starts: tuple[int, ...]
    rows: Tensor  # [sum(lens)] int64: each new column's request (index into the group)
    cols: Tensor  # [sum(lens)] int64: and its column in that request's statistic
    widths: tuple[int, ...]  # columns of each one's previous statistic, as planned
    old_cols: Tensor | None  # [sum(widths)] int64: where the previous statistics add


@dataclass(frozen=True)
class DecodeBlock:
    """Requests of a decode step padded to the longest of them."""

    index: Tensor | None  # [b] their indices in the batch (None: the whole batch, in order)
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
    # A fused step over a slot cache: every layer's per-head tables over `flat_heads(cache)`.
    row_tables: HeadTables | None = None
    # The block's requests that keep statistics ([k] int64, block-local), whose probabilities
    # the kernel returns; None: all of them (or none, when `groups` is empty).
    probs_rows: Tensor | None = None


@dataclass(frozen=True)
class DecodeStep:
    """One decode step's plan, used by every layer: its requests in blocks, their slots
    gathered once. `attends`: the blocks hold every request of the batch and sgl-kvc's kernel
    computes the step's attention; otherwise they hold only the requests that keep statistics.
    `fused`: one block, read through per-head tables by a kernel that pads nothing."""

    blocks: tuple[DecodeBlock, ...]
    attends: bool
    size: int  # requests in the batch
    first_layer: int = 0  # layer ids of this rank start here (tables are indexed from it)
    fused: bool = False

    @property
    def has_stats(self) -> bool:
        return any(block.groups for block in self.blocks)

    @classmethod
    def build(
        cls, rows: list[int], lens: list[int], states: dict[int, "ReqKvState"], req_to_token: Tensor,
        token_elems: int, attends: bool, units: tuple[int, int] | None = None, first_layer: int = 0,
        fused: bool = False, kv_heads: int = 1,
    ) -> "DecodeStep":
        """`rows`/`lens`: the batch's `req_to_token` rows and their lengths (slots), in batch
        order (host-side lists: no device sync); `token_elems`: key elements per slot and layer
        (H_kv x d), which sizes the blocks; `units`: (layers, KV heads) of the unit pool, whose
        blocks get per-head tables (as wide as their widest table); `fused`: see the class (its
        per-head tables over a slot cache need its `kv_heads`)."""
        stats = {i for i, row in enumerate(rows) if (s := states.get(row)) is not None and s.policy.uses_stats}
        picked = list(range(len(rows))) if attends else sorted(stats)
        if not picked:
            return cls(blocks=(), attends=attends, size=len(rows), first_layer=first_layer, fused=fused)
        row_lens = lens
        if units is not None:
            # A packed head may hold more entries than the row has slots: its width counts.
            lens = [n if (s := states.get(row)) is None else s.table_width(n) for row, n in zip(rows, lens)]
        device = req_to_token.device
        if fused:
            runs = [picked]  # batch order: the whole batch needs no index
        else:
            picked.sort(key=lambda i: -lens[i])
            runs = _blocks(picked, lens, max(1, DECODE_BLOCK_ELEMS // max(1, token_elems)))
        blocks = []
        for members in runs:
            n_max = max(1, max(lens[i] for i in members))
            b_rows = host_tensor([rows[i] for i in members], device)
            index = None if members == list(range(len(rows))) else host_tensor(members, device)
            keeping = [j for j, i in enumerate(members) if i in stats]
            groups = _stat_groups(members, keeping, rows, lens, states, device)
            probs_rows = None if len(keeping) == len(members) or not keeping else host_tensor(keeping, device)
            if units is not None:  # read through per-head tables: no slot rows to gather
                m_rows = [row_lens[i] for i in members]
                block_units, block_lens = block_tables(
                    [states.get(rows[i]) for i in members], req_to_token[b_rows, : max(1, max(m_rows))],
                    m_rows, *units, n_max,
                )
                widths = None
                if not fused and block_lens.device.type == "cpu":  # else the kernel walks each head's length
                    widths = tuple(max(1, w) for w in block_lens.amax(dim=(1, 2)).tolist())
                blocks.append(DecodeBlock(index=index, slots=None, pad=None, groups=groups, units=block_units,
                                          lens=block_lens, widths=widths, probs_rows=probs_rows))
                continue
            b_lens = torch.tensor([lens[i] for i in members], dtype=torch.int64, device="cpu")
            slots = req_to_token[b_rows, :n_max].long()
            if fused:  # the tables' lengths mask past each request's length
                tables = row_tables(slots, to_device(b_lens, device), kv_heads)
                blocks.append(DecodeBlock(index=index, slots=None, pad=None, groups=groups, row_tables=tables,
                                          probs_rows=probs_rows))
                continue
            pad = to_device(torch.arange(n_max, device="cpu")[None, :] >= b_lens[:, None], device)
            # Padding reads the request's own first entry: finite, so its weight 0 stays 0 (the
            # kernel does not mask the values; a stale slot may hold anything).
            slots = torch.where(pad, slots[:, :1], slots)
            blocks.append(DecodeBlock(index=index, slots=slots, pad=pad, groups=groups, probs_rows=probs_rows))
        return cls(blocks=tuple(blocks), attends=attends, size=len(rows), first_layer=first_layer, fused=fused)

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
            qb = q if block.index is None else q[block.index]
            if block.slots is None:  # per-head tables, over the unit pool or a flattened slot cache
                o, probs = self._per_head(block, layer, qb, k_cache, v_cache, scale, unit_pools)
            else:
                o, probs = decode_attention(qb, k_cache, v_cache, block.slots, block.pad, scale)
                if block.probs_rows is not None and block.groups:
                    probs = probs[block.probs_rows]
            if block.index is None:
                out.copy_(o)
            else:
                out[block.index] = o
            if block.groups:
                _add_stats(layer, block, probs)

    def _per_head(
        self, block: DecodeBlock, layer: int, q: Tensor, k_cache: Any, v_cache: Any, scale: float,
        unit_pools: tuple[Any, Any] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of a block read through per-head tables, and the probabilities of its
        requests that keep statistics (None if none does)."""
        if block.row_tables is not None:
            tables, k_units, v_units = block.row_tables, flat_heads(k_cache), flat_heads(v_cache)
        else:
            local = layer - self.first_layer
            units = block.units[local]
            if block.widths is not None:
                units = units[..., : block.widths[local]]
            tables = HeadTables(units=units, lengths=block.lens[local])
            k_units, v_units = unit_pools
        if not block.groups:  # no statistics to feed: the kernel writes no probabilities
            return fast_per_head_decode(q, k_units, v_units, tables, scale), None
        o, probs = fast_per_head_decode(q, k_units, v_units, tables, scale, return_probs=True,
                                        probs_rows=block.probs_rows)
        width = (block.units if block.units is not None else block.row_tables.units).shape[-1]
        if probs.shape[-1] < width:  # statistics columns span the block
            probs = torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
        return o, probs

    def accumulate(self, layer: int, q: Tensor, key_buffer: Any, scale: float) -> None:
        """Statistics only (another kernel computed the attention): the softmax attention of the
        step's statistics requests over their own keys, one computation per block (a fused step
        runs the per-head kernel, its keys standing in for the values it does not need)."""
        for block in self.blocks:
            qb = q if block.index is None else q[block.index]
            if block.row_tables is not None:
                keys = flat_heads(key_buffer)
                _, probs = fast_per_head_decode(qb, keys, keys, block.row_tables, scale, return_probs=True)
            else:
                probs = decode_probs(qb, key_buffer, block.slots, block.pad, scale)
            _add_stats(layer, block, probs)


def _blocks(picked: list[int], lens: list[int], per_block: int) -> list[list[int]]:
    """Requests (longest first) cut into blocks of at most `per_block` padded entries."""
    runs, start = [], 0
    while start < len(picked):
        n_max = max(1, lens[picked[start]])
        end = start + max(1, min(len(picked) - start, per_block // n_max))
        runs.append(picked[start:end])
        start = end
    return runs


def _stat_groups(
    members: list[int], keeping: list[int], rows: list[int], lens: list[int],
    states: dict[int, "ReqKvState"], device: torch.device,
) -> tuple[StatGroup, ...]:
    """The block's statistics requests (`keeping`: block-local) by policy class, each group's
    gather and scatter planned on the host (`StatGroup`)."""
    by_class: dict[type, list[int]] = {}
    for k, j in enumerate(keeping):  # k: row of the block's probabilities
        by_class.setdefault(type(states[rows[members[j]]].policy), []).append(k)
    groups = []
    for ks in by_class.values():
        group_states = tuple(states[rows[members[keeping[k]]]] for k in ks)
        group_lens = tuple(lens[members[keeping[k]]] for k in ks)
        starts = tuple(itertools.accumulate((0,) + group_lens[:-1]))
        # A previous statistic wider than the request's entries cannot be planned (-1: the update
        # takes the per-request path, which refuses it).
        widths = tuple(w if (w := _width(state)) <= n else -1 for state, n in zip(group_states, group_lens))
        total, old_total = sum(group_lens), sum(max(w, 0) for w in widths)
        n_lens = torch.tensor(group_lens, dtype=torch.int64, device="cpu")
        req = torch.repeat_interleave(torch.arange(len(ks), device="cpu"), n_lens, output_size=total)
        first = torch.tensor(starts, dtype=torch.int64, device="cpu")
        col = torch.arange(total, device="cpu") - first[req]
        old_cols = None
        if old_total:
            w = torch.tensor(widths, dtype=torch.int64, device="cpu").clamp_(min=0)
            owner = torch.repeat_interleave(torch.arange(len(ks), device="cpu"), w, output_size=old_total)
            old_first = w.cumsum(0) - w
            old_cols = to_device(torch.arange(old_total, device="cpu") - old_first[owner] + first[owner], device)
        groups.append(StatGroup(
            policy=group_states[0].policy,
            local=None if len(ks) == len(members) or len(ks) == len(keeping) else host_tensor(ks, device),
            states=group_states, lens=group_lens, starts=starts,
            rows=to_device(req, device), cols=to_device(col, device), widths=widths, old_cols=old_cols,
        ))
    return tuple(groups)


def _width(state: "ReqKvState") -> int:
    """Columns of a request's current statistic (its layers agree but after a failed update)."""
    for stat in state.stats:
        if stat is not None:
            return int(stat.shape[1])
    return 0


def _add_stats(layer: int, block: DecodeBlock, probs: Tensor) -> None:
    """probs: [k, H_kv, G, n_max], of the block's requests that keep statistics."""
    for g in block.groups:
        # What this step adds, for all of the group's requests in one computation.
        grouped = (probs if g.local is None else probs[g.local]).unsqueeze(3)
        added = g.policy.contribution(grouped)  # [k, H_kv, n_max], a new tensor
        olds = [state.stats[layer] for state in g.states]
        if all((0 if o is None else o.shape[1]) == w for o, w in zip(olds, g.widths)):
            # As planned: one gather, one concatenation, one scatter-add, whatever the requests.
            new = added.permute(1, 0, 2)[:, g.rows, g.cols]  # [H_kv, sum(lens)]
            if g.old_cols is not None:
                new.index_add_(1, g.old_cols, torch.cat([o for o in olds if o is not None], dim=1))
            for state, start, n in zip(g.states, g.starts, g.lens):
                state.stats[layer] = new[:, start : start + n]  # a view: each request's columns
            continue
        for k, (state, n) in enumerate(zip(g.states, g.lens)):  # a layer left behind by a failure
            new = added[k, :, :n]
            old = state.stats[layer]
            if old is not None:
                new[:, : old.shape[1]] += old
            state.stats[layer] = new
