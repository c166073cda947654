"""A conversation's turns (docs/architecture.md, "Shared documents", conversations): what a turn's
request leaves when it finishes, its question and answer exact (a `Turn`: `turn_candidate`) or its row
compacted as it decoded (a `Reply` and a turn: `reply_candidate`).

**A turn.** A finished request (its answer ended at a stop token or its length) whose row started
from its document's node and holds, after the document's entries, its question and answer exact
(the tokens [D, L), L: all but the last output token, never read) gives those slots to the tree
instead of the pool
(`radix_cache.keep`, from SGLang's `release_kv_cache`): a node after the document's, keyed by its
tokens, evicted as any leaf. Nothing is copied. The next turn's prompt resends the conversation,
which begins with those L tokens where the template renders the answer as it was generated: it
starts from the document and that turn (`matching.resident_turn`), reads only what follows, and
compresses [D, D') as its extension. Once it kept a turn of its own, the turn it started from is
dropped where nothing else holds it (`superseded`): a conversation keeps one turn exact. A row
compacted since it started, or whose tokens after the document are partly the tree's, keeps no
turn; nor does one that read its document whole (a server that reads prompts whole, a request
asking for prompt log-probabilities): its question and answer were computed against the exact
document, and a turn's key names only the document's entries, so the next turn reads them again
from the document.

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
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents.keys import DocumentKey, reply_key, turn_key
from sgl_kvc.adapter.documents.links import Compressed, Document, Turn, compact_bytes, packed_units
from sgl_kvc.adapter.documents.plan import may_reply, plan_of
from sgl_kvc.adapter.documents.registry import DocumentRegistry, insert_child, insert_document
from sgl_kvc.core.reconstruction import CarriedScores
from sgl_kvc.core.request_state import PackedEntries

logger = logging.getLogger(__name__)

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
    fields = kvc_req.peek(req)
    plan = plan_of(req)
    if fields is None or fields.rule is None or not owns_its_row(req):
        return None
    # only a row that started from the document it declares (a hit, or a publisher gone on from
    # what it published): its question's KV was computed against that document's entries, as the
    # turn's key says and every request starting from the turn reads them. One that read its
    # document whole (its publisher, `Role.WHOLE`; one asking for prompt log-probabilities) or
    # extended another beside it exact computed it against other KV, which the key does not say.
    parent = plan.start
    if parent is None or parent.exact or parent.key != plan.key or registry.get(parent.key) is not parent:
        return None
    # its row holds every token it read exact after the document's entries: those at row index
    # (token - offset), where nothing compacted it since
    layout = parent.layout
    row = int(req.kv.kv_committed_len)
    sequence = [*req.origin_input_ids, *req.output_ids]
    end = len(sequence) - 1  # the last output token is never read
    if row < layout.held or layout.tokens(row) != end or end <= parent.key.tokens:
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
    fields, start = kvc_req.of(req), plan_of(req).start
    if start is None or not start.exact:
        start = fields.read_turn  # (the turn it started from before it adopted its extension)
    fields.superseded_turn = start


def superseded(registry: DocumentRegistry, req: Any) -> Document | None:
    """The turn `req` started from, now that its row is released and it kept a turn of its own
    (the conversation goes on from that one, and from its document's extension, which holds the
    old turn's question and answer compressed), where nothing else holds it: to drop, so that a
    conversation keeps one turn exact, not every turn. Else None (it stays, evicted as any leaf)."""
    fields = kvc_req.peek(req)
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
    doc: Compressed  # the reply's metadata, made with the candidate (before the vote: it can fail)

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
        doc = self.doc
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
    fields = kvc_req.peek(req)
    plan = plan_of(req)
    state, declared = (fields.state if fields is not None else None), plan.key
    if not may_reply(req) or declared is None or state is None or not owns_its_row(req):
        return None
    if int(req.kv.cache_protected_len) or not getattr(req, "skip_radix_cache_insert", False):
        return None  # a row its compaction never rewrote (it holds the tree's slots)
    n = int(req.kv.kv_committed_len)
    end = len(req.origin_input_ids) + len(req.output_ids) - 1  # the last output token is never read
    packed = state.packed_entries is not None
    if state.logical_len(n) != end or not packed and (state.kept_positions is None or state.kept_positions.dim() != 3):
        return None  # not all it read, or one shared set of positions
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
        if not _canonical(state.packed_entries, tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :k]):
            return None
        entries = math.ceil(int(unit_lens.sum()) / (layers * heads))
        positions = state.packed_positions()  # 0 past each head's length
    sequence = [*req.origin_input_ids, *req.output_ids][:end]
    start = plan.start.key.digest if plan.start is not None else ""
    key = reply_key(declared, sequence[: k + state.offset], entries, fields.rule.settings, start)
    if registry.get(key) is not None:
        return None
    carried = state.reconstructed  # KVzip: its document's scores, through its passes
    if carried is not None and any(layer.shape[-1] < positions.shape[-1] for layer in carried.layers):
        carried = None  # not in its columns: none (the next pass repeats the whole conversation)
    doc = Compressed.compact(key, None, positions, k, unit_lens, carried)
    return ReplyCandidate(req, key, positions, unit_lens, k, sequence, carried, doc)


def _canonical(entries: PackedEntries, slots: Tensor) -> bool:
    """Whether the packed entries' units are where a document of `slots` with their lengths has them."""
    rel, expected = packed_units(slots, entries.lens, entries.width)
    return bool(torch.equal(expected[rel >= 0], entries.units.to(expected.device).long()))
