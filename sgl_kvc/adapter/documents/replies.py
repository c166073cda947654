"""A conversation's finished turn whose row was compacted while it decoded (docs/architecture.md,
"Shared documents", conversations): a reply compressed by R-KV (or any decode policy, or before a
preemption).

Its row no longer holds its document's entries then its question and answer exact (`turns.py`):
its own pass chose among them all, copying what it kept of the tree's prefix out. What it holds
is still what the next turn's prompt begins with, kept: its first k slots (packed: its `packed`
slots) hold the entries its last pass kept of the tokens [0, D) (D = k + its offset), in its own
slots, and every slot after them the token [D, L) at its own position, exact (L: all but the last
output token). At release those slots go to the tree instead of the pool (`release.py`, from
`KvcRadixCache.claim_kv_row`, as a turn's): the first as a compressed document of its own over
[0, D) (a `Reply`, under the root: its entries are no chain's), the rest as a finished turn after
it. The next turn starts from the reply and that turn, as after any turn, and compresses [0, D')
again query-agnostically (`ExtensionRule.recompress`): the reply's entries were chosen for its own
question, with its own request's budget.

What a reply holds follows from its key alone: its tokens, its entries, the decode settings that
compressed it (the decode policy, the budget, the selection: `keys.settings_digest`) and the node
its row started from. A later request starts from it only where its own decode settings are the
same (`matching.extendable`): a client that asks for a budget of 1 leaves a reply only requests
with a budget of 1 start from; another tenant's next turn compresses the conversation's own
extension instead. KVzip: its entries carry the
scores of the document its request started from, or of its prefill pass, through its decode
passes (`reconstruction.carry_through`, `Compressor._commit`), so that pass repeats only what
those did not cover (the last answer, as an extension's), and scores the rest afresh.

Only rows the tree can read as a document publish: per-head kept positions (as every document
request's), and a packed row (variable budgets) only where its units are those a document of its
slots and lengths names (`Document.tables`, the order `core/moves.unit_moves`
packs in). Everything is decided from SGLang's fields and the request's state, alike on every
tensor-parallel rank (variable budgets run without tensor parallelism).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sgl_kvc import req_state
from sgl_kvc.adapter.documents.keys import DocumentKey, reply_key, turn_key
from sgl_kvc.adapter.documents.links import Compressed, Turn, compact_bytes, packed_units
from sgl_kvc.adapter.documents.nodes import insert_child, insert_document
from sgl_kvc.adapter.documents.plan import may_reply, plan_of
from sgl_kvc.adapter.documents.registry import DocumentRegistry
from sgl_kvc.adapter.documents.turns import owns_its_row, supersedes
from sgl_kvc.core.reconstruction import CarriedScores

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplyCandidate:
    """A finished request's compacted row, found (`candidate`), not yet published."""

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


def candidate(tree: Any, registry: DocumentRegistry, req: Any) -> ReplyCandidate | None:
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
