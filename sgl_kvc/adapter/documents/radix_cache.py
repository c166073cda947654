"""The prefix cache of a compressing server: SGLang's Python `RadixCache`.

Registered with SGLang's `register_radix_cache_backend` as `sgl_kvc` and selected by the
launcher (`--radix-cache-backend sgl_kvc`) for compressing policies only; `--policy none` keeps
SGLang's own choice. Compaction's radix rule (the tree holds only full, exact KV; a compacting
request copies what it keeps of its tree-owned prefix and drops its lock,
`adapter/moments/compaction.py`) is written against this class's locking and eviction
(`inc_lock_ref` / `dec_lock_ref`, `evict`), which is why compressing servers pin it rather than
SGLang's default `UnifiedRadixCache`. It also holds the compressed documents
(`adapter/documents/__init__.py`).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from typing import Any

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    default_radix_cache_factory,
    get_radix_cache_factory,
    register_radix_cache_backend,
)

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents import turns
from sgl_kvc.adapter.documents.keys import NODE_ATTR
from sgl_kvc.adapter.documents.links import Turn
from sgl_kvc.adapter.documents.matching import plan_match
from sgl_kvc.adapter.documents.plan import plan_of
from sgl_kvc.adapter.documents.registry import DocumentRegistry
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.tp import everywhere

logger = logging.getLogger(__name__)


def create(ctx: TreeCacheBuildContext) -> BasePrefixCache:
    unsupported = {
        "--disable-radix-cache": ctx.disable_radix_cache,
        "hybrid SWA model": ctx.is_hybrid_swa,
        "hybrid SSM model": ctx.is_hybrid_ssm,
        "--enable-hierarchical-cache": ctx.enable_hierarchical_cache,
    }
    reasons = [k for k, v in unsupported.items() if v]
    if reasons:
        logger.warning("sgl-kvc prefix cache not used (%s): SGLang's default applies", reasons)
        return default_radix_cache_factory(ctx)
    return KvcRadixCache(ctx.params)


class KvcRadixCache(RadixCache):
    """SGLang's `RadixCache` with compressed documents (`adapter/documents/`): a request whose plan
    starts from a resident node (`matching.plan_match`) matches that node, whatever its tokens
    would match; one that compresses its document between chunks matches less than the document,
    so that a chunk of it ends at the document's end; a document's node leaves the registry when
    the tree deletes it; a finished request's question and answer after its document stay as a
    turn (`keep`)."""

    def reset(self) -> None:
        super().reset()
        registry = getattr(self, "documents", None)
        if registry is None:
            self.documents = DocumentRegistry()
        else:
            registry.clear()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        req = params.req
        # The node its plan starts from: a token of its prompt left to read after it (a finished
        # turn: within the key's limit, `len(params.key)`: the observation window, the prompt's
        # last token), never for a request asking for prompt log-probabilities (`may_start_from`).
        plan = None if req is None or self.disable else plan_match(
            self.documents, req, len(params.key.token_ids), len(params.key))
        if plan is not None and plan.start is not None:
            node = plan.start.node
            node.last_access_time = time.monotonic()  # LRU: a hit is a use
            if kvc_req.of(req).counted_use is not node:
                # LFU (and SLRU's protected segment) read `hit_count`, which SGLang counts when a
                # request inserts its KV through a node, once per request: a request starting
                # from a document never inserts (`skip_radix_cache_insert`), so its use is counted
                # here, once per request too (a waiting request is matched in every round).
                self._inc_hit_count(node)
                kvc_req.of(req).counted_use = node
            return MatchResult(device_prefix_len=plan.start.chain_slots, last_device_node=node,
                               last_host_node=node, best_match_node=node)
        limit = None if plan is None else plan.match_limit
        fields = kvc_req.peek(req) if req is not None else None
        if fields is not None and fields.whole_prompt:
            limit = 0  # it reads its whole prompt itself (`hooks._around_max_prefix`)
        if limit is not None and len(params.key) > limit:
            params = dataclasses.replace(params, key=params.key[:limit])
        return super().match_prefix(params)

    def claim_kv_row(self, req: Any) -> bool:
        # a finished request's question and answer after its document stay in the tree, a turn
        # the next one starts from; a row compacted since, as a reply and a turn (`keep`):
        # their slots are not freed with its row
        if not self.disable:
            kept = keep(self, self.documents, req)
            if kept:
                self.documents.taken[req.kv.req_pool_idx] = (req.kv, kept)
        return super().claim_kv_row(req)

    def free_kv_row(self, kv: Any, ranges: list[tuple[int, int]]) -> None:
        owner, kept = self.documents.taken.get(kv.req_pool_idx, (None, None))
        super().free_kv_row(kv, ranges if owner is not kv else without(ranges, kept))

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if self.disable:
            return
        owner, _ = self.documents.taken.get(req.kv.req_pool_idx, (None, None))
        if owner is req.kv:  # every free of this release is done
            del self.documents.taken[req.kv.req_pool_idx]
        doc = turns.superseded(self.documents, req)  # the turn it started from, once it kept its own
        if doc is not None:
            self._evict_document(doc)

    def _evict_document(self, doc: Any) -> None:
        """Evict an unlocked document's leaf node as SGLang's own `evict` removes a leaf."""
        node = doc.node
        self.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        self._delete_leaf(node)  # and from the registry
        self.kv_events.record_remove(node)

    def _delete_leaf(self, node: Any) -> None:
        super()._delete_leaf(node)
        self.documents.removed(node)

    def make_document_room(self, nbytes: int) -> bool:
        """Whether a document whose metadata is `nbytes` may be published: the resident documents'
        metadata and its own fit the bytes the KV memory reserved for them
        (`DocumentRegistry.metadata_budget`), after evicting unlocked documents, in the order of
        the tree's eviction policy (`--radix-eviction-policy`, LRU by default), as many as that
        takes. A document's slots are charged to the pool as any node's; its metadata is charged
        here, so that it never grows past what was reserved, however many documents tenants
        declare (`adapter/memory/kv_memory.py`: a slot's share is a position per (layer, KV head), and a
        packed document's lengths are one slot's share more). One pass over the resident
        documents and a heap of the evictable leaves: thousands of them cost one sort, not one
        scan per eviction."""
        registry = self.documents
        budget = registry.metadata_budget
        if budget is None:
            return True
        held = registry.metadata_bytes
        if held + nbytes <= budget:
            return True
        # a document's node is a leaf under the root or under the document it follows (nothing
        # else is inserted under its key), locked while a request starts from it: leaves first,
        # as SGLang's own `evict`, a chain's parent once its children are gone (a lock holds every
        # node up to the root: an unlocked document's children are unlocked too)
        docs = list(registry.by_key.values())
        if held - sum(doc.metadata_bytes for doc in docs if doc.node.lock_ref == 0) + nbytes > budget:
            return False  # the locked ones alone leave no room: evict nothing for nothing
        heap: list[tuple[Any, int, Any]] = []

        def push(doc: Any) -> None:
            if doc.node.lock_ref == 0 and not doc.node.children and registry.by_key.get(doc.key.digest) is doc:
                heapq.heappush(heap, (self.eviction_strategy.get_priority(doc.node), id(doc), doc))

        for doc in docs:
            push(doc)
        while held + nbytes > budget and heap:
            *_, doc = heapq.heappop(heap)
            if registry.by_key.get(doc.key.digest) is not doc or doc.node.children or doc.node.lock_ref:
                continue
            parent = getattr(doc.node.parent, NODE_ATTR, None)
            held -= doc.metadata_bytes
            self._evict_document(doc)
            registry.stats.evicted_for_metadata += not isinstance(doc, Turn)
            if parent is not None:
                push(parent)
        return held + nbytes <= budget


def register(name: str) -> None:
    if get_radix_cache_factory(name) is None:
        register_radix_cache_backend(name, create)


# Release (`KvcRadixCache.claim_kv_row`): what a finished request leaves in the tree.

def keep(tree: Any, registry: DocumentRegistry, req: Any) -> list[tuple[int, int]]:
    """Publish what the finished `req` leaves (a turn, or a reply and a turn) and return the
    ranges of its row whose slots the tree now owns (SGLang must not free them); [] for none."""
    fields = kvc_req.peek(req)
    if fields is None or fields.rule is None or plan_of(req).own is None or not turns.answered(req):
        return []  # (alike on every rank: none of them votes)
    found = None
    try:
        found = turns.turn_candidate(registry, req) or turns.reply_candidate(tree, registry, req)
        if found is not None:
            failpoints.check("turn_raise", req)
    except Exception:  # noqa: BLE001 - a turn lost, never the release
        logger.exception("a finished turn of %s was not kept", getattr(req, "rid", "?"))
        found = None
    if registry.vote is not None:
        found = found if everywhere(registry.vote, [found is not None])[0] else None
    if found is None:
        return []
    try:
        return found.publish(tree, registry)
    except Exception:  # noqa: BLE001 - publish inserts nothing before its checks pass
        logger.exception("a finished turn of %s was not kept", getattr(req, "rid", "?"))
        return []


def without(ranges: list[tuple[int, int]], kept: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` (half-open) less every range of `kept`."""
    out = list(ranges)
    for k0, k1 in kept:
        cut = []
        for a, b in out:
            if a < k0:
                cut.append((a, min(b, k0)))
            if b > k1:
                cut.append((max(a, k1), b))
        out = [(a, b) for a, b in cut if a < b]
    return out
