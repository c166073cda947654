"""A conversation's finished turn whose row was compacted while it decoded (docs/architecture.md,
"Shared documents", conversations): a reply compressed by R-KV (or any decode policy, or before a
preemption).

Its row no longer holds its document's entries then its question and answer exact (`turns.py`):
its own pass chose among them all, copying what it kept of the tree's prefix out. What it holds
is still what the next turn's prompt begins with, kept: its first k slots (packed: its `packed`
slots) hold the entries its last pass kept of the tokens [0, D) (D = k + its offset), in its own
slots, and every slot after them the token [D, L) at its own position, exact (L: all but the last
output token). At release those slots go to the tree instead of the pool (`publish`, from
`KvcRadixCache.claim_kv_row`, as a turn's): the first as a compressed document of its own over
[0, D) (a *reply*, `DocumentKey.reply`, under the root: its entries are no chain's), the rest as a
finished turn after it. The next turn starts from the reply and that turn, as after any turn,
and compresses [0, D') again query-agnostically (`ExtensionRule.recompress`): the reply's entries
were chosen for its own question, with its own request's budget. KVzip: its entries carry the
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

import hashlib
import logging
import math
from typing import Any

import torch
from torch import Tensor

from sgl_kvc import req_state
from sgl_kvc.adapter.documents import (
    Document, DocumentKey, DocumentRegistry, compact_bytes, may_reply, packed_units, tokens_content,
)
from sgl_kvc.adapter.documents.nodes import insert_child, insert_document
from sgl_kvc.adapter.documents.turns import answered, supersedes, turn_key
from sgl_kvc.adapter.safety import failpoints

logger = logging.getLogger(__name__)


def publish(tree: Any, registry: DocumentRegistry, req: Any) -> tuple[int, int] | None:
    """Publish the finished `req`'s compacted row as a reply and a turn after it, where the tree
    can read it; the range of its row whose slots the tree now owns, or None."""
    found = _reply(tree, registry, req)
    if found is None:
        return None
    key, positions, unit_lens, k, sequence = found
    failpoints.check("turn_raise", req)
    slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : int(req.kv.kv_committed_len)]
    slots = slots.to(torch.int64).clone()
    carried = req_state.of(req).state.reconstructed  # KVzip: its document's scores, through its passes
    if carried is not None and any(layer.shape[-1] < positions.shape[-1] for layer in carried.layers):
        carried = None  # not in its columns: none (the next pass repeats the whole conversation)
    heads = int(positions.shape[0] * positions.shape[1])
    entries = int(unit_lens.sum()) if unit_lens is not None else int(positions.numel())
    if not tree.make_document_room(compact_bytes(entries, heads, unit_lens is not None, carried is not None)):
        registry.stats.not_published += 1
        return None
    # made first: nothing raises once inserted
    doc = Document.compact(key, None, positions, k, unit_lens, carried)
    doc.node = insert_document(tree, key, slots[:k])
    registry.add(doc)
    supersedes(req)
    if len(slots) == k:
        return 0, k
    try:  # the reply is the tree's now: a failure here loses the turn after it only
        tkey = turn_key(doc, sequence)
        registry.add(Document.turn(tkey, insert_child(tree, doc, tkey, slots[k:]), doc))
    except Exception:
        logger.exception("the turn after the reply of %s was not kept", getattr(req, "rid", "?"))
        return 0, k
    return 0, len(slots)


def reply_key(declared: DocumentKey, tokens: list[int], entries: int, decode_policy: str) -> DocumentKey:
    """The key of a reply over `tokens` (all of them, from the first), in `declared`'s family,
    keeping `entries` per (layer, KV head) (on average, packed), by the request's decode policy."""
    content = tokens_content(tokens, declared.family)
    digest = hashlib.sha256(repr(("reply", content, decode_policy)).encode()).hexdigest()
    return DocumentKey(digest=digest, tokens=len(tokens), entries=entries, policy=declared.policy,
                       family=declared.family, content=content, reply=True)


def _reply(tree: Any, registry: DocumentRegistry, req: Any) -> tuple[DocumentKey, Tensor, Tensor | None, int, list[int]] | None:
    """What `req`'s reply publishes: its key, kept positions (uniform [L, H_kv, k]; packed
    [L, H_kv, K], 0 past each head's length), packed lengths, the slots k it fills, and the L
    tokens its row holds; or None."""
    fields = req_state.of(req)
    state, declared = fields.state, fields.document
    if not may_reply(req) or declared is None or state is None or not answered(req):
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
    key = reply_key(declared, sequence[: k + state.offset], entries, state.policy.name)
    if registry.get(key) is not None:
        return None
    return key, positions, unit_lens, k, sequence


def _canonical(units: Tensor, unit_lens: Tensor, slots: Tensor) -> bool:
    """Whether the packed `units` are where a document of `slots` with these lengths has them."""
    rel, expected = packed_units(slots, unit_lens, int(units.shape[-1]))
    return bool(torch.equal(expected, units.to(expected.device).long() * (rel >= 0)))
