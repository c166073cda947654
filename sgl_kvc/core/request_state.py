"""One request's compression state: where its kept entries are and which token each one holds.

Words (docs/architecture.md, "Glossary"): a *slot* is one token's KV in SGLang's pool (every
layer and KV head); a *row* is the request's list of slots (`req_to_token[row]`); an *entry* is
one cached (token, layer, KV head); a *unit* is one (slot, layer, KV head) cell of the unit
pool, which holds one entry; a head's *table* lists its entries' units in *columns*.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Sequence

import torch
from torch import Tensor

from sgl_kvc.core.host import host_tensor, to_device
from sgl_kvc.policies import DEFAULT_SELECTION, Policy


def unit_index(slots: Tensor, num_layers: int, num_heads: int) -> Tensor:
    """Units of token slots [n] in every (layer, KV head) of the unit pool
    (`adapter/memory/unit_pool.py`): slot t, layer l, head h is unit (t x L + l) x H_kv + h.
    Returns [L, H_kv, n] int64 on the slots' device."""
    device = slots.device
    layer = torch.arange(num_layers, device=device)[:, None, None]
    head = torch.arange(num_heads, device=device)[None, :, None]
    return (slots.to(torch.int64)[None, None, :] * num_layers + layer) * num_heads + head


@dataclass(frozen=True)
class Budget:
    """A request's budget: the entries each (layer, KV head) keeps after a pass. `tokens` fixed,
    or with `ratio` (`--kv-budget-ratio`) that fraction of the tokens it has processed, never
    fewer than `floor` (the window a policy always keeps, + 1).

    `held` entries more are a shared document's part of the row (`beyond`), standing for its
    first `covers` tokens: a ratio applies to the tokens after them only."""

    tokens: int
    ratio: float | None = None
    floor: int = 1
    held: int = 0
    covers: int = 0

    def at(self, length: int) -> int:
        """The budget of a request that has processed `length` tokens."""
        if self.ratio is None:
            return self.held + self.tokens
        return self.held + max(self.floor, math.ceil(self.ratio * max(0, length - self.covers)))

    def beyond(self, held: int, covers: int) -> "Budget":
        """This budget applied beyond a shared document's part of the row: `held` entries (k
        after a hit, D for the request that reads it whole) standing for its `covers` = D tokens.
        A ratio of every token processed would count the document's D tokens, already cut to
        its k: a hit of D = 1000 kept at 30%, its suffix of 50, at a ratio of 0.25, would be cut
        to 263 entries, below the document's own 300."""
        return replace(self, held=held, covers=covers)


@dataclass(frozen=True)
class RequestTables:
    """One request's cache per (layer, KV head) in the unit pool: entry j of head (l, h) is unit
    `units[l, h, j]` at logical position `positions[l, h, j]`, for j < lens[l, h] (the rest is
    padding, 0). Columns are stable while a request decodes: its packed entries (ascending
    position), then the tokens appended since, so statistics index them like cache entries."""

    units: Tensor  # [L, H_kv, N] int64
    lens: Tensor  # [L, H_kv] int64
    positions: Tensor  # [L, H_kv, N] int64
    # each layer's columns that hold entries (its widest head's), on the host; None: all N
    widths: tuple[int, ...] | None = None

    @property
    def width(self) -> int:
        return int(self.units.shape[-1])

    def layer(self, layer: int, own_width: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """(units, lens, positions) of one layer, [H_kv, W_l], [H_kv], [H_kv, W_l]: with
        `own_width`, only as wide as that layer's widest head, so that attention over a packed
        request's layer reads no more columns than it holds (KVzip's one sort over every head
        leaves one layer many times wider than the others, `benchmarks/head_widths.py`); else as
        wide as the tables (the columns a statistic indexes)."""
        w = self.width if self.widths is None or not own_width else self.widths[layer]
        return self.units[layer, :, :w], self.lens[layer], self.positions[layer, :, :w]

    @cached_property
    def host_lens(self) -> list[list[int]]:
        """`lens` on the host, read once: a pass visits every (layer, head), and reading each
        length from a GPU tensor would wait for the GPU that many times (the tables are never
        written after they are made)."""
        return self.lens.tolist()


TABLE_ENTRY_BYTES = 8  # an int64 column of a decode step's tables
PACKED_BYTES = 4  # an int32: a packed entry's unit or position (`PackedEntries`)
# What the server reserves per entry a packed request holds (`adapter/memory/kv_memory.Reservation`):
# its unit and position (`PackedEntries`, exact) and two columns of a decode step's tables
# (`block_tables`: each layer as wide as its widest head held 1.85x a request's entries at the median,
# at most 2.05x, in every style and at every budget measured: docs/benchmarks.md, "How wide a packed
# request's heads grow"). Not reserved: a layer whose entries are all in one of its heads would take
# H_kv columns an entry.
PACKED_ENTRY_BYTES = 2 * PACKED_BYTES + 2 * TABLE_ENTRY_BYTES


@dataclass(frozen=True, eq=False)
class PackedEntries:
    """A packed request's kept entries, head by head and without padding: entry e of the (layer,
    KV head, column) order is unit `units[e]` and holds the token at `positions[e]`; head (l, h)
    holds `lens[l, h]` of them. Flat as a shared document's metadata and the graph steps' arena
    are: one sort over every head (KVzip's) leaves its widest head many times the mean (a median
    16x at a budget of 64: docs/benchmarks.md, "How wide a packed request's heads grow"), and tensors
    [L, H_kv, K] as wide as it would hold more than the KV they describe. `widths` (each layer's
    widest head) and `entries` are on the host, read once when the entries are packed. int32, as
    a shared document's are (`adapter/documents/links.py`): a unit pool of 2^31 units would hold
    512 GB of K and V at head_dim 64, and a position is below the context."""

    units: Tensor  # [E] int32
    positions: Tensor  # [E] int32
    lens: Tensor  # [L, H_kv] int64
    widths: tuple[int, ...]
    entries: int

    @classmethod
    def of(cls, units: Tensor, lens: Tensor, positions: Tensor) -> "PackedEntries":
        """From tables [L, H_kv, K] (any width; what lies past each head's length is ignored)."""
        lens = lens.to(device=units.device, dtype=torch.int64)
        valid = torch.arange(units.shape[-1], device=units.device) < lens[..., None]
        flat_units = units[valid].to(torch.int32)  # (layer, head, column) order
        flat_positions = positions.to(units.device)[..., : units.shape[-1]][valid].to(torch.int32)
        widths = tuple(int(w) for w in lens.amax(dim=-1).tolist()) if lens.numel() else ()
        return cls(flat_units, flat_positions, lens, widths, int(flat_units.numel()))

    @property
    def width(self) -> int:
        """Its widest head's entries."""
        return max(self.widths, default=0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.units, self.positions, self.lens))

    def padded(self, values: Tensor, width: int | None = None) -> Tensor:
        """`values` ([E], `units` or `positions`) as int64 tables [L, H_kv, width], 0 past each
        head's length: entry e of head (l, h), the e - first[l, h]-th of its run, goes to that column."""
        layers, heads = self.lens.shape
        width = self.width if width is None else width
        flat = self.lens.reshape(-1).to(values.device)
        head = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat, output_size=self.entries)
        base = torch.arange(flat.numel(), device=flat.device) * width - (torch.cumsum(flat, 0) - flat)
        out = torch.zeros(layers * heads * width, dtype=torch.int64, device=values.device)
        out[base[head] + torch.arange(self.entries, device=flat.device)] = values.long()
        return out.view(layers, heads, width)


def block_tables(
    states: Sequence["ReqKvState | None"], slots: Tensor, row_lens: Sequence[int],
    num_layers: int, num_heads: int, widths: Sequence[int],
) -> tuple[tuple[Tensor, ...], Tensor]:
    """The per-head tables of several requests at once (units only), layer by layer: every packed
    request's entries (`PackedEntries`) are written into their heads' columns with one scatter, then
    every request's tail (its slots past the packed ones; the whole row of an unpacked one) is
    placed after each head's own entries, with another.

    `slots`: [b, >= max(row_lens)] each request's row; `row_lens`: its cached entries; `widths`:
    each layer's columns (>= every request's `layer_widths` there). Returns each layer's units
    [b, H_kv, widths[l]] (views of one buffer) and lens [L, b, H_kv], on the slots' device, 0 past
    each head's length. A layer is as wide as its own widest head: one sort over every head
    (KVzip's) leaves layers of very different widths, and tables as wide as the widest layer in
    every layer were 16x the entries (docs/benchmarks.md, "How wide a packed request's heads grow").

    A fixed number of operations whatever the batch (a GPU launches each once), each over the
    tables' entries at most once, with at most two temporaries of the tables' size alive at once
    (`DecodeShape.table_bytes_per_column`; the packed entries' own, an int64 each, are fewer): a
    decode step builds these for every layer, and on a CPU their size (b x H_kv x sum(widths)
    int64) is what the step pays for them."""
    device = slots.device
    b, L, H = len(states), num_layers, num_heads
    widths = [int(w) for w in widths]
    if len(widths) != L:
        raise ValueError(f"{len(widths)} widths for {L} layers")
    starts = list(itertools.accumulate([0] + [b * H * w for w in widths[:-1]]))
    buffer = torch.zeros(sum(b * H * w for w in widths), dtype=torch.int64, device=device)
    layer_tables = tuple(buffer[at : at + b * H * w].view(b, H, w) for at, w in zip(starts, widths))
    first_of = host_tensor(starts, device)  # [L]: each layer's first element
    width_of = host_tensor(widths, device)  # [L]
    head_lens = torch.zeros(L, b, H, dtype=torch.int64, device=device)
    packed = [0 if state is None or state.packed_entries is None else state.packed for state in states]
    tables = [j for j, state in enumerate(states) if state is not None and state.packed_entries is not None]
    if tables:  # every packed entry written once into its head's column, with one scatter
        own = [states[j].packed_entries for j in tables]
        lens = torch.stack([e.lens.to(device) for e in own])  # [R, L, H]
        at = host_tensor(tables, device)
        head_lens[:, at] = lens.transpose(0, 1)
        entries = sum(e.entries for e in own)
        if entries:
            # entries in (request, layer, head, column) order: entry e of run (r, l, h) goes to
            # column e - first[r, l, h] of that head's table
            flat = lens.reshape(-1)
            first = (torch.cumsum(flat, 0) - flat).view_as(lens)
            heads = at[:, None, None] * H + torch.arange(H, device=device)[None, None, :]  # [R, 1, H]
            base = (first_of[None, :, None] + heads * width_of[None, :, None] - first).reshape(-1)
            run = torch.repeat_interleave(torch.arange(flat.numel(), device=device), flat, output_size=entries)
            dst = base[run]
            del run
            dst += torch.arange(entries, device=device)
            buffer.scatter_(0, dst, torch.cat([e.units.to(device) for e in own]).long())
    tails = [n - g for n, g in zip(row_lens, packed)]
    items = sum(tails)
    if items:
        # one item per (request, tail entry): its slot's unit in every (layer, head), written at
        # column head_lens[l, req, h] + its index in the tail (shapes from the host's lists: no sync)
        counts = torch.tensor(tails, dtype=torch.int64, device="cpu")
        req = torch.repeat_interleave(torch.arange(b, device="cpu"), counts, output_size=items)
        tail_starts = torch.tensor(list(itertools.accumulate([0] + tails[:-1])), dtype=torch.int64, device="cpu")
        col = torch.arange(items, device="cpu") - torch.repeat_interleave(tail_starts, counts, output_size=items)
        req, col = to_device(req, device), to_device(col, device)
        first = host_tensor(packed, device)
        tail_slots = slots[req, first[req] + col].to(torch.int64)
        values = unit_index(tail_slots, L, H)  # [L, H, items]
        dst = head_lens.permute(0, 2, 1)[:, :, req]  # [L, H, items]: the flat index in `buffer`
        dst += ((req[None, None, :] * H + torch.arange(H, device=device)[None, :, None]) * width_of[:, None, None]
                + first_of[:, None, None])
        dst += col[None, None, :]
        buffer.scatter_(0, dst.view(-1), values.view(-1))
        head_lens += to_device(counts, device)[None, :, None]
    return layer_tables, head_lens


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
    slots hold its kept entries unit by unit, head (l, h) keeping `unit_lens[l, h]` of them, their
    units and logical positions in `packed_entries` (and `kept_positions` is None); entries
    appended since sit in their own slots, physical index j >= packed at position j + offset.

    Tensors live on `device`, the device of the request's KV.
    """

    policy: Policy  # compresses the generated tokens (decode, preempt); owns `stats`
    budget: Budget
    selection: str = DEFAULT_SELECTION
    device: Any = "cpu"
    kept_positions: Tensor | None = None
    offset: int = 0
    stats: list[Tensor | None] = field(default_factory=list)
    # The logical position of the first query its statistic accumulated (`LayerView.stats_since`):
    # D after it started from a shared document of D tokens, whose entries it has no statistic of
    # before (they start at 0 there, as every entry appended since does at its own position).
    stats_since: int = 0
    passes: int = 0
    pending: Any = None  # the compressor's PendingPass while a staged pass is under way
    packed_entries: PackedEntries | None = None  # once packed
    packed: int = 0  # slots the packed entries fill
    # Compacted between two chunks of its prompt: its token ids are read `offset` further on
    # than its row (the engine's fill ids are shifted by the adapter).
    fill_shift: bool = False
    prompt_policy: str | None = None  # compresses the prompt (prefill, chunk); None: `policy`
    # The moments of the prompt's pre-RoPE queries (`core/query_moments.py`), accumulated while
    # the prompt is prefilled when its prompt policy reads them (Expected Attention); None after.
    query_moments: Any = None
    # Passes put off in a row for lack of free slots, and the logical length before which no new
    # pass starts (the adapter backs off rather than score a pass it could not compact).
    skips: int = 0
    retry_at: int = 0
    # When its prompt policy reads a reconstruction (KVzip, `core/reconstruction.py`): the scores
    # of the one just run (`PassScores`: set at a prompt moment, taken by that moment's pass), and
    # what a compaction between chunks kept of earlier ones (`CarriedScores`, until its last chunk).
    reconstruction: Any = None
    reconstructed: Any = None

    PROMPT_MOMENTS = ("prefill", "chunk")

    def policy_name(self, moment: str) -> str:
        """The policy that chooses what a pass at `moment` keeps."""
        if moment in self.PROMPT_MOMENTS and self.prompt_policy is not None:
            return self.prompt_policy
        return self.policy.name

    @property
    def compressed(self) -> bool:
        return self.passes > 0

    def pack(self, units: Tensor, unit_lens: Tensor, packed: int, positions: Tensor) -> None:
        """Its kept entries, packed into its first `packed` slots: each head (l, h) its first
        `unit_lens[l, h]` columns of the tables `units` and `positions` [L, H_kv, K]."""
        self.packed_entries = PackedEntries.of(units, unit_lens, positions)
        self.packed = packed
        self.kept_positions = None

    @property
    def unit_lens(self) -> Tensor | None:
        """Packed: each head's entries [L, H_kv]."""
        return None if self.packed_entries is None else self.packed_entries.lens

    @property
    def units(self) -> Tensor | None:
        """Packed: its units as tables [L, H_kv, K] (K its widest head, 0 past each head's
        length), made anew on every read: the request holds them flat (`packed_entries`)."""
        return None if self.packed_entries is None else self.packed_entries.padded(self.packed_entries.units)

    def packed_positions(self) -> Tensor | None:
        """Packed: its kept entries' logical positions as tables [L, H_kv, K], as `units`."""
        return None if self.packed_entries is None else self.packed_entries.padded(self.packed_entries.positions)

    @property
    def intact(self) -> bool:
        """Whether its row holds every token it processed, in order, each in every head: what
        plain SGLang's row would hold (nothing evicted, no compressed document it started from)."""
        return self.kept_positions is None and self.offset == 0 and self.packed_entries is None

    @property
    def per_head(self) -> bool:
        return self.selection == "per-head"

    def positions(self, n: int) -> Tensor:
        """Logical positions of the n cached entries: [n], or [L, H_kv, n] once per-head."""
        kept = self.kept_positions if self.packed_entries is None else self.packed_positions()
        if kept is None:
            return torch.arange(n, dtype=torch.int64, device=self.device) + self.offset
        kept = kept[..., :n].long()  # a shared document's are int32 (`Document`)
        k = kept.shape[-1]
        tail = torch.arange(k, n, dtype=torch.int64, device=kept.device) + self.offset
        if kept.dim() > 1:
            tail = tail.expand(*kept.shape[:-1], n - k)
        return torch.cat([kept, tail], dim=-1)

    def table_width(self, n: int) -> int:
        """Columns of the request's per-head tables over its n cached entries (its widest layer's)."""
        if self.packed_entries is None:
            return n
        return self.packed_entries.width + n - self.packed

    def layer_widths(self, n: int, num_layers: int) -> tuple[int, ...]:
        """Each layer's columns of its per-head tables over its n cached entries."""
        if self.packed_entries is None:
            return (n,) * num_layers
        return tuple(w + n - self.packed for w in self.packed_entries.widths)

    def tables(self, slots: Tensor, num_layers: int, num_heads: int) -> RequestTables:
        """The request's per-head tables over its n = len(slots) cached entries (its row)."""
        n = int(slots.numel())
        width = self.table_width(n)
        layers, lens = block_tables([self], slots[None], [n], num_layers, num_heads, (width,) * num_layers)
        units, lens = torch.stack([layer[0] for layer in layers]), lens[:, 0]
        entries = self.packed_entries
        if entries is None:
            positions = self.positions(n).to(torch.int64).expand(num_layers, num_heads, n)
            return RequestTables(units=units, lens=lens, positions=positions)
        # Packed: kept positions in each head's own columns, then the tail after them.
        tail = n - self.packed
        positions = entries.padded(entries.positions.to(units.device), int(units.shape[-1]))
        cols = entries.lens.to(units.device)[..., None] + torch.arange(tail, device=units.device)
        logical = torch.arange(self.packed, n, dtype=torch.int64, device=units.device) + self.offset
        positions.scatter_(-1, cols, logical.expand(num_layers, num_heads, tail))
        return RequestTables(units=units, lens=lens, positions=positions, widths=self.layer_widths(n, num_layers))

    def logical_len(self, n: int) -> int:
        """Tokens the request has processed, for n cached entries (the newest is at n-1+offset,
        or, right after a compaction, the kept entries end at offset + k)."""
        return n + self.offset

    def effective_budget(self, n: int) -> int:
        """The budget now, for n cached entries."""
        return self.budget.at(self.logical_len(n))
