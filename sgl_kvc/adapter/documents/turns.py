"""A conversation's finished turns (docs/architecture.md, "Shared documents", conversations).

A request that declared a document finishes (its answer ended at a stop token or at its length)
with its row holding, after that document's entries, its question and answer exact: the tokens
[D, L) of its prompt and output (L: all but the last output token, the one never read). Those
slots, which SGLang would free now, go to the tree instead (`release.py`, from SGLang's
`release_kv_cache` through `KvcRadixCache.claim_kv_row` and `free_kv_row`): a node after the
document's (`nodes.insert_child`), registered as a `Turn` (exact), keyed by its tokens. Nothing is copied or allocated, and the tree evicts it as any leaf (LRU).

The next turn's prompt resends the conversation: its document is [doc, q1, a1] as the chat
template renders it, which begins with the turn's L tokens where the template renders the answer
as it was generated (then `<|im_end|>` and a newline, say). It starts from the document it
extends and that turn (`matching.resident_turn`), reads only what follows them (the template's
tail and its new question), and compresses [D, D') as the extension of the document it extends,
as it would have reading them (its pass reads the turn's slots as the row's exact entries after
the document's). A template that renders the answer otherwise (another tokenization, history
rewritten) matches no turn: that request reads its extension itself, as before.

A turn's slots hold the tokens as its request computed them, attending to that request's row:
the document it started from, then what it read exact. Where that request started from a turn
itself, that is more than the document the new turn follows keeps (the last turn's question and
answer whole): the next request reads what its predecessor's row held, as plain SGLang's reuse
of a finished request's KV does.

Once the next turn's request kept a turn of its own, the turn it started from is dropped where no
other request holds it (`superseded`): its question and answer are in that request's extension,
compressed, and a conversation holds one turn exact, not all of them. A branch from it (another
next question) then reads the last question and answer itself, as before.

Only a row that holds those tokens exact publishes them: not one compacted since it started (its
own passes; one R-KV compacted while it decoded is a reply, `replies.py`), nor one whose tokens
after the document are partly the tree's (a matched prefix). Everything here follows from
SGLang's fields and the registry, alike on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sgl_kvc import req_state
from sgl_kvc.adapter.documents.keys import DocumentKey, turn_key
from sgl_kvc.adapter.documents.links import Document, Turn
from sgl_kvc.adapter.documents.nodes import insert_child
from sgl_kvc.adapter.documents.plan import plan_of
from sgl_kvc.adapter.documents.registry import DocumentRegistry


@dataclass(frozen=True)
class TurnCandidate:
    """A finished request's turn, found (`candidate`), not yet published."""

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


def candidate(registry: DocumentRegistry, req: Any) -> TurnCandidate | None:
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
