"""A conversation's finished turns (docs/architecture.md, "Shared documents", conversations).

A request that declared a document finishes (its answer ended at a stop token or at its length)
with its row holding, after that document's entries, its question and answer exact: the tokens
[D, L) of its prompt and output (L: all but the last output token, the one never read). Those
slots, which SGLang would free now, go to the tree instead (`publish`, from SGLang's
`release_kv_cache` through `KvcRadixCache.claim_kv_row` and `free_kv_row`): a node after the
document's (`nodes.insert_child`), registered as a *turn* (`Document.turn`, exact), keyed by its
tokens. Nothing is copied or allocated, and the tree evicts it as any leaf (LRU).

The next turn's prompt resends the conversation: its document is [doc, q1, a1] as the chat
template renders it, which begins with the turn's L tokens where the template renders the answer
as it was generated (then `<|im_end|>` and a newline, say). It starts from the document it
extends and that turn (`extensions.resident_turn`), reads only what follows them (the template's
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

import hashlib
from array import array
from typing import Any

import torch

from sgl_kvc import req_state
from sgl_kvc.adapter.documents import Document, DocumentKey, DocumentRegistry, tokens_content
from sgl_kvc.adapter.documents.nodes import insert_child
from sgl_kvc.adapter.safety import failpoints


def publish(tree: Any, registry: DocumentRegistry, req: Any) -> tuple[int, int] | None:
    """Publish the finished `req`'s question and answer as a turn after its document, where its
    row holds them exact; the range of its row whose slots the tree now owns (SGLang must not
    free them), or None (nothing published)."""
    found = _turn(registry, req)
    if found is None:
        return None
    parent, key, start, end = found
    failpoints.check("turn_raise", req)
    slots = tree.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].to(torch.int64).clone()
    node = insert_child(tree, parent, key, slots)
    registry.add(Document.turn(key, node, parent))
    supersedes(req)
    return start, end


def supersedes(req: Any) -> None:
    """`req` kept its own turn: the turn it started from, if any, is dropped at its release
    (`superseded`)."""
    fields = req_state.of(req)
    hit = fields.hit
    fields.superseded_turn = hit if hit is not None and hit.exact else None


def superseded(registry: DocumentRegistry, req: Any) -> Document | None:
    """The turn `req` started from, now that its row is released and it kept a turn of its own
    (the conversation goes on from that one, and from its document's extension, which holds the
    old turn's question and answer compressed), where nothing else holds it: to drop, so that a
    conversation keeps one turn exact, not every turn. Else None (it stays, evicted as any leaf)."""
    fields = req_state.of(req)
    doc, fields.superseded_turn = fields.superseded_turn, None
    if doc is None or registry.get(doc.key) is not doc or doc.node.lock_ref > 0 or doc.node.children:
        return None
    return doc


def without(ranges: list[tuple[int, int]], kept: tuple[int, int]) -> list[tuple[int, int]]:
    """`ranges` (ascending, half-open) less `kept`."""
    out = []
    for a, b in ranges:
        if a < kept[0]:
            out.append((a, min(b, kept[0])))
        if b > kept[1]:
            out.append((max(a, kept[1]), b))
    return [(a, b) for a, b in out if a < b]


def _turn(registry: DocumentRegistry, req: Any) -> tuple[Document, DocumentKey, int, int] | None:
    """The document `req`'s turn follows, its key, and the range of its row it holds, or None."""
    fields = req_state.of(req)
    if fields.extension is None or not answered(req):
        return None
    parent = registry.get(fields.document)
    if parent is None or parent.exact:
        return None
    # its row holds every token it read exact after the document it started from (none: after
    # none): those at row index (token - offset), where nothing compacted it since
    start_doc = fields.hit
    offset = 0 if start_doc is None else start_doc.offset
    row = int(req.kv.kv_committed_len)
    sequence = [*req.origin_input_ids, *req.output_ids]
    end = len(sequence) - 1  # the last output token is never read
    if row + offset != end or end <= parent.key.tokens:
        return None
    if start_doc is not None and start_doc.key.tokens > parent.key.tokens:
        return None
    start = parent.key.tokens - offset
    if start < int(req.kv.cache_protected_len):  # the tree's already (a matched prefix)
        return None
    key = turn_key(parent, sequence[:end])
    if registry.get(key) is not None:
        return None
    return parent, key, start, row


def turn_key(parent: Document, tokens: list[int]) -> DocumentKey:
    """The key of the turn of `tokens` (all of them, from the first) after `parent`."""
    content = tokens_content(tokens, parent.key.family)
    own = hashlib.sha256(parent.key.digest.encode())
    own.update(array("q", tokens[parent.key.tokens:]).tobytes())
    own.update(b"turn")
    n = len(tokens) - parent.key.tokens
    return DocumentKey(digest=own.hexdigest(), tokens=len(tokens), entries=parent.key.entries + n,
                       policy=parent.key.policy, family=parent.key.family, content=content,
                       parent=parent.key.digest, parent_entries=parent.key.entries)


def answered(req: Any) -> bool:
    """Whether `req` finished by a stop token or its length: its output is what the client got
    (not cut at a stop string, nor aborted)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, FINISH_MATCHED_TOKEN

    return req.finished() and isinstance(req.finished_reason, (FINISH_MATCHED_TOKEN, FINISH_LENGTH))
