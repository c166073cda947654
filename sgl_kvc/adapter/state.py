"""Per-request compression state and the observation store shared by scheduler and attention.

`KvcStore` lives on the attention backend object of a scheduler process. The attention backend
writes into it during forward passes (observation-window queries, attention statistics); the
compressor reads it between steps. Rows are SGLang's `req_pool_idx` (the `req_to_token` row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.kernels.decode_attention import decode_attention, decode_probs
from sgl_kvc.kernels.per_head_attention import HeadTables, fast_per_head_decode
from sgl_kvc.policies import DEFAULT_SELECTION, Policy, gqa_logits

STATS_BLOCK = 256  # query rows per block when accumulating prefill attention statistics
DECODE_BLOCK_ELEMS = 1 << 22  # bound on the padded float32 keys of one block of a decode step


def unit_index(slots: Tensor, num_layers: int, num_heads: int) -> Tensor:
    """Units of token slots [n] in every (layer, KV head) of the unit pool
    (`adapter/unit_pool.py`): slot t, layer l, head h is unit (t x L + l) x H_kv + h.
    Returns [L, H_kv, n] int64."""
    device = slots.device
    layer = torch.arange(num_layers, device=device)[:, None, None]
    head = torch.arange(num_heads, device=device)[None, :, None]
    return (slots.to(torch.int64)[None, None, :] * num_layers + layer) * num_heads + head


@dataclass(frozen=True)
class RequestTables:
    """One request's cache per (layer, KV head) in the unit pool: entry j of head (l, h) is unit
    `units[l, h, j]` at logical position `positions[l, h, j]`, for j < lens[l, h] (the rest is
    padding, 0). Columns are stable while a request decodes: its packed entries (ascending
    position), then the tokens appended since, so statistics index them like cache entries."""

    units: Tensor  # [L, H_kv, N] int64
    lens: Tensor  # [L, H_kv] int64
    positions: Tensor  # [L, H_kv, N] int64

    @property
    def width(self) -> int:
        return int(self.units.shape[-1])

    @classmethod
    def natural(cls, slots: Tensor, positions: Tensor, num_layers: int, num_heads: int) -> "RequestTables":
        """Every head holds the row's n entries in its own units (an unpacked request);
        positions: [n] or [L, H_kv, n]."""
        n = int(slots.numel())
        return cls(
            units=unit_index(slots, num_layers, num_heads),
            lens=torch.full((num_layers, num_heads), n, dtype=torch.int64),
            positions=positions.to(torch.int64).expand(num_layers, num_heads, n),
        )


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
    """Requests of a decode step padded to the longest of them (the step is cut into blocks
    so the padded keys stay under `DECODE_BLOCK_ELEMS`)."""

    index: Tensor  # [b] their indices in the batch
    slots: Tensor | None  # [b, n_max] int64: slot of entry j of each (slot 0 past its length)
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
    """One decode step's plan, made once from the scheduler's host-side batch (no device sync)
    and used by every layer: its requests in blocks, their slots gathered once. `attends`: the
    blocks hold every request of the batch and sgl-kvc's kernel computes the step's attention
    (`decode_attention`); otherwise they hold only the requests that keep statistics."""

    blocks: tuple[DecodeBlock, ...]
    attends: bool
    size: int  # requests in the batch

    @property
    def has_stats(self) -> bool:
        return any(block.groups for block in self.blocks)

    @classmethod
    def build(
        cls, rows: list[int], lens: list[int], states: dict[int, "ReqKvState"], req_to_token: Tensor,
        token_elems: int, attends: bool, units: tuple[int, int] | None = None,
    ) -> "DecodeStep":
        """`rows`/`lens`: the batch's `req_to_token` rows and cached entries, in batch order;
        `token_elems`: key elements per entry (H_kv x d), which sizes the blocks; `units`:
        (layers, KV heads) of the unit pool, whose blocks get per-head tables."""
        stats = {i for i, row in enumerate(rows) if (s := states.get(row)) is not None and s.policy.uses_stats}
        picked = list(range(len(rows))) if attends else sorted(stats)
        row_lens = lens
        if units is not None:
            # A packed head may hold more entries than the row has slots: its width counts.
            lens = [_table_width(states.get(row), n) for row, n in zip(rows, lens)]
        # Longest first, so a block's padding is to similar lengths.
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
            b_rows = torch.tensor([rows[i] for i in members], dtype=torch.int64)
            by_class: dict[type, list[int]] = {}
            for j, i in enumerate(members):
                if i in stats:
                    by_class.setdefault(type(states[rows[i]].policy), []).append(j)
            groups = tuple(
                StatGroup(
                    policy=states[rows[members[js[0]]]].policy,
                    local=None if len(js) == len(members) else torch.tensor(js, device=device),
                    states=tuple(states[rows[members[j]]] for j in js),
                    lens=tuple(lens[members[j]] for j in js),
                )
                for js in by_class.values()
            )
            index = torch.tensor(members, dtype=torch.int64).to(device, non_blocking=True)
            if units is not None:  # read through per-head tables: no slot rows to gather
                block_units, block_lens = _unit_block(
                    [states.get(rows[i]) for i in members], b_rows, [row_lens[i] for i in members],
                    req_to_token, n_max, *units,
                )
                widths = None
                if block_lens.device.type == "cpu":  # on CUDA the Triton kernel walks each head's length
                    widths = tuple(max(1, w) for w in block_lens.amax(dim=(1, 2)).tolist())
                blocks.append(DecodeBlock(index=index, slots=None, pad=None, groups=groups,
                                          units=block_units, lens=block_lens, widths=widths))
                continue
            b_lens = torch.tensor([lens[i] for i in members], dtype=torch.int64)
            pad = torch.arange(n_max)[None, :] >= b_lens[:, None]
            slots = req_to_token[b_rows.to(device), :n_max].long()
            pad = pad.to(device, non_blocking=True)
            slots.masked_fill_(pad, 0)
            blocks.append(DecodeBlock(index=index, slots=slots, pad=pad, groups=groups))
        return cls(blocks=tuple(blocks), attends=attends, size=len(rows))


def _table_width(state: "ReqKvState | None", n: int) -> int:
    """Columns of a request's per-head tables over its n cached entries (`ReqKvState.tables`)."""
    if state is None or state.units is None:
        return n
    return int(state.units.shape[-1]) + n - state.packed


def _unit_block(
    states: list["ReqKvState | None"], rows: Tensor, row_lens: list[int], req_to_token: Tensor,
    width: int, num_layers: int, num_heads: int,
) -> tuple[Tensor, Tensor]:
    """The per-head tables `ReqKvState.tables` gives each request of a decode block (units only),
    built for the block at once: packed tables are copied in, then every request's tail (its
    slots past the packed ones) is gathered and placed after each head's own entries in one
    scatter. `row_lens`: cached entries of each row. Returns units [L, b, H_kv, width] and lens
    [L, b, H_kv]."""
    device = req_to_token.device
    b = len(states)
    units = torch.zeros(num_layers, b, num_heads, width + 1, dtype=torch.int64, device=device)
    head_lens = torch.zeros(num_layers, b, num_heads, dtype=torch.int64, device=device)
    packed = [0] * b
    for j, state in enumerate(states):
        if state is not None and state.units is not None:
            units[:, j, :, : state.units.shape[-1]] = state.units.to(device)
            head_lens[:, j] = state.unit_lens.to(device)
            packed[j] = state.packed
    tails = torch.tensor([n - g for n, g in zip(row_lens, packed)], dtype=torch.int64)
    t_max = int(tails.max()) if b else 0
    if t_max:
        cols = torch.arange(t_max)
        valid = (cols[None, :] < tails[:, None]).to(device)  # [b, T]
        src = (torch.tensor(packed, dtype=torch.int64)[:, None] + cols).to(device)
        src = torch.where(valid, src, 0)
        slots = req_to_token[rows.to(device)[:, None], src].long()  # [b, T]
        tail_units = unit_index(slots.reshape(-1), num_layers, num_heads)  # [L, H, b x T]
        tail_units = tail_units.reshape(num_layers, num_heads, b, t_max).transpose(1, 2)
        dst = head_lens[..., None] + cols.to(device)  # after each head's own entries
        dst = torch.where(valid[None, :, None, :], dst, width)  # padding -> the spare column
        units.scatter_(-1, dst, tail_units)
        head_lens += tails.to(device)[None, :, None]
    return units[..., :width].contiguous(), head_lens  # read by every layer of the step


@dataclass
class ReqKvState:
    """What the compressor knows about one request, beyond SGLang's own `Req`.

    Physical index j (its slot is `req_to_token[row, j]`) holds the token at logical position
    `kept_positions[..., j]` for j < k (the number of entries kept by the last compaction), and
    `j + offset` after that: every token appended since the last compaction sits at its logical
    position minus `offset`. `kept_positions` is [k] after a shared compaction (the same token in
    every layer and head) and [L, H_kv, k] after a per-head one (entry j of head h of layer l is
    its own token: layer l's KV head h of slot `req_to_token[row, j]` holds it).

    After a variable-budget compaction (the unit pool) the request is PACKED: its first `packed`
    slots hold its kept entries unit by unit, head (l, h) keeping `unit_lens[l, h]` of them in
    units `units[l, h, :unit_lens[l, h]]` at `kept_positions[l, h, :unit_lens[l, h]]`; entries
    appended since sit in their own slots, physical index j >= packed at position j + offset.
    """

    policy: Policy
    budget: int
    budget_ratio: float | None = None
    selection: str = DEFAULT_SELECTION
    kept_positions: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    offset: int = 0
    stats: list[Tensor | None] = field(default_factory=list)
    passes: int = 0
    pending: Any = None  # the compressor's PendingPass while a staged pass is under way
    units: Tensor | None = None  # [L, H_kv, K] once packed (0 past unit_lens)
    unit_lens: Tensor | None = None  # [L, H_kv]
    packed: int = 0  # slots the packed entries fill

    @property
    def compressed(self) -> bool:
        return self.passes > 0

    @property
    def per_head(self) -> bool:
        return self.selection == "per-head"

    def positions(self, n: int) -> Tensor:
        """Logical positions of the n cached entries: [n], or [L, H_kv, n] once per-head."""
        kept = self.kept_positions[..., :n]
        k = kept.shape[-1]
        tail = torch.arange(k, n, dtype=torch.int64) + self.offset
        if kept.dim() > 1:
            tail = tail.expand(*kept.shape[:-1], n - k)
        return torch.cat([kept, tail], dim=-1) if k else tail

    def tables(self, slots: Tensor, num_layers: int, num_heads: int) -> RequestTables:
        """The request's per-head tables over its n = len(slots) cached entries (its row)."""
        n = int(slots.numel())
        if self.units is None:
            return RequestTables.natural(slots, self.positions(n), num_layers, num_heads)
        g, k = self.packed, int(self.units.shape[-1])
        tail = n - g
        units = torch.zeros(num_layers, num_heads, k + tail, dtype=torch.int64)
        positions = torch.zeros_like(units)
        units[..., :k] = self.units
        positions[..., :k] = self.kept_positions
        cols = self.unit_lens[..., None] + torch.arange(tail)  # after each head's own entries
        units.scatter_(-1, cols, unit_index(slots[g:].cpu(), num_layers, num_heads))
        tail_positions = torch.arange(g, n, dtype=torch.int64) + self.offset
        positions.scatter_(-1, cols, tail_positions.expand(num_layers, num_heads, tail))
        return RequestTables(units=units, lens=self.unit_lens + tail, positions=positions)

    def logical_len(self, n: int) -> int:
        """Tokens the request has processed, for n cached entries (the newest is at n-1+offset,
        or, right after a compaction, the kept entries end at offset + k)."""
        return n + self.offset

    def effective_budget(self, n: int) -> int:
        if self.budget_ratio is None:
            return self.budget
        return max(self.policy.params.window + 1, math.ceil(self.budget_ratio * self.logical_len(n)))


class KvcStore:
    """Observation-window queries and attention statistics, per `req_to_token` row.

    Per-step work stays on the device and never syncs with the host: queries go into a ring
    buffer (a write index per row, no shifting), query counts and RoPE position offsets are
    device tensors indexed by the batch's rows.
    """

    def __init__(
        self, num_layers: int, window: int, req_to_token: Tensor, kv_pool: object, first_layer: int = 0
    ) -> None:
        self.num_layers = num_layers
        self.first_layer = first_layer  # the layer whose call advances the per-row counters
        self.req_to_token = req_to_token  # SGLang's [rows, max_len] slot table
        self.kv_pool = kv_pool  # SGLang's KV pool (get_key_buffer(layer_id) -> [slots, H_kv, d])
        self.window = window
        # KV heads of this rank (a pass's cost is split per head) and key elements per entry
        key_shape = kv_pool.get_key_buffer(first_layer).shape if kv_pool is not None else (0, 1, 1)
        self.kv_heads = int(key_shape[1])
        self.token_elems = int(key_shape[1]) * int(key_shape[2])
        # Whether sgl-kvc's batched kernel computes decode attention (set by the compressor for
        # backends whose decode it replaces); otherwise only statistics requests are planned.
        self.attends = False
        self.attended_layers = 0  # decode layer calls the kernel served (stats)
        # The unit pool's flat K [U, d] and V [U, d_v] (`--kv-head-budget variable`), else None.
        self.unit_pools: tuple[Tensor, Tensor] | None = (
            kv_pool.unit_buffers() if hasattr(kv_pool, "unit_buffers") else None
        )
        self.states: dict[int, ReqKvState] = {}
        self.stats_rows: set[int] = set()  # rows whose policy accumulates attention statistics
        rows, device = req_to_token.shape[0], req_to_token.device
        # Ring buffer [capacity, layers, window, H_q, d] indexed by `_top - row`: SGLang hands out
        # request rows from the top of its free list and reuses freed ones first, so the
        # capacity needed follows the peak number of requests, not the row count SGLang reserves
        # (2048 rows of a 30-layer model's queries would outweigh a small KV pool).
        self._queries: Tensor | None = None
        self._top = rows - 1
        self._need = 1  # capacity the begun rows need
        self._head = torch.zeros(rows, dtype=torch.int64, device=device)  # slot of the newest
        self._count = torch.zeros(rows, dtype=torch.int64, device=device)
        # logical minus physical position of tokens appended since a row's last compaction
        self.offsets = torch.zeros(rows, dtype=torch.int64, device=device)
        self.offset_rows: set[int] = set()  # rows with a non-zero offset (host-side, no sync)
        self.decode_step: DecodeStep | None = None  # set by the scheduler before each decode
        self.extend_rows: list[int] = []  # rows of the current extend batch, set before it

    def begin_decode(self, rows: list[int], lens: list[int]) -> None:
        """Before a decode forward: plan it from the batch's `req_to_token` rows and cached
        entries (host-side data: no device sync in the forward)."""
        self.decode_step = (
            DecodeStep.build(rows, lens, self.states, self.req_to_token, self.token_elems, self.attends,
                             units=self.unit_layout)
            if self.attends or self.stats_rows else None
        )  # fmt: skip

    @property
    def unit_layout(self) -> tuple[int, int] | None:
        """(layers of this rank, KV heads) on the unit pool, else None."""
        if self.unit_pools is None:
            return None
        return self.num_layers - self.first_layer, self.kv_heads

    # --- request lifecycle --------------------------------------------------------------------
    def begin(self, row: int, state: ReqKvState) -> None:
        self._need = max(self._need, self._top - row + 1)
        state.stats = [None] * self.num_layers
        self.states[row] = state
        self._count[row] = 0
        self.set_offset(row, 0)
        if state.policy.uses_stats:
            self.stats_rows.add(row)
        else:
            self.stats_rows.discard(row)

    def set_offset(self, row: int, offset: int) -> None:
        self.offsets[row] = offset
        if offset:
            self.offset_rows.add(row)
        else:
            self.offset_rows.discard(row)

    # --- observation-window queries -----------------------------------------------------------
    def _buffer(self, rows: int, q: Tensor) -> Tensor:
        have = 0 if self._queries is None else self._queries.shape[0]
        if have < self._need:  # grow by doubling, up to SGLang's row count
            capacity = min(max(self._need, 2 * have), rows)
            grown = q.new_zeros((capacity, self.num_layers, self.window, q.shape[1], q.shape[2]))
            if self._queries is not None:
                grown[:have] = self._queries
            self._queries = grown
        return self._queries

    @property
    def query_buffer_bytes(self) -> int:
        q = self._queries
        return 0 if q is None else q.numel() * q.element_size()

    def record_decode(self, layer: int, rows: Tensor, q: Tensor, pool_rows: int) -> None:
        """q: [B, H_q, d], one new query per row."""
        buf = self._buffer(pool_rows, q)
        if layer == self.first_layer:
            self._head[rows] = (self._head[rows] + 1) % self.window
            self._count[rows] = (self._count[rows] + 1).clamp_(max=self.window)
        buf[self._top - rows, layer, self._head[rows]] = q.to(buf.dtype)

    def record_extend(self, layer: int, row: int, q: Tensor, pool_rows: int) -> None:
        """q: [e, H_q, d], the queries of one request's extend (chunk), in order."""
        buf = self._buffer(pool_rows, q)
        m = min(q.shape[0], self.window)
        if layer == self.first_layer:
            self._head[row] = (self._head[row] + m) % self.window
            self._count[row] = (self._count[row] + m).clamp_(max=self.window)
        buf[self._top - row, layer, self._ring(row, m)] = q[-m:].to(buf.dtype)

    def _ring(self, row: int, m: int) -> Tensor:
        """Ring indices of a row's last m queries, oldest first."""
        steps = torch.arange(1 - m, 1, device=self._head.device)
        return (self._head[row] + steps) % self.window

    def queries(self, row: int, layer: int, n: int) -> Tensor | None:
        """The last min(count, window, n) queries of a row, oldest first."""
        if self._queries is None:
            return None
        m = min(int(self._count[row]), n)
        if m == 0:
            return None
        return self._queries[self._top - row, layer, self._ring(row, m)]

    def trim_queries(self, row: int, n: int) -> None:
        """After compaction to n tokens, fewer queries than tokens may remain valid."""
        self._count[row] = self._count[row].clamp(max=n)

    # --- attention statistics ------------------------------------------------------------------
    def accumulate(
        self, row: int, layer: int, q: Tensor, keys: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float
    ) -> None:
        """Feed the softmax attention of queries q [e, H_q, d] (at physical indices q_pos) over
        keys [n, H_kv, d] (physical indices k_pos) to the row's policy statistic, causally."""
        state = self.states.get(row)
        if state is None or not state.policy.uses_stats:
            return
        h_kv, h_q = keys.shape[1], q.shape[1]
        for start in range(0, q.shape[0], STATS_BLOCK):
            qb = q[start : start + STATS_BLOCK]
            logits = gqa_logits(qb, keys, scale)  # [H_kv, G, q, n], no repeated keys
            causal = k_pos[None, :] > q_pos[start : start + STATS_BLOCK, None]
            logits.masked_fill_(causal, -math.inf)
            probs = torch.softmax(logits, dim=-1).reshape(h_q, qb.shape[0], -1)
            state.stats[layer] = state.policy.accumulate(state.stats[layer], probs, h_kv)

    def attend_decode(
        self, layer: int, step: DecodeStep, q: Tensor, k_cache: Any, v_cache: Any, scale: float, out: Tensor
    ) -> None:
        """The step's decode attention (q: [B, H_q, d], one query per request) into `out`
        [B, H_q, d_v], one batched computation per block; the attention it computed feeds the
        statistics of the requests that keep them."""
        self.attended_layers += 1
        for block in step.blocks:
            if block.units is not None:  # per-head tables over the unit pool
                local = layer - self.first_layer
                units, width = block.units[local], block.units.shape[-1]
                if block.widths is not None:
                    units = units[..., : block.widths[local]]
                tables = HeadTables(slots=units, lengths=block.lens[local])
                k_units, v_units = self.unit_pools
                o, probs = fast_per_head_decode(q[block.index], k_units, v_units, tables, scale, return_probs=True)
                if block.groups and probs.shape[-1] < width:  # statistics columns span the block
                    probs = torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))
            else:
                o, probs = decode_attention(q[block.index], k_cache, v_cache, block.slots, block.pad, scale)
            out[block.index] = o
            self._add_decode_stats(layer, block, probs)

    def accumulate_decode(self, layer: int, step: DecodeStep, q: Tensor, key_buffer: Any, scale: float) -> None:
        """Statistics only (another kernel computed the attention): the softmax attention of the
        step's statistics requests over their own keys, one padded computation per block."""
        for block in step.blocks:
            probs = decode_probs(q[block.index], key_buffer, block.slots, block.pad, scale)
            self._add_decode_stats(layer, block, probs)

    def _add_decode_stats(self, layer: int, block: DecodeBlock, probs: Tensor) -> None:
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
