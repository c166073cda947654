"""A document chain's links and keys without a tree: a row's arithmetic (`RowLayout`), the flat
chain a node ends (`links.py`: never walked recursively, whatever its depth), its per-head
concatenation, what a key digests (`keys.py`), and which resident document a request's own
extends (`matching.extendable`): never another tenant's reply."""

from __future__ import annotations

import random
import sys
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents import (
    Compressed, Document, DocumentKey, DocumentRegistry, Extension, ExtensionRule, Kind, Reply, RootDocument,
    RowLayout, Turn, packed_units,
)
from sgl_kvc.adapter.documents.keys import extension_key, reply_key, tokens_content, turn_key
from sgl_kvc.adapter.documents.plan import settings_digest
from sgl_kvc.adapter.documents.links import per_head_concat
from sgl_kvc.adapter.documents.matching import extendable, resident_turn
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import CarriedScores
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY

KVZIP = KvcConfig(policy="snapkv", prompt_policy="kvzip")
LAYERS, HEADS = 2, 2
PER_SLOT = LAYERS * HEADS  # units a packed slot holds
SPAN = 4  # tokens each link of a test chain covers: it keeps fewer slots, so its layout is valid
FAMILY = "f" * 64


# --- a row's arithmetic -------------------------------------------------------------------------

def test_a_row_layouts_offset_slots_and_tokens() -> None:
    row = RowLayout(held=30, covers=100)
    assert row.offset == 70 and row.slot(100) == 30 and row.slot(105) == 35
    assert row.tokens(30) == 100 and row.tokens(42) == 112 and row.span(100, 110) == (30, 40)
    plain = RowLayout()  # a row of its own tokens only: slot and token coincide
    assert plain.offset == 0 and plain.slot(0) == 0 and plain.tokens(7) == 7 and RowLayout(5, 5).offset == 0


def test_a_row_layouts_refusals() -> None:
    for held, covers in ((31, 30), (-1, 5), (1, 0)):  # more held slots than the tokens they stand for
        with pytest.raises(ValueError, match="cannot stand for"):
            RowLayout(held=held, covers=covers)
    row = RowLayout(held=30, covers=100)
    for inside in (lambda: row.slot(0), lambda: row.slot(99), lambda: row.span(99, 110)):  # a document's token
        with pytest.raises(ValueError, match="among the 100"):
            inside()
    with pytest.raises(ValueError, match="shorter than its 30"):
        row.tokens(29)


@settings(deadline=None)
@given(held=st.integers(0, 10_000), extra=st.integers(0, 10_000), after=st.integers(0, 10_000))
def test_a_tokens_slot_reads_back_as_that_token(held: int, extra: int, after: int) -> None:
    row = RowLayout(held=held, covers=held + extra)
    token = row.covers + after
    assert row.tokens(row.slot(token)) == token and row.slot(token) >= row.held
    assert row.span(token, token + 3) == (row.slot(token), row.slot(token) + 3)


# --- a chain, flat whatever its depth ----------------------------------------------------------

@contextmanager
def _shallow_stack(limit: int = 200) -> Iterator[None]:
    """Any recursion over a chain of hundreds of links fails under it; pytest's stack fits."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


@dataclass
class _Made:
    """What one link was made from, as lists: the reference reads these, never the link."""

    kept: list  # [L][H][n]: each head's kept positions
    lens: list  # [L][H]: n, the entries each head keeps (all the link's width, uniform)
    scores: list  # [L][H][n]: their KVzip scores
    slots: list  # its node's slots


_DTYPES = {"i": torch.int32, "q": torch.int64, "f": torch.float32}


def _tensor(flat: list, code: str, *shape: int) -> torch.Tensor:
    """A flat list as one tensor of `shape`, through an `array`: `DeviceGuard` walks every element
    of a list `torch.tensor` gets."""
    return torch.frombuffer(array(code, flat), dtype=_DTYPES[code]).clone().reshape(shape or (-1,))


def _chain(depth: int, packed: bool, seed: int = 0) -> tuple[list[Compressed], list[_Made]]:
    """A root, then `depth - 1` extensions, each over the next SPAN tokens and keeping 1..3
    entries a head (packed: heads keeping none among them), made directly (as
    `Compressed.compact` lays them out) on stand-in nodes holding their slots. Their tensors are
    views of a few made at once: the unit tests' `DeviceGuard` costs every torch call."""
    rng = random.Random(seed)
    made: list[_Made] = []
    widths: list[int] = []
    next_slot = 1000  # the slots of its links' nodes, one after another
    for i in range(depth):
        width = rng.randint(1, SPAN - 1)
        lens = [[rng.randint(0, width) if packed else width for _ in range(HEADS)] for _ in range(LAYERS)]
        lens[0][0] = width  # K, its widest head
        kept = [[[rng.randrange(SPAN * i, SPAN * (i + 1)) for _ in range(n)] for n in row] for row in lens]
        scores = [[[rng.random() for _ in range(n)] for n in row] for row in lens]
        slots = -(-sum(map(sum, lens)) // PER_SLOT) if packed else width
        made.append(_Made(kept, lens, scores, list(range(next_slot, next_slot + slots))))
        widths.append(width)
        next_slot += slots
    values = torch.arange(1000, next_slot).split([len(m.slots) for m in made])
    if packed:  # each head's entries only, in (layer, head, column) order, and the lengths
        totals = [sum(map(sum, m.lens)) for m in made]
        kept_parts = _tensor([x for m in made for row in m.kept for head in row for x in head], "i").split(totals)
        score_parts = _tensor([x for m in made for row in m.scores for head in row for x in head], "f").split(totals)
        lens_flat = [x for m in made for row in m.lens for x in row]
        lens_parts: tuple = _tensor(lens_flat, "i", depth, LAYERS, HEADS).unbind(0)
    else:  # [L, H, k]
        heads = [(layer, h) for layer in range(LAYERS) for h in range(HEADS)]
        kept_parts = _tensor([x for layer, h in heads for m in made for x in m.kept[layer][h]], "i",
                             LAYERS, HEADS, -1).split(widths, dim=-1)
        score_parts = _tensor([x for layer, h in heads for m in made for x in m.scores[layer][h]], "f",
                              LAYERS, HEADS, -1).split(widths, dim=-1)
        lens_parts = (None,) * depth
    links: list[Compressed] = []
    parent = None
    for i, m in enumerate(made):
        above = parent.key if parent is not None else None
        key = DocumentKey(digest=f"{i:064x}", tokens=SPAN * (i + 1),
                          entries=(above.entries if above else 0) + len(m.slots), policy="kvzip",
                          kind=Kind.EXTENSION if above else Kind.ROOT,
                          parent=above.digest if above else "", parent_entries=above.entries if above else 0)
        cls = Extension if above else RootDocument
        parent = cls(key=key, node=SimpleNamespace(value=values[i]), slots=len(m.slots), parent=parent,
                     kept_positions=kept_parts[i], unit_lens=lens_parts[i], width=widths[i] if packed else 0,
                     scores=score_parts[i], scored_to=key.tokens)
        links.append(parent)
    return links, made


def _reference(made: list[_Made], packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each (layer, head)'s kept positions, units and scores of every link in lineage order, then
    0 (the tables' padding), and each head's total: the plain concatenation `tables` must equal."""
    kept, units, scores = ([[[] for _ in range(HEADS)] for _ in range(LAYERS)] for _ in range(3))
    for m in made:
        e = 0  # a packed link's entries fill its slots' units in (layer, head, column) order
        for layer in range(LAYERS):
            for h in range(HEADS):
                kept[layer][h] += m.kept[layer][h]
                scores[layer][h] += m.scores[layer][h]
                for _ in range(m.lens[layer][h]):
                    units[layer][h].append(m.slots[e // PER_SLOT] * PER_SLOT + e % PER_SLOT)
                    e += 1
    lens = torch.tensor([[len(kept[layer][h]) for h in range(HEADS)] for layer in range(LAYERS)])
    width = int(lens.max())

    def padded(rows: list, code: str) -> torch.Tensor:
        flat = [x for layer in rows for r in layer for x in r + [0] * (width - len(r))]
        return _tensor(flat, code, LAYERS, HEADS, width)

    return padded(kept, "q"), padded(units, "q"), padded(scores, "f"), lens


@pytest.mark.parametrize("depth, packed", [(5000, False), (200, True)], ids=["uniform", "packed"])
def test_a_deep_chain_is_flat_and_its_tables_are_every_links_in_order(depth: int, packed: bool) -> None:
    """Every link's lineage, slots and depth are set when it is made, and a row starting from the
    deepest gets the chain's tables, scores and offset in one pass: nothing recurses over the
    links (the stack limit would fail it), and each head's entries are every link's, root first."""
    with _shallow_stack():
        links, made = _chain(depth, packed)
        deep = links[-1]
        kept, units, lens = deep.tables()
        carried = deep.carried()
        state = ReqKvState(policy=SimpleNamespace(name="rkv"), budget=Budget(16))
        deep.start(state)
        turn = Turn(key=turn_key(deep.key, list(range(deep.key.tokens + 5))), node=SimpleNamespace(), slots=5,
                    parent=deep)
        # (packed, the same chain: `compressed_chain` below; each packed pass costs ~0.5 s here)
        turn_kept = turn.tables()[0] if not packed else kept
    assert isinstance(links[0], RootDocument) and all(type(d) is Extension for d in links[1:])
    assert len(deep.lineage) == depth and all(a is b for a, b in zip(deep.lineage, links))  # root first
    assert deep.depth == depth and deep.chain_slots == sum(len(m.slots) for m in made)
    assert [d.chain_slots for d in links] == list(accumulate(len(m.slots) for m in made))
    assert [d.depth for d in links[:3]] == [1, 2, 3] and links[0].parent is None
    # a finished turn after it: one more link and its slots, no compressed one; its row's
    # compressed part is its document's
    assert turn.lineage[-1] is turn and turn.lineage[:-1] == deep.lineage and turn.depth == depth
    assert turn.chain_slots == deep.chain_slots + 5 and turn.compressed_chain == deep.compressed_chain
    assert torch.equal(turn_kept, kept) and turn.offset == deep.offset
    ref_kept, ref_units, ref_scores, ref_lens = _reference(made, packed)
    assert torch.equal(kept.long(), ref_kept) and kept.dtype == torch.int32
    assert carried.end == deep.key.tokens
    assert all(torch.equal(carried.layers[layer], ref_scores[layer]) for layer in range(LAYERS))
    if packed:  # its entries flat (`PackedEntries`), as wide as its widest head
        width = int(lens.max())
        assert state.kept_positions is None and torch.equal(state.packed_positions(), kept[..., :width].long())
        assert not bool(kept[..., width:].any())
    else:
        assert torch.equal(state.kept_positions, kept)
    assert state.offset == deep.key.tokens - deep.chain_slots
    assert state.reconstructed.end == carried.end
    if packed:
        assert torch.equal(units.long(), ref_units) and torch.equal(lens.long(), ref_lens)
        assert all(torch.equal(carried.lengths[layer], ref_lens[layer]) for layer in range(LAYERS))
        assert torch.equal(state.units, units[..., : int(lens.max())].long()) and state.packed == deep.chain_slots
    else:
        assert units is None and lens is None and carried.lengths is None and state.units is None


# --- per-head concatenation and packed units ---------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), layers=st.integers(1, 3), heads=st.integers(1, 3), parts=st.integers(1, 4),
       uniform=st.booleans())
def test_per_head_concat_is_each_heads_entries_one_part_after_another(seed: int, layers: int, heads: int,
                                                                      parts: int, uniform: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    widths = torch.randint(0, 5, (parts,), generator=g).tolist()  # a part may be empty
    tables = [torch.randint(1, 1 << 20, (layers, heads, w), generator=g) for w in widths]
    if uniform:
        lens = [torch.full((layers, heads), w) for w in widths]
    else:  # zero-length heads among them
        lens = [torch.randint(0, w + 1, (layers, heads), generator=g) for w in widths]
    out = per_head_concat(tables, [x.int() for x in lens])
    rows = [[sum((t[layer, h, : int(n[layer, h])].tolist() for t, n in zip(tables, lens)), [])
             for h in range(heads)] for layer in range(layers)]
    width = max(len(r) for layer in rows for r in layer)
    assert out.shape == (layers, heads, width) and out.dtype == tables[0].dtype
    assert out.tolist() == [[r + [0] * (width - len(r)) for r in layer] for layer in rows]
    if uniform:
        assert torch.equal(out, torch.cat(tables, dim=-1))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), layers=st.integers(1, 3), heads=st.integers(1, 3), width=st.integers(1, 6))
def test_packed_units_fill_each_slots_units_in_layer_head_column_order(seed: int, layers: int, heads: int,
                                                                      width: int) -> None:
    g = torch.Generator().manual_seed(seed)  # a node keeps one entry at least (every head 0: never made)
    lens = torch.randint(0, width + 1, (layers, heads), generator=g)
    lens.view(-1)[int(torch.randint(0, layers * heads, (1,), generator=g))] = width  # K; others may keep 0
    per_slot = layers * heads
    slots = torch.randperm(1000, generator=g)[: -(-int(lens.sum()) // per_slot)]
    rel, units = packed_units(slots, lens.int(), width)
    want_rel, e = torch.full((layers, heads, width), -1), 0
    want_units = torch.zeros(layers, heads, width, dtype=torch.int64)
    for layer in range(layers):
        for h in range(heads):
            for c in range(int(lens[layer, h])):
                want_rel[layer, h, c] = e
                want_units[layer, h, c] = int(slots[e // per_slot]) * per_slot + e % per_slot
                e += 1
    assert torch.equal(rel, want_rel) and torch.equal(units, want_units)
    assert len(set(units[rel >= 0].tolist())) == e  # no unit holds two entries


# --- keys ----------------------------------------------------------------------------------------

def _tenant(budget: int) -> SimpleNamespace:
    """A request whose decode budget is `budget` (its `settings_digest` differs by it)."""
    return SimpleNamespace(origin_input_ids=list(range(200)), extra_key=None, cache_salt=None,
                           sampling_params=SimpleNamespace(custom_params={CUSTOM_PARAMS_KEY: {"budget": budget}}))


def _key(prompt: list[int], tokens: int, entries: int = 0) -> DocumentKey:
    """A root document's key over `prompt[:tokens]`, in FAMILY (as `request_key` makes its content)."""
    return DocumentKey(digest=f"{tokens:064x}", tokens=tokens, entries=entries, policy="kvzip",
                       family=FAMILY, content=tokens_content(prompt[:tokens], FAMILY))


def test_a_replys_digest_is_its_tokens_entries_settings_and_start() -> None:
    prompt = list(range(10, 200))
    declared = _key(prompt, 100, 30)
    one, many = settings_digest(_tenant(1), KVZIP), settings_digest(_tenant(64), KVZIP)
    assert one != many and settings_digest(_tenant(1), KVZIP) == one
    start = "5" * 64
    base = reply_key(declared, prompt[:155], 40, one, start)
    assert reply_key(declared, list(prompt[:155]), 40, one, start) == base  # deterministic
    assert (base.kind, base.settings, base.tokens, base.entries, base.parent) == (Kind.REPLY, one, 155, 40, "")
    others = {"entries": reply_key(declared, prompt[:155], 41, one, start),
              "settings": reply_key(declared, prompt[:155], 40, many, start),
              "start": reply_key(declared, prompt[:155], 40, one, ""),
              "tokens": reply_key(declared, prompt[:154] + [7], 40, one, start)}
    for what, other in others.items():
        assert other.digest != base.digest, what


def test_an_extension_and_a_rebuild_of_the_same_tokens_differ_and_a_turn_follows_its_document() -> None:
    prompt = list(range(10, 200))
    parent, own = _key(prompt, 100, 30), _key(prompt, 140)
    ext, rebuilt = extension_key(own, parent, prompt, 13), extension_key(own, parent, prompt, 13, rebuilds=True)
    assert ext.digest != rebuilt.digest and ext == extension_key(own, parent, prompt, 13)
    assert (ext.kind, ext.entries, ext.parent_entries, ext.parent) == (Kind.EXTENSION, 43, 30, parent.digest)
    assert (rebuilt.kind, rebuilt.entries, rebuilt.parent_entries) == (Kind.REBUILD, 13, 0)
    assert extension_key(own, parent, prompt[:120] + [1] * 70, 13).digest != ext.digest  # other own tokens

    turn = turn_key(parent, prompt[:130])
    assert (turn.kind, turn.parent, turn.tokens, turn.entries, turn.parent_entries) == \
        (Kind.TURN, parent.digest, 130, 60, 30)
    registry = DocumentRegistry()
    doc = _resident(registry, RootDocument, parent)
    after = Turn(key=turn, node=SimpleNamespace(), slots=30, parent=doc)
    registry.add(after)
    assert registry.turns_after[parent.digest] == {turn.content: {turn.digest: after}} and after.covers == 30
    assert registry.turn_lengths[parent.digest] == {130: 1}
    assert resident_turn(registry, SimpleNamespace(origin_input_ids=prompt), doc, own) is after
    other = SimpleNamespace(origin_input_ids=prompt[:120] + [1] * 70)  # another answer: not that turn
    assert resident_turn(registry, other, doc, own) is None


# --- which resident document a request's own extends --------------------------------------------

def _resident(registry: DocumentRegistry, cls: type[Document], key: DocumentKey,
              parent: Document | None = None) -> Document:
    """`key`'s document added to `registry` as a publication adds it (its node a stand-in)."""
    own = key.entries - key.parent_entries
    doc = cls(key=key, node=SimpleNamespace(), slots=own, parent=parent,
              kept_positions=torch.zeros(LAYERS, HEADS, own, dtype=torch.int32))
    registry.add(doc)
    return doc


def _asking(prompt: list[int], rule: ExtensionRule) -> SimpleNamespace:
    req = SimpleNamespace(origin_input_ids=prompt)
    kvc_req.of(req).rule = rule
    return req


@pytest.mark.parametrize("depth, rebuilt", [(1, True), (3, True), (4, False), (16, False)])
def test_a_chain_at_its_depth_is_compressed_again_not_extended(depth: int, rebuilt: bool) -> None:
    """A chain of 3 compressed links over 40, 60, 80 tokens: a request whose document is 100 tokens
    extends the deepest, unless the chain is at `--kv-document-depth`: then it compresses it again."""
    prompt = list(range(1000, 1200))
    registry = DocumentRegistry()
    doc = _resident(registry, RootDocument, _key(prompt, 40, 12))
    for tokens in (60, 80):
        doc = _resident(registry, Extension, extension_key(_key(prompt, tokens), doc.key, prompt, 6), doc)
    assert doc.depth == 3 and doc.key.entries == 24
    rule = ExtensionRule(ratio=0.3, budget=None, floor=4, limit=None, depth=depth)
    found = extendable(registry, _asking(prompt, rule), _key(prompt, 100))
    assert found is not None and found[0] is doc and found[2] is rebuilt
    assert found[1] == (rule.recompress(24, 100, 20) if rebuilt else rule.entries(24, 80, 20)) == (30 if rebuilt else 20)


def _reply_registry(prompt: list[int], settings: str) -> tuple[DocumentRegistry, Document, Document]:
    """A shared root over 40 tokens, and a reply over 80 compressed by decode settings `settings`."""
    registry = DocumentRegistry()
    root = _resident(registry, RootDocument, _key(prompt, 40, 12))
    reply = _resident(registry, Reply, reply_key(_key(prompt, 40), prompt[:80], 20, settings, root.key.digest))
    return registry, root, reply


def test_a_reply_is_extended_only_by_a_request_of_its_own_decode_settings() -> None:
    """Tenant A (a budget of 1) left a reply over 80 tokens: its next turn compresses it again; a
    request of tenant B (a budget of 64), the same document, never starts from it, but from the
    shared root, whatever else it asks."""
    prompt = list(range(1000, 1200))
    a, b = settings_digest(_tenant(1), KVZIP), settings_digest(_tenant(64), KVZIP)
    registry, root, reply = _reply_registry(prompt, a)
    mine = ExtensionRule(ratio=0.3, budget=None, floor=4, limit=None, settings=a)
    found = extendable(registry, _asking(prompt, mine), _key(prompt, 100))
    assert found is not None and found[0] is reply and found[2] is True
    for settings_ in (b, ""):  # another tenant's, or none: extending, or at its depth, never the reply
        for rule in (ExtensionRule(0.3, None, 4, None, settings=settings_),
                     ExtensionRule(None, 60, 4, None, depth=1, settings=settings_)):
            found = extendable(registry, _asking(prompt, rule), _key(prompt, 100))
            assert found is not None and found[0] is root, (settings_, rule)


def test_a_rebuild_of_another_tenants_reply_is_not_extended() -> None:
    """Tenant A's next turn (100 tokens) compressed its reply again (a rebuild: chosen among the
    reply's entries, which A's budget of 1 decided, and its extension), published under the root
    as `turns._insert` does. Tenant B's later turn (120 tokens) must not start from it:
    it would keep what A's reply kept: the rebuild's key (`extension_key(..., rebuilds=True)`)
    inherits the reply's `settings`, which `extendable` checks for every kind of document."""
    prompt = list(range(1000, 1200))
    a, b = settings_digest(_tenant(1), KVZIP), settings_digest(_tenant(64), KVZIP)
    registry, root, reply = _reply_registry(prompt, a)
    a_rule = ExtensionRule(ratio=0.3, budget=None, floor=4, limit=None, settings=a)
    parent, entries, rebuilds = extendable(registry, _asking(prompt, a_rule), _key(prompt, 100))
    assert parent is reply and rebuilds
    rebuilt = _resident(registry, RootDocument, extension_key(_key(prompt, 100), reply.key, prompt, entries, True))
    assert rebuilt.key.settings == a
    b_rule = ExtensionRule(ratio=0.3, budget=None, floor=4, limit=None, settings=b)
    found = extendable(registry, _asking(prompt, b_rule), _key(prompt, 120))
    assert found is not None and found[0] is not rebuilt and found[0] is root
