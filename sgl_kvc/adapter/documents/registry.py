"""One radix tree's resident documents, indexed the ways they are looked up.

Every lookup a waiting request makes in a prefill round is by key (`get`), by content (the
documents its prompt may begin with: `by_content`, over the token counts its family's documents
have, `lengths`) or by the document a turn follows (`turns_after`), never a scan of every
resident document: a tenant may keep thousands resident (one-slot turns) and SGLang matches every
waiting request in every round. Totals the stats and metrics read are kept as they change.
Below, how a document's node is inserted into the tree (`insert_document`, `insert_child`).
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.adapter.documents.keys import NODE_ATTR, DocumentKey, Kind, node_key
from sgl_kvc.adapter.documents.links import Document, Turn


@dataclass
class DocumentStats:
    compressions: int = 0  # documents compressed and published
    extensions: int = 0  # of them: documents published as the extension of a resident one
    rebuilds: int = 0  # of them: chains compressed again as one (at their budget or depth, or after a reply)
    replies: int = 0  # finished requests' compacted rows kept as documents (`turns.py`)
    hits: int = 0  # requests that started from a resident document
    evictions: int = 0  # documents the tree evicted (LRU) or dropped
    not_published: int = 0  # compressed documents not published: no free slots, no room for its metadata, or a failure
    evicted_for_metadata: int = 0  # of the evictions: documents evicted to keep the metadata within its reservation
    waited_out: int = 0  # requests that waited --kv-document-wait for a publisher, then read it themselves
    seconds: float = 0.0  # spent scoring and copying documents
    turns: int = 0  # finished turns published (exact, after their request's document: `turns.py`)
    turns_evicted: int = 0  # of them: evicted or dropped


@dataclass
class DocumentRegistry:
    """One radix tree's documents, by key, and the indexes lookups use."""

    by_key: dict[str, Document] = field(default_factory=dict)
    stats: DocumentStats = field(default_factory=DocumentStats)
    metrics: Any = None  # the scheduler's CompressionMetrics (`/metrics`), once it has some
    # documents being compressed: key digest -> the request (SGLang's Req) compressing it
    publishers: dict[str, Any] = field(default_factory=dict)
    # bytes the KV memory reserved for the resident documents' metadata (`adapter/memory/kv_memory.py`);
    # None: nothing reserved (a pool layout without one cost per token), not bounded
    metadata_budget: int | None = None
    # the tensor-parallel group's vote (`adapter/safety/tp.RankVote`), None with one rank: what a
    # release keeps is voted before anything is inserted (`radix_cache.keep`)
    vote: Any = None
    # a finishing request's row (its pool index) -> its kv record and the ranges of the row whose
    # slots the tree kept (`radix_cache.keep`), from SGLang's `claim_kv_row` to `on_release` of one
    # release: every `free_kv_row` of it in between frees what is left
    taken: dict[int, tuple[Any, list[tuple[int, int]]]] = field(default_factory=dict)
    # the indexes: compressed documents by content, and how many of each family cover how many
    # tokens; turns by the document they follow and their content, and how many after each
    # document cover how many tokens (a request looks up one content per length, never scans them)
    by_content: dict[str, dict[str, Document]] = field(default_factory=dict)
    lengths: dict[str, Counter] = field(default_factory=dict)
    turns_after: dict[str, dict[str, dict[str, Turn]]] = field(default_factory=dict)
    turn_lengths: dict[str, Counter] = field(default_factory=dict)
    # totals, kept as they change
    metadata_bytes: int = 0
    resident: int = 0  # compressed documents (not turns)
    resident_entries: int = 0
    resident_tokens: int = 0
    turn_tokens: int = 0

    def get(self, key: DocumentKey | None) -> Document | None:
        return None if key is None else self.by_key.get(key.digest)

    def compressed_by(self, key: DocumentKey) -> Any:
        """The request in flight that compresses this document, or None (one that finished or gave
        its row back without publishing it is forgotten here)."""
        req = self.publishers.get(key.digest)
        if req is not None and _gone(req):
            del self.publishers[key.digest]
            return None
        return req

    def forget_gone(self) -> None:
        """Forget every request registered as compressing a document that finished, failed or gave
        its row back without publishing it. `compressed_by` forgets one only when its document is
        asked for again: a unique document's would keep its `Req` (its prompt, its output) for the
        server's lifetime. Run at each prefill round (`waiting.compressing`), it bounds the
        registry by the requests in flight."""
        for digest in [d for d, req in self.publishers.items() if _gone(req)]:
            del self.publishers[digest]

    def settle(self, key: DocumentKey, req: Any) -> None:
        """`req` published the document, or will not: requests held back for it may go."""
        if self.publishers.get(key.digest) is req:
            del self.publishers[key.digest]

    def add(self, doc: Document) -> None:
        setattr(doc.node, NODE_ATTR, doc)
        self.by_key[doc.key.digest] = doc
        self.metadata_bytes += doc.metadata_bytes
        if isinstance(doc, Turn):
            self.turns_after.setdefault(doc.key.parent, {}).setdefault(doc.key.content, {})[doc.key.digest] = doc
            self.turn_lengths.setdefault(doc.key.parent, Counter())[doc.key.tokens] += 1
            self.turn_tokens += doc.covers
            self.stats.turns += 1
            return
        self.by_content.setdefault(doc.key.content, {})[doc.key.digest] = doc
        self.lengths.setdefault(doc.key.family, Counter())[doc.key.tokens] += 1
        self.resident += 1
        self.resident_entries += doc.entries
        self.resident_tokens += doc.covers
        if doc.key.kind is Kind.REPLY:  # kept as its request left it, compressed by no document pass
            self.stats.replies += 1
            self._emit("reply")
            return
        self.publishers.pop(doc.key.digest, None)
        self.stats.compressions += 1
        self.stats.extensions += doc.key.kind is Kind.EXTENSION
        self.stats.rebuilds += doc.key.kind is Kind.REBUILD
        self._emit("compressed")

    def count_hit(self) -> None:
        """A request started from a resident document."""
        self.stats.hits += 1
        self._emit("hit")

    def removed(self, node: Any) -> None:
        """The tree deleted `node` (evicted it): a document it held is gone."""
        doc = getattr(node, NODE_ATTR, None)
        if doc is not None and self.by_key.get(doc.key.digest) is doc:
            self._drop(doc)

    def clear(self) -> None:
        """The tree was reset (`/flush_cache`): every document is gone."""
        for doc in list(self.by_key.values()):
            self._drop(doc)

    def _drop(self, doc: Document) -> None:
        del self.by_key[doc.key.digest]
        self.metadata_bytes -= doc.metadata_bytes
        if isinstance(doc, Turn):
            after = self.turns_after.get(doc.key.parent, {})
            same = after.get(doc.key.content, {})
            same.pop(doc.key.digest, None)
            if not same:
                after.pop(doc.key.content, None)
            if not after:
                self.turns_after.pop(doc.key.parent, None)
            _uncount(self.turn_lengths, doc.key.parent, doc.key.tokens)
            self.turn_tokens -= doc.covers
            self.stats.turns_evicted += 1
            return
        same = self.by_content.get(doc.key.content, {})
        same.pop(doc.key.digest, None)
        if not same:
            self.by_content.pop(doc.key.content, None)
        _uncount(self.lengths, doc.key.family, doc.key.tokens)
        self.resident -= 1
        self.resident_entries -= doc.entries
        self.resident_tokens -= doc.covers
        self.stats.evictions += 1
        self._emit("evicted")

    def _emit(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.document(event, self.resident, self.resident_entries)

    def snapshot(self) -> dict[str, Any]:
        return {
            "resident": self.resident,
            "entries": self.resident_entries,  # per (layer, KV head), their own
            "tokens": self.resident_tokens,  # what their own nodes cover
            "turns_resident": len(self.by_key) - self.resident,
            "turn_tokens": self.turn_tokens,  # exact, one slot each
            # which token each entry holds (and a packed document's tables), on the KV's device,
            # within what the KV memory reserved for it (`metadata_budget`)
            "metadata_bytes": self.metadata_bytes,
            "deepest_chain": max((d.depth for docs in self.by_content.values() for d in docs.values()), default=0),
            **asdict(self.stats),
        }


def _uncount(index: dict[str, Counter], name: str, tokens: int) -> None:
    counts = index.get(name)
    if counts is not None:
        counts[tokens] -= 1
        if counts[tokens] <= 0:
            del counts[tokens]
        if not counts:
            del index[name]


def _gone(req: Any) -> bool:
    """`req` will not publish its document any more: finished, or its row given back (retracted)."""
    return req.finished() or not req.kv.holds_kv


def registry_of(tree_cache: Any) -> DocumentRegistry | None:
    """The document registry of SGLang's tree cache (sgl-kvc's prefix cache), or None."""
    return getattr(tree_cache, "documents", None)


# A document's node in SGLang's radix tree: under the root, in a namespace of its own
# (`insert_document`), or under the document it follows: a child of its node, in the chain's
# namespace, its own placeholder tokens a number of its digest (siblings differ at their first
# token, `insert_child`).


def node_path(node: Any) -> tuple[array, Tensor]:
    """The radix key tokens and slots from the root down to `node`."""
    nodes = []
    while node.parent is not None:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    tokens = array("q")
    for n in nodes:
        tokens.extend(n.key.token_ids)
    return tokens, torch.cat([n.value for n in nodes])


def insert_child(tree: Any, parent: Document, key: DocumentKey, slots: Tensor) -> Any:
    """Insert `slots` as the node of the document `key` under `parent`'s node; its node. The path
    matches down to the parent's node and no child of it begins with this one's first token, so
    the insert adds exactly one node, these slots (raises where such a child exists)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    namespace = parent.node.key.extra_key
    mine = RadixKey(array("q", [int(key.digest[:15], 16)] * int(slots.numel())), extra_key=namespace)
    if mine.child_key(tree.page_size) in parent.node.children:
        raise RuntimeError(f"a document after {parent.key.digest[:12]} under the same first key exists")
    tokens, values = node_path(parent.node)
    tokens.extend(mine.token_ids)
    result = tree.insert(InsertParams(key=RadixKey(tokens, extra_key=namespace),
                                      value=torch.cat([values.to(slots.device), slots])))
    return result.last_device_node


def insert_document(tree: Any, key: DocumentKey, slots: Tensor) -> Any:
    """Insert `slots` as the node of the document `key`, under the root (`node_key`); its node."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    result = tree.insert(InsertParams(key=node_key(key, int(slots.numel())), value=slots))
    if result.prefix_len:  # cannot happen: a node under this key is registered, hence never re-published
        raise RuntimeError(f"a document node under key {key.digest[:12]} exists unregistered")
    return result.last_device_node
