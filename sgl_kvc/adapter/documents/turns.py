"""A conversation's turns (docs/architecture.md, "Shared documents", conversations): what a turn's
request publishes, the extension of the document it started from (`due`, `publish`), and what it
leaves when it finishes, its question and answer exact (a `Turn`: `turn_candidate`) or its row
compacted as it decoded (a `Reply` and a turn: `reply_candidate`).

**The extension.** A request that started from a resident document its own extends holds, right
after the forward that read its extension (before SGLang processes the result, and before any
pass of its own), the parent's entries (the chain's slots, tree-owned) then its extension's exact
entries. A pass over those, by the document's question-free prompt policy, keeps every entry of
the parent (the chain above is shared, never chosen again) and chooses the extension's own entries
among its tokens, scored in the context of what the parent kept (KVzip repeats only the extension,
resuming from the scores the parent carries). The chosen entries are copied into fresh slots, a
child node of the parent's. The request's row is only read: whatever fails here loses the
extension only. A chain compressed again (`Kind.REBUILD`: at its budget or depth, or after a
reply) keeps its budget among all of them, into a document of its own under the root. As every
publication, voted before anything is evicted or inserted (`document_pass.copy_and_publish`).

**A turn.** A finished request (its answer ended at a stop token or its length) whose row holds,
after its document's entries, its question and answer exact (the tokens [D, L), L: all but the
last output token, never read) gives those slots to the tree instead of the pool
(`radix_cache.keep`, from SGLang's `release_kv_cache`): a node after the document's, keyed by its
tokens, evicted as any leaf. Nothing is copied. The next turn's prompt resends the conversation,
which begins with those L tokens where the template renders the answer as it was generated: it
starts from the document and that turn (`matching.resident_turn`), reads only what follows, and
compresses [D, D') as its extension. Once it kept a turn of its own, the turn it started from is
dropped where nothing else holds it (`superseded`): a conversation keeps one turn exact. A row
compacted since it started, or whose tokens after the document are partly the tree's, keeps no
turn.

**A reply.** A row R-KV (any decode policy) compacted while it decoded holds, in its first k
slots, what its last pass kept of [0, D) (D = k + its offset), then [D, L) exact: at release the
first become a compressed document of their own under the root (a `Reply`), the rest a turn after
it. The next turn compresses [0, D') again query-agnostically (`ExtensionRule.recompress`): the
reply's entries were chosen for its own question. Its key holds everything that decides what it
holds (its tokens, entries, decode settings and the node its row started from,
`keys.reply_key`); a request starts from it only where its own decode settings are the same
(`matching.extendable`), so that a client's budget of 1 decides nothing for other requests. Only
rows the tree can read as a document publish: per-head kept positions, and a packed row only
where its units are those a document of its slots and lengths names (`Document.tables`).

Everything here follows from SGLang's fields, the request's state and the registry, alike on every
tensor-parallel rank, and each publication is voted across ranks before it acts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc import req_state
from sgl_kvc.adapter.documents.document_pass import Chosen, Host, Ready, copy_and_publish, trace_document
from sgl_kvc.adapter.documents.keys import DocumentKey, Kind, reply_key, turn_key
from sgl_kvc.adapter.documents.links import Compressed, Document, Turn, compact_bytes, packed_units
from sgl_kvc.adapter.documents.plan import declared, extends, extension_due, extension_lost, may_reply, plan_of
from sgl_kvc.adapter.documents.registry import DocumentRegistry, insert_child, insert_document, node_path, registry_of
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.core.passes import StepWork, advance, start_pass
from sgl_kvc.core.reconstruction import CarriedScores, carry_scores
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.policies import HeadSelection

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch


def due(compressor: Host, batch: ScheduleBatch) -> list[tuple[int, DocumentKey]]:
    """The requests of `batch` whose row holds their extension exact now (`extension_due`), the
    first in the batch of each extension not resident. One whose row was compacted before its
    extension was read will not publish it: requests waiting for it go."""
    registry = registry_of(getattr(batch, "tree_cache", None))
    if registry is None:
        return []
    out, seen = [], set()
    for i, req in enumerate(batch.reqs):
        if req.finished() or extends(req) is None:
            continue
        key = declared(req)
        if extension_due(req, int(batch.seq_lens_cpu[i])) is None:
            if extension_lost(req):
                registry.settle(key, req)
            continue
        if key.digest in seen or registry.get(key) is not None:
            continue
        seen.add(key.digest)
        out.append((i, key))
    return out


def publish(compressor: Host, batch: ScheduleBatch, items: list[tuple[int, DocumentKey]]) -> None:
    """Choose, copy and publish each item's extension; a failure (anywhere in it, on any rank)
    loses that extension only."""
    if not items:
        return
    copy_and_publish(compressor, batch, items,
                     lambda i, key: _chain_state(compressor, key, _parent(batch, i)),
                     lambda i, key: _row_entries(key, _parent(batch, i)),
                     lambda i, key, state: _choose(compressor, batch, i, key, _parent(batch, i), state),
                     lambda r: _insert(compressor, batch, r))


def _parent(batch: ScheduleBatch, i: int) -> Document:
    parent = extends(batch.reqs[i])
    if parent is None:
        raise RuntimeError("it extends no resident document")
    return parent


def _row_entries(key: DocumentKey, parent: Document) -> int:
    """The row's entries the extension's pass reads: the chain's slots, then its own tokens."""
    return parent.chain_slots + key.tokens - parent.key.tokens


def _chain_state(compressor: Host, key: DocumentKey, parent: Document) -> ReqKvState:
    """The extension's pass state: a row that starts from `parent`, as a request's that started
    from it (`Compressor._begin` for a hit), with nothing of its own compacted."""
    store = compressor.store
    state = ReqKvState(policy=compressor.policy(key.policy, key.entries), budget=Budget(key.entries),
                       selection="per-head", device=store.device)
    parent.start(state, store.device)
    return state


def _choose(compressor: Host, batch: ScheduleBatch, i: int, key: DocumentKey, parent: Document,
            state: ReqKvState) -> Chosen:
    """The extension's pass: its own kept entries (nothing copied)."""
    store = compressor.store
    req = batch.reqs[i]
    row = req.kv.req_pool_idx
    failpoints.check("document_raise", req)
    n = _row_entries(key, parent)
    # a rebuild holds none of the chain's entries: it chooses among them all
    held = 0 if key.kind is Kind.REBUILD else parent.chain_slots
    own = key.entries - key.parent_entries
    slots = store.req_to_token[row, :n].to(torch.int64)
    if not torch.equal(slots[:parent.chain_slots].cpu(), node_path(parent.node)[1].cpu()):
        raise RuntimeError("its row does not start with the slots of the document it extends")
    packed = store.unit_layout is not None
    tables = state.tables(slots, *store.unit_layout) if packed else None
    # uniform: every head keeps the chain's `held` entries and `own` of its own; packed, each head
    # its chain's entries, and the request `own` per head of its own, by the policy's allocation
    state.pending = start_pass(store, row, state, state.policy, n, own if packed else held + own, "prefill",
                               tables, held=held)
    scores = state.pending.reconstruction
    due_pass = advance(store, row, state, n, StepWork.unlimited(), compressor.config.kv_head_budget, i)
    if due_pass is None:
        raise RuntimeError("an unlimited extension pass did not finish")
    selection = due_pass.selection
    device = selection.indices.device
    if packed:
        held_lens = state.unit_lens.long().to(device) * (held > 0)
    else:
        held_lens = torch.full_like(selection.lengths, held)
    mine, cols = _own(selection, held_lens)
    carried = None
    if scores is not None:
        chain = carry_scores(scores, selection, per_head_lengths=packed)
        at = chain.layers[0].device
        lengths = [m.to(at) for m in mine.lengths.unbind(0)] if packed else None
        carried = CarriedScores(chain.end, [s.gather(1, c.to(at)) for s, c in zip(chain.layers, cols)], lengths)
    positions = due_pass.kept_positions
    positions = positions.gather(-1, cols.to(positions.device)) * mine.valid().to(positions.device)
    metadata = compact_bytes(mine.total, int(mine.lengths.numel()), packed, carried is not None)
    return Chosen(i, key, slots, mine, due_pass.units, positions, carried, metadata,
                  unit_lens=mine.lengths if packed else None, parent=parent)


def _own_columns(selection: HeadSelection, held_lens: Tensor) -> Tensor:
    """Where each head's own entries are in `selection`'s columns: after its held ones."""
    width = int((selection.lengths - held_lens).max()) if selection.lengths.numel() else 0
    cols = held_lens[..., None] + torch.arange(width, device=held_lens.device)
    return cols.clamp(max=max(selection.max_keep - 1, 0))


def _own(selection: HeadSelection, held_lens: Tensor) -> tuple[HeadSelection, Tensor]:
    """The entries `selection` keeps after each head's first `held_lens`, which it must keep
    (the chain's: a pass that held them keeps them first, in order), and their columns in
    `selection` (`_own_columns`)."""
    cols = torch.arange(selection.max_keep, device=held_lens.device)
    first = cols < held_lens[..., None]
    if not bool(((selection.indices == cols) | ~first).all()) or bool((selection.lengths < held_lens).any()):
        raise RuntimeError("the extension's pass did not keep the entries of the document it extends")
    lengths = selection.lengths - held_lens
    cols = _own_columns(selection, held_lens)
    own = selection.indices.gather(-1, cols)
    valid = torch.arange(own.shape[-1], device=own.device) < lengths[..., None]
    return HeadSelection(indices=torch.where(valid, own, HeadSelection.PAD), lengths=lengths, n=selection.n), cols


def _insert(compressor: Host, batch: ScheduleBatch, r: Ready) -> None:
    """The extension's node: a child of its parent's (`registry.insert_child`); a rebuild's, a
    document of its own under the root (`insert_document`)."""
    c = r.chosen
    tree = batch.tree_cache
    parent = None if c.key.kind is Kind.REBUILD else c.parent
    doc = Compressed.compact(c.key, None, c.kept_positions, int(r.dest.numel()), c.unit_lens, c.carried, parent=parent)
    doc.node = insert_document(tree, c.key, r.dest) if parent is None else insert_child(tree, parent, c.key, r.dest)
    registry_of(tree).add(doc)
    trace_document(compressor, batch.reqs[c.i], doc)


# A finished turn.


@dataclass(frozen=True)
class TurnCandidate:
    """A finished request's turn, found (`turn_candidate`), not yet published."""

    req: Any
    parent: Document
    key: DocumentKey
    start: int  # its row's slots [start, end) hold the turn's tokens
    end: int

    def publish(self, tree: Any, registry: DocumentRegistry) -> list[tuple[int, int]]:
        """Insert it after its document; the range of the row whose slots the tree now owns."""
        req = self.req
        slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, self.start:self.end].to(torch.int64).clone()
        node = insert_child(tree, self.parent, self.key, slots)
        registry.add(Turn(key=self.key, node=node, slots=int(slots.numel()), parent=self.parent))
        supersedes(req)
        return [(self.start, self.end)]


def turn_candidate(registry: DocumentRegistry, req: Any) -> TurnCandidate | None:
    """The turn the finished `req` leaves after its document, where its row holds it exact; else
    None. Decided from SGLang's fields and the registry alone, alike on every rank."""
    fields = req_state.peek(req)
    plan = plan_of(req)
    if fields is None or fields.rule is None or not owns_its_row(req):
        return None
    parent = registry.get(plan.key)
    if parent is None or parent.exact:
        return None
    # its row holds every token it read exact after what it started from (nothing: after none):
    # those at row index (token - offset), where nothing compacted it since
    layout = plan.layout
    row = int(req.kv.kv_committed_len)
    sequence = [*req.origin_input_ids, *req.output_ids]
    end = len(sequence) - 1  # the last output token is never read
    if row < layout.held or layout.tokens(row) != end or end <= parent.key.tokens or layout.covers > parent.key.tokens:
        return None
    start = layout.slot(parent.key.tokens)
    if start < int(req.kv.cache_protected_len):  # the tree's already (a matched prefix)
        return None
    key = turn_key(parent.key, sequence[:end])
    if registry.get(key) is not None:
        return None
    return TurnCandidate(req, parent, key, start, row)


def supersedes(req: Any) -> None:
    """`req` kept its own turn: the turn it started from, if any, is dropped at its release
    (`superseded`)."""
    start = plan_of(req).start
    req_state.of(req).superseded_turn = start if start is not None and start.exact else None


def superseded(registry: DocumentRegistry, req: Any) -> Document | None:
    """The turn `req` started from, now that its row is released and it kept a turn of its own
    (the conversation goes on from that one, and from its document's extension, which holds the
    old turn's question and answer compressed), where nothing else holds it: to drop, so that a
    conversation keeps one turn exact, not every turn. Else None (it stays, evicted as any leaf)."""
    fields = req_state.peek(req)
    if fields is None:
        return None
    doc, fields.superseded_turn = fields.superseded_turn, None
    if doc is None or registry.get(doc.key) is not doc or doc.node.lock_ref > 0 or doc.node.children:
        return None
    return doc


def answered(req: Any) -> bool:
    """Whether `req` finished by a stop token or its length: its output is what the client got
    (not cut at a stop string, nor aborted)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN

    return req.finished() and isinstance(req.finished_reason, (FINISH_MATCHED_TOKEN, FINISH_LENGTH))


def owns_its_row(req: Any) -> bool:
    """Whether the finished `req` answered and owns every slot of its row (SGLang's
    `Req.owned_kv_len`): with `--strip-thinking-cache` a reasoning request owns only its prompt's,
    SGLang frees the rest (its thinking is not to be kept), and nothing of it may be kept here."""
    return answered(req) and int(req.owned_kv_len()) >= int(req.kv.kv_committed_len)


# A finished reply.


@dataclass(frozen=True)
class ReplyCandidate:
    """A finished request's compacted row, found (`reply_candidate`), not yet published."""

    req: Any
    key: DocumentKey
    positions: Tensor  # uniform [L, H_kv, k]; packed [L, H_kv, K], 0 past each head's length
    unit_lens: Tensor | None
    k: int  # the row's first k slots hold its kept entries
    sequence: list[int]  # the L tokens its row holds
    carried: CarriedScores | None

    def publish(self, tree: Any, registry: DocumentRegistry) -> list[tuple[int, int]]:
        """Insert the reply and the turn after it; the ranges of the row whose slots the tree now
        owns (none where the documents' metadata has no room for it)."""
        req, k = self.req, self.k
        slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : int(req.kv.kv_committed_len)]
        slots = slots.to(torch.int64).clone()
        heads = int(self.positions.shape[0] * self.positions.shape[1])
        packed = self.unit_lens is not None
        entries = int(self.unit_lens.sum()) if packed else int(self.positions.numel())
        if not tree.make_document_room(compact_bytes(entries, heads, packed, self.carried is not None)):
            registry.stats.not_published += 1
            return []
        doc = Compressed.compact(self.key, None, self.positions, k, self.unit_lens, self.carried)  # nothing raises once inserted
        doc.node = insert_document(tree, self.key, slots[:k])
        registry.add(doc)
        supersedes(req)
        if len(slots) == k:
            return [(0, k)]
        try:  # the reply is the tree's now: a failure here loses the turn after it only
            tkey = turn_key(self.key, self.sequence)
            registry.add(Turn(key=tkey, node=insert_child(tree, doc, tkey, slots[k:]), slots=len(slots) - k, parent=doc))
        except Exception:
            logger.exception("the turn after the reply of %s was not kept", getattr(req, "rid", "?"))
            return [(0, k)]
        return [(0, len(slots))]


def reply_candidate(tree: Any, registry: DocumentRegistry, req: Any) -> ReplyCandidate | None:
    """The reply the finished `req` leaves, where the tree can read its row as one; else None.
    Decided from SGLang's fields and the request's state, alike on every rank."""
    fields = req_state.peek(req)
    plan = plan_of(req)
    state, declared = (fields.state if fields is not None else None), plan.key
    if not may_reply(req) or declared is None or state is None or not owns_its_row(req):
        return None
    if int(req.kv.cache_protected_len) or not getattr(req, "skip_radix_cache_insert", False):
        return None  # a row its compaction never rewrote (it holds the tree's slots)
    n = int(req.kv.kv_committed_len)
    end = len(req.origin_input_ids) + len(req.output_ids) - 1  # the last output token is never read
    if state.logical_len(n) != end or state.kept_positions is None or state.kept_positions.dim() != 3:
        return None  # not all it read, or one shared set of positions
    packed = state.units is not None
    k = state.packed if packed else int(state.kept_positions.shape[-1])
    if not 0 < k <= n or k + state.offset <= len(req.origin_input_ids):
        # not compacted since it decoded: a turn's (`turns.py`), or a prompt its prefill pass cut
        # for its own question, whose answer the next turn reads again, as before
        return None
    positions, unit_lens, entries = state.kept_positions, None, k
    if packed:
        unit_lens = state.unit_lens
        layers, heads = unit_lens.shape
        if int(unit_lens.sum()) > k * layers * heads:
            return None
        if not _canonical(state.units, unit_lens, tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :k]):
            return None
        entries = math.ceil(int(unit_lens.sum()) / (layers * heads))
        positions = positions * (torch.arange(positions.shape[-1], device=positions.device) < unit_lens[..., None])
    sequence = [*req.origin_input_ids, *req.output_ids][:end]
    start = plan.start.key.digest if plan.start is not None else ""
    key = reply_key(declared, sequence[: k + state.offset], entries, fields.rule.settings, start)
    if registry.get(key) is not None:
        return None
    carried = state.reconstructed  # KVzip: its document's scores, through its passes
    if carried is not None and any(layer.shape[-1] < positions.shape[-1] for layer in carried.layers):
        carried = None  # not in its columns: none (the next pass repeats the whole conversation)
    return ReplyCandidate(req, key, positions, unit_lens, k, sequence, carried)


def _canonical(units: Tensor, unit_lens: Tensor, slots: Tensor) -> bool:
    """Whether the packed `units` are where a document of `slots` with these lengths has them."""
    rel, expected = packed_units(slots, unit_lens, int(units.shape[-1]))
    return bool(torch.equal(expected, units.to(expected.device).long() * (rel >= 0)))
