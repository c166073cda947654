"""Documents that extend a resident document: a conversation's turns (docs/architecture.md,
"Shared documents", extended).

A request declares its document as its prompt's first D' tokens (on the chat route, by default,
every message but the last: the conversation so far). Where no document of its own key is
resident but one that its document begins with is (its first D < D' tokens, compressed in the
same namespace and settings: the same `DocumentKey.content`), it starts from the longest such one
(`resident_start`): its row begins with that document's entries, it prefills only [D, D') and its
question, and the document it compresses is the *extension* (`extension_key`): what that one kept,
then entries chosen among [D, D') alone, which it publishes as a child node of that one
(`adapter/documents/extension_pass.py`). The next turn, whose document is one turn longer again,
starts from the extension, and so on: each turn reads only what was said since the last, the
chain's ancestors stay shared by every branch of it, and the tree evicts it leaf first. Where the
last turn's request left its question and answer in the tree (a finished turn after that
document, `adapter/documents/turns.py`), the next one starts from that turn too (`resident_turn`):
it reads only what its template adds after the answer, and its question.

The extension's key names its parent's (its digest is a hash of the parent's and of its own
tokens and entries): what it keeps is decided by its key alone, whoever publishes it; the same
D' tokens compressed whole are a document of another key, which a request also starts from
where it is resident.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any

from sgl_kvc import req_state
from sgl_kvc.adapter.documents import Document, DocumentKey, DocumentRegistry, content_digest, may_start_from


def resident_start(registry: DocumentRegistry, req: Any) -> Document | None:
    """The resident document `req` starts from, or None; and the document it compresses
    (`documents.declared`): its own, or, starting from a document its own extends, the extension.
    A document of its own key first, then the extension's if resident, then the longest document
    its own extends (`extendable`). Set at each match: what is resident changes between rounds."""
    fields = req_state.of(req)
    own = fields.own_document
    fields.document = own
    if own is None:
        return None
    doc = registry.get(own)
    if doc is not None or fields.extension is None or not may_start_from(req):
        return doc
    found = extendable(registry, req, own)
    if found is None:
        return None
    parent, entries, rebuilds = found
    key = extension_key(own, parent, req.origin_input_ids, entries, rebuilds)
    fields.document = key
    return registry.get(key) or resident_turn(registry, req, parent, own) or parent


def resident_turn(registry: DocumentRegistry, req: Any, parent: Document, own: DocumentKey) -> Document | None:
    """The longest finished turn after `parent` (`adapter/documents/turns.py`) that `req`'s own
    document (`own`) begins with, or None: its row then starts with the turn's exact tokens
    after the parent's entries, and it reads only the rest of its extension and its question."""
    turns = [doc for doc in registry.by_key.values()
             if doc.exact and doc.parent is parent and doc.key.tokens <= own.tokens]
    return next(iter(_begun_with(req, turns, own.family)), None)


def extendable(registry: DocumentRegistry, req: Any, own: DocumentKey) -> tuple[Document, int, bool] | None:
    """The longest resident document that `req`'s own (`own`) extends, the entries per (layer,
    KV head) its extension keeps of its own (`ExtensionRule.entries`), or, where that would
    exceed the chain's budget or it extends a reply, in all (`ExtensionRule.rebuild`,
    `recompress`: True), or None."""
    rule = req_state.of(req).extension
    candidates = [doc for doc in registry.by_key.values()
                  if not doc.exact and doc.key.family == own.family and doc.key.tokens < own.tokens]
    for doc in _begun_with(req, candidates, own.family):
        if doc.key.reply:  # a reply is compressed again with what follows it
            entries = rule.recompress(doc.key.entries, own.tokens, own.tokens - doc.key.tokens)
            if entries is not None:
                return doc, entries, True
            continue
        entries = rule.entries(doc.key.entries, own.tokens - doc.key.tokens)
        if entries is not None:
            return doc, entries, False
        entries = rule.rebuild(doc.key.entries, own.tokens - doc.key.tokens)
        if entries is not None:
            return doc, entries, True
    return None


def _begun_with(req: Any, docs: list[Document], family: str) -> list[Document]:
    """Those of `docs` whose tokens `req`'s prompt begins with (the same `DocumentKey.content`),
    the longest first."""
    if not docs:
        return []
    contents = _prefix_contents(req, sorted({doc.key.tokens for doc in docs}), family)
    return sorted((doc for doc in docs if contents[doc.key.tokens] == doc.key.content), key=lambda d: -d.key.tokens)


def extension_key(own: DocumentKey, parent: Document, prompt: Any, entries: int, rebuilds: bool = False) -> DocumentKey:
    """The key of the document over `own`'s tokens that keeps `parent`'s entries and `entries`
    of its own tokens (per layer and KV head): a hash of the parent's key, of its own tokens, and
    of how many it keeps. `rebuilds`: that keeps `entries` in all, chosen among the parent's
    entries and its own tokens (a chain at its budget compressed again)."""
    h = hashlib.sha256(parent.key.digest.encode())
    h.update(array("q", prompt[parent.key.tokens: own.tokens]).tobytes())
    h.update(repr(("rebuilds" if rebuilds else "extends", entries)).encode())
    return DocumentKey(digest=h.hexdigest(), tokens=own.tokens, entries=entries if rebuilds else parent.key.entries + entries,
                       policy=own.policy, family=own.family, content=own.content, parent=parent.key.digest,
                       parent_entries=0 if rebuilds else parent.key.entries, rebuilds=rebuilds)


def _prefix_contents(req: Any, lengths: list[int], family: str) -> dict[int, str]:
    """`DocumentKey.content` of the first T tokens of `req`'s prompt, for each T of `lengths`
    (ascending), hashed once (one running hash) and kept with the request: SGLang matches a
    waiting request in every round."""
    fields = req_state.of(req)
    known = fields.prefix_contents if fields.prefix_contents is not None else {}
    missing = [t for t in lengths if t not in known]
    if missing:
        prompt, h, read = req.origin_input_ids, hashlib.sha256(), 0
        for t in missing:
            h.update(array("q", prompt[read:t]).tobytes())
            read = t
            known[t] = content_digest(h.copy().hexdigest(), family)
        fields.prefix_contents = known
    return known
