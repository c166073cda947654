"""The resident documents, one small type per kind of node (`keys.Kind`), and the chain a node
ends: flat, built once when the node is made.

- `RootDocument`: a document compressed from a request's prompt (or a chain compressed again as
  one, a rebuild): its node's slots hold its kept entries, under the root.
- `Extension`: the next turn of a conversation: its node, a child of the document it extends,
  holds the entries it chose among its own tokens; a row starting from it holds the chain's.
- `Reply`: a finished request's row, compacted while it decoded: what its passes kept.
- `Turn`: a finished turn's question and answer after a document, exact (one slot a token).

Uniform head budgets: a compressed node's k slots hold, in (layer l, KV head h), the entry of the
token at logical position `kept_positions[l, h, j]` in slot j. Variable / layer budgets (the unit
pool): its G slots are packed, head (l, h) keeping `unit_lens[l, h]` entries (at most `width`, K)
at the positions `kept_positions` lists, every head's in (layer, head, column) order, filling the
units of its slots in that order.

A chain is never walked recursively: each node holds its `lineage` (the chain's nodes, root
first, itself last; at most `--kv-document-depth` compressed ones) and its `chain_slots`, set when
it is made, and a row starting from it gets the chain's tables in one pass over the lineage
(`tables`, `carried`): O(the chain's entries), whatever its depth. A node's metadata (`compact`)
is its own entries only: an int32 per kept entry, each head's length, and, compressed by a
reconstruction (KVzip), a float32 score per kept entry: at most 8 bytes per (slot, layer, KV
head), what the KV memory reserves per pool token for documents (`adapter/memory/kv_memory.py`).
Below them, a row's layout (`RowLayout`): where a row that starts from a node holds each token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc.adapter.documents.keys import DocumentKey, Kind
from sgl_kvc.core.reconstruction import CarriedScores

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState


@dataclass(eq=False)
class Document:
    """A node the registry knows: its key, its radix node, its own slots and the node it follows.
    `lineage`, `chain_slots` and `depth` (compressed links in the chain) are set once, here."""

    key: DocumentKey
    node: Any
    slots: int
    parent: "Document | None" = field(default=None, repr=False)  # (a repr never walks the chain)
    lineage: tuple["Document", ...] = field(init=False, repr=False)
    chain_slots: int = field(init=False)
    depth: int = field(init=False)

    def __post_init__(self) -> None:
        above = self.parent
        self.lineage = (above.lineage if above is not None else ()) + (self,)
        self.chain_slots = self.slots + (above.chain_slots if above is not None else 0)
        self.depth = (above.depth if above is not None else 0) + (0 if isinstance(self, Turn) else 1)

    @property
    def exact(self) -> bool:
        """A finished turn's exact tokens (no kept entries of its own)."""
        return isinstance(self, Turn)

    @property
    def layout(self) -> RowLayout:
        """A row that starts from it: its chain's slots, standing for its D tokens."""
        return RowLayout(held=self.chain_slots, covers=self.key.tokens)

    @property
    def offset(self) -> int:
        """Tokens a request starting from it has read beyond what its row holds: D - slots."""
        return self.layout.offset

    @property
    def entries(self) -> int:
        """Entries per (layer, KV head) its own node holds (of `key.entries`, the chain's)."""
        return self.key.entries - self.key.parent_entries

    @property
    def covers(self) -> int:
        """Prompt tokens its own node stands for (after what it follows)."""
        return self.key.tokens - (self.parent.key.tokens if self.parent is not None else 0)

    @property
    def metadata_bytes(self) -> int:
        return 0

    @property
    def compressed_chain(self) -> tuple["Compressed", ...]:
        """The chain's compressed nodes a row starting from it holds, root first (a turn's are
        its document's; what follows them is exact)."""
        return tuple(d for d in self.lineage if isinstance(d, Compressed))

    def tables(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """What a request starting from it holds as its compacted state (`ReqKvState`): the
        chain's kept positions, [L, H_kv, k] (uniform) or [L, H_kv, K]; packed, its units
        [L, H_kv, K] and lengths [L, H_kv] (else None), int32, 0 past each head's length, each
        head's entries of the chain's nodes in order."""
        parts = [d.own_tables() for d in self.compressed_chain]
        if parts[0][2] is None:
            return torch.cat([p[0] for p in parts], dim=-1), None, None
        return per_head_concat([p[0] for p in parts], [p[2] for p in parts]), \
            per_head_concat([p[1] for p in parts], [p[2] for p in parts]), \
            torch.stack([p[2] for p in parts]).sum(0).to(torch.int32)

    def carried(self, device: torch.device | str | None = None) -> CarriedScores | None:
        """KVzip: the reconstruction scores of the chain's entries as a request that starts from it
        carries them (`ReqKvState.reconstructed`, in its tables' columns), or None (a node of the
        chain was not compressed by a reconstruction). The end they cover is the last node's."""
        chain = self.compressed_chain
        if any(d.scores is None for d in chain):
            return None
        device = device if device is not None else chain[-1].scores.device
        end = chain[-1].scored_to
        if chain[-1].unit_lens is None:
            scores = torch.cat([d.scores.to(device) for d in chain], dim=-1)
            return CarriedScores(end, list(scores.unbind(0)))
        wide = [d.wide_scores() for d in chain]
        lens = [d.unit_lens for d in chain]
        scores = per_head_concat(wide, lens)
        total = torch.stack([x.long() for x in lens]).sum(0)
        return CarriedScores(end, list(scores.to(device).unbind(0)), list(total.to(device).unbind(0)))

    def start(self, state: ReqKvState, device: torch.device | str | None = None) -> None:
        """`state` of a row that starts from it, nothing of its own compacted: the chain's kept
        positions (packed, its tables), the offset of what it reads next (logical positions D, D+1,
        ...) and, compressed by KVzip, the scores its entries carry. A turn's row is its
        document's, then the turn's exact tokens at their own positions."""
        anchor = self.compressed_chain[-1]
        kept, units, lens = self.tables()
        state.kept_positions = kept
        if units is not None:  # packed, as a request compacted on the unit pool is
            state.pack(units, lens, anchor.chain_slots, kept)
        state.offset = self.offset
        state.reconstructed = self.carried(device)


@dataclass(eq=False)
class Compressed(Document):
    """A node of kept entries (a root, an extension, a reply): its own metadata."""

    kept_positions: Tensor = field(default=None, repr=False)  # int32: [L, H_kv, k]; packed, [sum(unit_lens)]
    unit_lens: Tensor | None = field(default=None, repr=False)  # [L, H_kv] int32 when packed
    width: int = 0  # packed: K, the most entries a head keeps
    # KVzip: each kept entry's reconstruction score (float32, laid out as `kept_positions`) and the
    # end of the context they cover: a request that starts from it repeats only what follows
    scores: Tensor | None = field(default=None, repr=False)
    scored_to: int = 0

    @classmethod
    def compact(cls, key: DocumentKey, node: Any, kept_positions: Tensor, slots: int,
                unit_lens: Tensor | None = None, carried: CarriedScores | None = None,
                parent: Document | None = None) -> "Compressed":
        """The node of `key`'s kind from the tables of the pass that chose its own entries (int64
        [L, H_kv, k or K], and a packed one's lengths), as int32 (a position is below the context
        length) and, packed, each head's entries only: padded to the widest head, a packed
        document's tables held 3x its slots' share on SmolLM2. A packed node's units are not
        kept: they follow from its slots and lengths (`own_tables`). `carried`: the pass's
        reconstruction scores of its own kept entries, in the same columns (KVzip)."""
        kind = {Kind.ROOT: RootDocument, Kind.REBUILD: RootDocument, Kind.EXTENSION: Extension, Kind.REPLY: Reply}
        made = kind[key.kind]
        scores = None
        if carried is not None:
            width = int(kept_positions.shape[-1])
            scores = torch.stack([layer[:, :width] for layer in carried.layers]).to(torch.float32)
        scored_to = carried.end if carried is not None else 0
        if unit_lens is None:
            return made(key=key, node=node, slots=slots, parent=parent, kept_positions=kept_positions.to(torch.int32),
                        scores=scores, scored_to=scored_to)
        width = int(kept_positions.shape[-1])
        valid = torch.arange(width, device=kept_positions.device) < unit_lens[..., None]
        return made(key=key, node=node, slots=slots, parent=parent, kept_positions=kept_positions[valid].to(torch.int32),
                    unit_lens=unit_lens.to(torch.int32), width=width,
                    scores=None if scores is None else scores.to(valid.device)[valid], scored_to=scored_to)

    @property
    def metadata_bytes(self) -> int:
        tensors = (self.kept_positions, self.unit_lens, self.scores)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def own_tables(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Its own node's kept positions (uniform [L, H_kv, k]); packed, [L, H_kv, K] with 0 past
        each head's length, its units (entry e of the (layer, head, column) order in unit e of its
        slots, `core/moves.unit_moves`) and lengths; int32."""
        if self.unit_lens is None:
            return self.kept_positions, None, None
        rel, units = packed_units(self.node.value, self.unit_lens, self.width)
        valid = rel >= 0
        # int32: a unit pool of 2^31 units would hold 512 GB of K and V at head_dim 64 (256 GB in
        # FP8), on one device (variable budgets run without tensor parallelism)
        return self.kept_positions[rel.clamp(min=0)] * valid, units.to(torch.int32), self.unit_lens

    def wide_scores(self) -> Tensor:
        """Packed: its own scores [L, H_kv, K], 0 past each head's length."""
        lens = self.unit_lens.long()
        valid = torch.arange(self.width, device=lens.device) < lens[..., None]
        wide = torch.zeros(valid.shape, dtype=torch.float32, device=lens.device)
        wide[valid] = self.scores.to(lens.device)
        return wide


@dataclass(eq=False)
class RootDocument(Compressed):
    """A document compressed from a request's prompt, or a chain compressed again (a rebuild)."""


@dataclass(eq=False)
class Extension(Compressed):
    """A conversation's next document: the chain's entries, then its own (this node's)."""


@dataclass(eq=False)
class Reply(Compressed):
    """A finished request's compacted row, kept as a document over the tokens it covers."""


@dataclass(eq=False)
class Turn(Document):
    """A finished turn's question and answer, exact, after the document its request compressed."""


def per_head_concat(parts: list[Tensor], lens: list[Tensor]) -> Tensor:
    """Per (layer, head) tables [L, H, *] of several nodes, one after another: each head's first
    `lens[i]` columns of `parts[i]` in order, 0 after; one scatter per node (O(their entries))."""
    counts = [x.long() for x in lens]
    total = torch.stack(counts).sum(0)
    width = int(total.max()) if total.numel() else 0
    device = parts[0].device
    out = torch.zeros(*total.shape, width + 1, dtype=parts[0].dtype, device=device)  # + a spare column
    start = torch.zeros_like(total, device=device)
    for part, n in zip(parts, counts):
        n = n.to(device)
        cols = torch.arange(part.shape[-1], device=device)
        valid = cols < n[..., None]
        dst = torch.where(valid, start[..., None] + cols, width)
        out.scatter_(-1, dst, part.to(device=device, dtype=out.dtype))
        start = start + n
    return out[..., :width].contiguous()


def packed_units(slots: Tensor, unit_lens: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Where a packed document of `slots` whose heads keep `unit_lens` [L, H_kv] entries has them:
    entry e of the (layer, head, column) order in unit e of its slots, slot e // (L x H_kv) first
    (`core/moves.unit_moves` packs so). Returns each (layer, head, column)'s entry number e
    ([L, H_kv, width], -1 past its head's length) and unit (int64, 0 there)."""
    lens = unit_lens.long()
    layers, heads = lens.shape
    cols = torch.arange(width, device=lens.device)
    valid = cols < lens[..., None]
    flat = lens.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(layers, heads)
    rel = torch.where(valid, starts[..., None] + cols, 0)
    per_slot = layers * heads
    slots = slots.to(device=lens.device, dtype=torch.int64)
    units = (slots[(rel // per_slot).clamp(max=max(len(slots) - 1, 0))] * per_slot + rel % per_slot) * valid
    return torch.where(valid, rel, -1), units


def compact_bytes(entries: int, heads: int, packed: bool, scored: bool = False) -> int:
    """What `Compressed.compact` keeps of a node of `entries` kept entries in all over its `heads`
    (layer, KV head) pairs: an int32 each (and its float32 score, `scored`: KVzip), and packed,
    each head's int32 length."""
    return (8 if scored else 4) * entries + (4 * heads if packed else 0)


# Where a row's slots stand in its request's sequence, the one place for the arithmetic between
# physical indices (slots) and logical positions (tokens). A row that starts from a document holds
# first the chain's `held` slots, standing for the first `covers` tokens, then one slot per token:
# the token t >= covers is in slot t - offset, offset = covers - held. SGLang knows nothing of it:
# the request's fill ids are shifted by the offset (`adapter/scheduling/requests.shifted_fill_ids`),
# and `fill_skip` reads the offset back from SGLang's own fields, alike on every rank.


@dataclass(frozen=True)
class RowLayout:
    """A row that starts with `held` slots standing for the first `covers` tokens, then one slot a
    token (0, 0: a row of its own tokens only)."""

    held: int = 0
    covers: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.held <= self.covers:
            raise ValueError(f"a row's first {self.held} slots cannot stand for {self.covers} tokens")

    @property
    def offset(self) -> int:
        """Logical minus physical position of every token after the held slots."""
        return self.covers - self.held

    def slot(self, token: int) -> int:
        """The row index of the token at logical position `token` (at least `covers`)."""
        if token < self.covers:
            raise ValueError(f"token {token} is among the {self.covers} the held slots stand for")
        return token - self.offset

    def tokens(self, slots: int) -> int:
        """Tokens a row of `slots` slots (at least the held ones) has read."""
        if slots < self.held:
            raise ValueError(f"a row of {slots} slots is shorter than its {self.held} held ones")
        return slots + self.offset

    def span(self, first: int, end: int) -> tuple[int, int]:
        """The row's slots [a, b) of the tokens [first, end), every one after the held ones."""
        return self.slot(first), self.slot(end)


def fill_skip(req: Any) -> int:
    """Tokens SGLang's fill ids of `req` start after: what its row does not hold of what it read
    (a hit's offset, or, compacted between chunks, its own)."""
    return len(req.origin_input_ids) + len(req.output_ids) - len(req.full_untruncated_fill_ids)


def prompt_read(req: Any) -> int:
    """Tokens of `req`'s prompt it has read: its matched prefix's slots, and what they stand for
    beyond themselves (`fill_skip`)."""
    return fill_skip(req) + int(req.prefix_len)
