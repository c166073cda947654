"""One decode step of a compressing server: its plan, made once from the scheduler's host-side
batch, and the batched attention every layer runs through it.

Where the attention kernel pads (the torch kernels, on a CPU), the plan cuts the step's requests
into blocks (longest first, so a block pads to similar lengths; padded keys bounded by
`DECODE_BLOCK_ELEMS`) and gathers their slots, or their per-head tables on the unit pool, once
for every layer. Attention is one padded computation per block (`kernels/decode_attention.py`,
or `kernels/per_head_attention.py` through per-head tables).

Where it pads nothing (`fused`: the Triton kernel on CUDA; the torch version stands in for it on
a CPU, where the tests run this plan), the step is read through tables (a slot cache is viewed
as a unit pool, `flat_heads`, each request's slots one table for all its heads, `row_tables`):
ONE block of every request in batch order, a layer's attention one kernel launch and a fixed few
operations, whatever the batch size, as long as what a layer's call allocates (tables, the
kernel's workspace, the statistics' logits: `fused_block_bytes`) stays within
`FUSED_BLOCK_BYTES`. A batch beyond it (one very long request among short ones) is cut into
blocks of requests of similar lengths (none shorter than half its block's longest), each within
the bound, so that memory and time follow the entries the batch holds, not its longest request
times its size.

The softmax attention a kernel computed feeds the statistics of the requests that keep them
(H2O, Batch-Max, KV-Compress): they pay no second q·K, and the kernel writes logits only for
them. A step's statistics live in one tensor (`core/stat_slab.py`): each layer adds to them per
policy class with one launch (`kernels/triton_stats.py`), and no operation runs per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc.core.host import host_tensor, to_device
from sgl_kvc.core.request_state import TABLE_ENTRY_BYTES, block_tables
from sgl_kvc.core.stat_group import StatGroup
from sgl_kvc.core.stat_slab import StepSlab, add_attention, plan_group, plan_slab
from sgl_kvc.kernels.decode_attention import decode_attention, decode_probs, plain_decode, rounds_like_sdpa
from sgl_kvc.kernels.per_head_attention import (
    SPLIT_COLUMNS, DecodeLogits, HeadTables, LogitRows, SplitPlan, fast_per_head_decode, flat_heads, row_tables,
)

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState

DECODE_BLOCK_ELEMS = 1 << 22  # bound on the padded float32 keys of one block of a decode step
FUSED_BLOCK_BYTES = 64 << 20  # bound on what one block of a fused step allocates per layer call


@dataclass(frozen=True)
class DecodeShape:
    """What sizes a fused block's allocations: KV heads, query heads per KV head, the value head
    dim, and the layers of the unit pool's per-head tables (0: a slot cache, whose requests'
    rows of SGLang's `req_to_token` are read in place, no table made)."""

    kv_heads: int
    group: int = 8
    head_dim_v: int = 128
    table_layers: int = 0

    @property
    def table_bytes_per_column(self) -> int:
        """Table bytes per request and column: none for a slot cache; on the unit pool one
        int64 per layer and head, three times (`block_tables` holds at most two temporaries of the
        tables' size while it builds them)."""
        return 3 * TABLE_ENTRY_BYTES * self.table_layers * self.kv_heads


def fused_block_bytes(lens: list[int], keeping: list[int], shape: DecodeShape) -> int:
    """Bytes a fused block of requests of `lens` entries allocates for a layer call: its tables
    (padded to the longest), the Triton kernel's float32 workspace (the partial outputs, maxima and
    sums of the splits of each request of several, `SplitPlan`; the log-sum-exp) and output, and
    the logits of the requests that keep statistics (`keeping`: their entries), padded to the
    longest of them."""
    h, g, dv = shape.kv_heads, shape.group, shape.head_dim_v
    parts = sum(c for n in lens if (c := -(-n // SPLIT_COLUMNS)) > 1)
    workspace = (parts * (dv + 2) + len(lens)) * h * g * 4
    output = len(lens) * h * g * dv * 4
    logits = len(keeping) * max(keeping, default=0) * h * g * 4
    return len(lens) * max(lens, default=0) * shape.table_bytes_per_column + workspace + output + logits


def split_plan(widths: list[int], device: torch.device, split_n: int = SPLIT_COLUMNS) -> SplitPlan:
    """The Triton kernel's splits of requests whose tables are `widths` wide, from the host."""
    counts = [max(1, -(-w // split_n)) for w in widths]
    firsts, total = [], 0
    for c in counts:
        firsts.append(total)
        total += c if c > 1 else 0
    return SplitPlan(host_tensor(counts + firsts, device), total=total, most=max(counts, default=1))


@dataclass(frozen=True)
class DecodeBlock:
    """Requests of a decode step read together (one kernel call per layer), tables padded to the
    longest of them."""

    index: Tensor | None  # [b] their indices in the batch (None: the whole batch, in order)
    slots: Tensor | None  # [b, n_max] int64: slot of entry j of each (its first slot past its length)
    pad: Tensor | None  # [b, n_max] bool: True past each request's length
    groups: tuple[StatGroup, ...]
    # On the unit pool (variable budgets) the block is read through per-head tables instead
    # (and `slots` / `pad` are None):
    # Per layer [b, H_kv, N_l] int64, unit of entry j of each head, N_l the layer's widest head
    # in the block (budgets differ between layers: `block_tables`)
    units: tuple[Tensor, ...] | None = None
    lens: Tensor | None = None  # [L, b, H_kv] entries of each (layer, head)
    # A fused step over a slot cache: the requests' rows of `req_to_token`, read in place as
    # slot tables over `flat_heads(cache)`.
    row_tables: HeadTables | None = None
    # The block's requests that keep statistics ([k] int64, block-local), whose attention feeds
    # them; None: all of them (or none, when `groups` is empty).
    probs_rows: Tensor | None = None
    # The same, as the per-head kernels' map from request to its row of the logits.
    logit_rows: LogitRows | None = None
    # A fused block: how the Triton kernel splits each request (its workspace follows them).
    splits: SplitPlan | None = None
    # A block of intact requests (`ReqKvState.intact`, read through `slots`): their lengths.
    # Where the model's dtype rounds as SDPA does (bfloat16), they are attended as plain SGLang
    # attends them (`plain_decode`), so that they answer as plain SGLang answers.
    plain_lens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DecodeStep:
    """One decode step's plan, used by every layer: its requests in blocks, their slots
    gathered once. `attends`: the blocks hold every request of the batch and sgl-kvc's kernel
    computes the step's attention; otherwise they hold only the requests that keep statistics.
    `fused`: read through tables by a kernel that pads nothing (one block unless that would
    exceed `FUSED_BLOCK_BYTES`). `slab`: the step's statistics (`core/stat_slab.py`)."""

    blocks: tuple[DecodeBlock, ...]
    attends: bool
    size: int  # requests in the batch
    first_layer: int = 0  # layer ids of this rank start here (tables are indexed from it)
    fused: bool = False
    slab: StepSlab | None = None

    @property
    def has_stats(self) -> bool:
        return any(block.groups for block in self.blocks)

    @classmethod
    def build(
        cls, rows: list[int], lens: list[int], states: dict[int, "ReqKvState"], req_to_token: Tensor,
        token_elems: int, attends: bool, units: tuple[int, int] | None = None, first_layer: int = 0,
        fused: bool = False, kv_heads: int = 1, num_layers: int = 1, group: int = 8,
        block_bytes: int | None = None, intact_apart: bool = True,
    ) -> "DecodeStep":
        """`rows`/`lens`: the batch's `req_to_token` rows and their lengths (slots), in batch
        order (host-side lists: no device sync); `token_elems`: key elements per slot and layer
        (H_kv x d), which sizes the padded blocks; `units`: (layers, KV heads) of the unit pool,
        whose blocks get per-head tables (as wide as their widest table); `fused`: see the class
        (its tables over a slot cache need its `kv_heads`); `num_layers`: the layers of this
        rank (the statistics' slab); `group`: query heads per KV head and `block_bytes` what a fused
        block may allocate per layer call (default `FUSED_BLOCK_BYTES`); `intact_apart`: the
        requests that hold nothing compressed in blocks of their own (`DecodeBlock.plain_lens`)."""
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
            head_dim = max(1, token_elems // max(1, kv_heads))
            shape = DecodeShape(kv_heads=kv_heads, group=group, head_dim_v=head_dim,
                                table_layers=0 if units is None else units[0])
            runs = _fused_blocks(picked, lens, stats, shape, FUSED_BLOCK_BYTES if block_bytes is None else block_bytes)
            plain: set[int] = set()
            tabled = set(picked) if units is not None else set()
        else:
            # Intact requests in blocks of their own (read as plain SGLang reads them, where the
            # dtype asks for it), the others after them; each longest first.
            plain = {i for i in picked if attends and intact_apart and _intact(states.get(rows[i]))}
            # On the unit pool, a request whose heads keep equal numbers (not packed) is read
            # through its row as on a uniform pool, in blocks of its own: no tables to build.
            tabled = set() if units is None else {i for i in picked if i not in plain and _packed(states.get(rows[i]))}
            per_block = max(1, DECODE_BLOCK_ELEMS // max(1, token_elems))
            parts = ([i for i in picked if i in plain], [i for i in picked if i not in plain and i not in tabled],
                     [i for i in picked if i in tabled])
            runs = [run for part in parts for run in _blocks(sorted(part, key=lambda i: -lens[i]), lens, per_block)]
        keeping_order = [i for run in runs for i in run if i in stats]
        slab = None
        if keeping_order:
            slab = plan_slab([states[rows[i]] for i in keeping_order], [max(1, lens[i]) for i in keeping_order],
                             first_layer, first_layer + num_layers, kv_heads, device)
        start_of = dict(zip(keeping_order, slab.starts)) if slab is not None else {}
        blocks = []
        for members in runs:
            n_max = max(1, max(lens[i] for i in members))
            b_rows = host_tensor([rows[i] for i in members], device)
            splits = split_plan([lens[i] for i in members], device) if fused else None
            index = None if members == list(range(len(rows))) else host_tensor(members, device)
            keeping = [j for j, i in enumerate(members) if i in stats]
            groups = _stat_groups(members, keeping, rows, lens, states, start_of, device)
            probs_rows = None if len(keeping) == len(members) or not keeping else host_tensor(keeping, device)
            logit_rows = None
            is_plain = members[0] in plain
            if keeping and (members[0] in tabled or fused) and not is_plain:  # per-head kernels write their logits
                slot_of = [-1] * len(members)
                for r, j in enumerate(keeping):
                    slot_of[j] = r
                slots_d, rows_d = host_tensor(slot_of + keeping, device).split([len(members), len(keeping)])
                logit_rows = LogitRows(slots=slots_d, rows=rows_d, count=len(keeping),
                                       width=max(lens[members[j]] for j in keeping))
            if members[0] in tabled:  # read through per-head tables: no slot rows to gather
                m_rows = [row_lens[i] for i in members]
                block_states = [states.get(rows[i]) for i in members]
                # each layer as wide as its widest head in the block (budgets differ between layers);
                # a row not packed is as wide as itself in every layer
                packed_widths = [s.layer_widths(n, units[0]) for s, n in zip(block_states, m_rows)
                                 if s is not None and s.packed_entries is not None]
                whole = max((n for s, n in zip(block_states, m_rows) if s is None or s.packed_entries is None),
                            default=1)
                widths = [max(whole, *column) for column in zip(*packed_widths)] if packed_widths else [whole] * units[0]
                block_units, block_lens = block_tables(
                    block_states, req_to_token[b_rows, : max(1, max(m_rows))], m_rows, *units, widths,
                )
                blocks.append(DecodeBlock(index=index, slots=None, pad=None, groups=groups, units=block_units,
                                          lens=block_lens, probs_rows=probs_rows, logit_rows=logit_rows,
                                          splits=splits))
                continue
            b_lens = torch.tensor([lens[i] for i in members], dtype=torch.int64, device="cpu")
            if fused:  # the requests' rows, read in place; the lengths mask past each one's
                tables = row_tables(req_to_token, to_device(b_lens, device), kv_heads, rows=b_rows, columns=n_max)
                blocks.append(DecodeBlock(index=index, slots=None, pad=None, groups=groups, row_tables=tables,
                                          probs_rows=probs_rows, logit_rows=logit_rows, splits=splits))
                continue
            slots = req_to_token[b_rows, :n_max].long()
            pad = to_device(torch.arange(n_max, device="cpu")[None, :] >= b_lens[:, None], device)
            # Padding reads the request's own first entry: finite, so its weight 0 stays 0 (the
            # kernel does not mask the values; a stale slot may hold anything).
            slots = torch.where(pad, slots[:, :1], slots)
            blocks.append(DecodeBlock(index=index, slots=slots, pad=pad, groups=groups, probs_rows=probs_rows,
                                      plain_lens=tuple(lens[i] for i in members) if is_plain else None))
        return cls(blocks=tuple(blocks), attends=attends, size=len(rows), first_layer=first_layer, fused=fused,
                   slab=slab)

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
            probs = logits = None
            if block.slots is None:  # tables, over the unit pool or a flattened slot cache
                tables, k_units, v_units = self._tables(block, layer, k_cache, v_cache, unit_pools)
                if block.groups:
                    o, logits = fast_per_head_decode(qb, k_units, v_units, tables, scale, logit_rows=block.logit_rows,
                                                     splits=block.splits)
                else:  # no statistics to feed: the kernel writes no logits
                    o = fast_per_head_decode(qb, k_units, v_units, tables, scale, splits=block.splits)
            elif block.plain_lens is not None and rounds_like_sdpa(q.dtype):
                o, probs = plain_decode(qb, k_cache, v_cache, block.slots, block.plain_lens, scale, block.pad,
                                        block.probs_rows, want_probs=bool(block.groups))
            else:
                o, probs = decode_attention(qb, k_cache, v_cache, block.slots, block.pad, scale)
                if block.probs_rows is not None:
                    probs = probs[block.probs_rows]
            if block.index is None:
                out.copy_(o)
            else:
                out[block.index] = o
            self._add_stats(layer, block, probs, logits)

    def accumulate(self, layer: int, q: Tensor, key_buffer: Any, scale: float,
                   unit_pools: tuple[Any, Any] | None = None) -> None:
        """Statistics only (another kernel computed the attention): the softmax attention of the
        step's statistics requests over their own keys, one computation per block (a per-head
        block runs the per-head kernel, its keys standing in for the values it does not need)."""
        for block in self.blocks:
            if not block.groups:
                continue
            qb = q if block.index is None else q[block.index]
            probs = logits = None
            if block.slots is None:
                tables, keys, _ = self._tables(block, layer, key_buffer, key_buffer, unit_pools, keys_only=True)
                _, logits = fast_per_head_decode(qb, keys, keys, tables, scale, logit_rows=block.logit_rows,
                                                 splits=block.splits)
            else:
                probs = decode_probs(qb, key_buffer, block.slots, block.pad, scale)
                if block.probs_rows is not None:  # the statistics read the rows of their requests only
                    probs = probs[block.probs_rows]
            self._add_stats(layer, block, probs, logits)

    def _tables(
        self, block: DecodeBlock, layer: int, k_cache: Any, v_cache: Any, unit_pools: tuple[Any, Any] | None,
        keys_only: bool = False,
    ) -> tuple[HeadTables, Any, Any]:
        """A per-head block's tables for layer id `layer` and the flat pools they index
        (`keys_only`: the keys stand in for the values, for statistics alone)."""
        if block.row_tables is not None:
            return block.row_tables, flat_heads(k_cache), flat_heads(v_cache)
        local = layer - self.first_layer
        units = block.units[local]
        k_units, v_units = unit_pools
        if keys_only:
            v_units = k_units
        return HeadTables(units=units, lengths=block.lens[local]), k_units, v_units

    def _add_stats(self, layer: int, block: DecodeBlock, probs: Tensor | None, logits: DecodeLogits | None) -> None:
        """What this layer's attention adds to the statistics of the block's requests that keep
        them: one update per policy class, in place in the step's slab."""
        for g in block.groups:
            add_attention(self.slab.slab, layer - self.first_layer, g, probs=probs, logits=logits)


def _packed(state: "ReqKvState | None") -> bool:
    """A request whose kept entries are packed in the unit pool (`ReqKvState.packed_entries`)."""
    return state is not None and state.packed_entries is not None


def _intact(state: "ReqKvState | None") -> bool:
    """A request sgl-kvc holds nothing of (no state), or whose row is whole (`ReqKvState.intact`)."""
    return state is None or state.intact


def _blocks(picked: list[int], lens: list[int], per_block: int) -> list[list[int]]:
    """Requests (longest first) cut into blocks of at most `per_block` padded entries."""
    runs, start = [], 0
    while start < len(picked):
        n_max = max(1, lens[picked[start]])
        end = start + max(1, min(len(picked) - start, per_block // n_max))
        runs.append(picked[start:end])
        start = end
    return runs


def _fused_blocks(picked: list[int], lens: list[int], stats: set[int], shape: DecodeShape,
                  bound: int) -> list[list[int]]:
    """The fused plan's blocks: every request in batch order if that is within
    `bound`; else, longest first, blocks of requests at least half their block's longest, each
    within the bound (a request beyond it alone, in a block of its own)."""
    def block_bytes(members: list[int]) -> int:
        return fused_block_bytes([lens[i] for i in members], [lens[i] for i in members if i in stats], shape)

    if block_bytes(picked) <= bound:
        return [picked]
    runs: list[list[int]] = []
    run: list[int] = []
    for i in sorted(picked, key=lambda i: -lens[i]):
        if run and (2 * lens[i] < lens[run[0]] or block_bytes(run + [i]) > bound):
            runs.append(run)
            run = []
        run.append(i)
    runs.append(run)
    return runs


def _stat_groups(
    members: list[int], keeping: list[int], rows: list[int], lens: list[int],
    states: dict[int, "ReqKvState"], start_of: dict[int, int], device: torch.device,
) -> tuple[StatGroup, ...]:
    """The block's statistics requests (`keeping`: block-local) by policy class, each group's
    rows, slab columns and gather planned on the host (`StatGroup`)."""
    by_class: dict[type, list[int]] = {}
    for k, j in enumerate(keeping):  # k: row of the block's statistics attention
        by_class.setdefault(type(states[rows[members[j]]].policy), []).append(k)
    groups = []
    for ks in by_class.values():
        batch = [members[keeping[k]] for k in ks]
        groups.append(plan_group(
            states[rows[batch[0]]].policy, rows=ks, lse_rows=[keeping[k] for k in ks],
            starts=[start_of[i] for i in batch], lens=[max(1, lens[i]) for i in batch], device=device,
        ))
    return tuple(groups)
