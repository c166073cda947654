"""Publishing a shared document from a row cut at its end (`adapter/documents/`).

On a server that compresses between chunks (`publish_cut_rows`): a chunk of the request that
declares the document ended at the document's end, and the chunk moment cut its row to the
document's k entries per (layer, KV head) with its question-free prompt policy (KVzip repeats
what it read since its last cut, the scores of what that kept carried), before any of its question
is read. Those k slots (G, packed) become the node as they are, and the request goes on as one that
started from it: its row's first slots are the node's, locked, and its own compactions copy them.

With tensor parallelism, every rank checks its row and makes the node's metadata, the ranks vote,
and only then is anything inserted (`document_pass.voted`): one rank's failure loses the document
on every rank.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents.document_pass import Host, settle, trace_document, voted
from sgl_kvc.adapter.documents.keys import DocumentKey
from sgl_kvc.adapter.documents.links import Compressed, compact_bytes
from sgl_kvc.adapter.documents.plan import started_from
from sgl_kvc.adapter.documents.registry import insert_document, registry_of
from sgl_kvc.adapter.safety import failpoints, invariants
from sgl_kvc.adapter.safety.failures import failure

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


def publish_cut_rows(compressor: Host, batch: ScheduleBatch, ends: list[tuple[int, DocumentKey]],
                     passes_before: dict[int, int]) -> None:
    """After the chunk moment: each request of `ends` (indices whose chunk ended at their
    document's end, found alike on every rank) whose row the moment cut to its document's entries
    (`passes_before`: its passes before, for those it was cut) publishes its row's first slots as
    the document's node. A document already resident (another request published it meanwhile) is
    not published again: that request goes on with its own copy. A failure loses the document, not
    the request; with tensor parallelism a document is published only where every rank is ready,
    voted before any document is evicted for its metadata."""
    registry = registry_of(getattr(batch, "tree_cache", None))
    if registry is None:
        return
    items = [(i, key) for i, key in ends if registry.get(key) is None]
    items = [(i, key) for j, (i, key) in enumerate(items) if all(k.digest != key.digest for _, k in items[:j])]
    if not items:
        return  # (of several in one batch declaring one document, the first publishes it)
    t0 = time.perf_counter()
    votes = voted(compressor, batch, items,
                  lambda i, key: _row_ready(compressor, batch, i, key, passes_before.get(i)))
    for (i, key), (ready, absent) in zip(items, votes):
        if absent:
            registry.stats.not_published += 1
            continue
        slots, metadata, doc = ready
        if not batch.tree_cache.make_document_room(metadata):
            registry.stats.not_published += 1  # (alike on every rank) it goes on with its own row
            continue
        try:
            _adopt(compressor, batch, i, doc, slots, registry)
        except Exception:  # noqa: BLE001 - its row is as the chunk moment left it: it goes on
            logger.exception("sgl-kvc: document of %s not published", batch.reqs[i].rid)
            registry.stats.not_published += 1
    settle(batch, items, registry)
    if invariants.enabled():
        invariants.check_documents(batch.tree_cache)
    registry.stats.seconds += compressor.account(time.perf_counter() - t0)


def _row_ready(compressor: Host, batch: ScheduleBatch, i: int, key: DocumentKey,
               passes_before: int | None) -> tuple[Tensor, int, Compressed] | None:
    """The slots of request i's row that hold its document's kept entries (a copy of its row's
    first k, or G packed, slot numbers), their metadata's bytes and the node's metadata (made here,
    before the vote: it can fail), or None where the chunk moment did not cut it to them (it failed,
    or had no free slots for the copies). Nothing changes here."""
    req = batch.reqs[i]
    state = compressor.state(req)
    if state is None or failure(req) is not None or passes_before is None or state.passes <= passes_before:
        return None
    failpoints.check("document_raise", req)
    kept = int(req.kv.kv_committed_len)
    expected = state.packed if state.packed_entries is not None else key.entries
    if kept != expected or state.logical_len(kept) != key.tokens or int(req.kv.cache_protected_len):
        raise RuntimeError(f"its row holds {kept} slots (cut to {expected} expected) covering "
                           f"{state.logical_len(kept)} tokens, {int(req.kv.cache_protected_len)} of them the tree's")
    cuts = kvc_req.of(req).cuts
    if passes_before != cuts:  # never: only the key's cuts (`DocumentPlan.cut_at`) cut a document
        raise RuntimeError(f"its row was cut {passes_before} times before the document's end, "
                           f"{cuts} of them where its key says")
    packed = state.packed_entries is not None
    entries = state.packed_entries.entries if packed else int(state.kept_positions.numel())
    heads = int(state.unit_lens.numel()) if packed else 0
    scored = state.reconstructed is not None  # KVzip: the scores its cut carried
    slots = compressor.store.req_to_token[req.kv.req_pool_idx, :kept].to(torch.int64, copy=True)
    failpoints.check("node_raise", req)
    positions = state.packed_positions() if packed else state.kept_positions
    doc = Compressed.compact(key, None, positions, kept, state.unit_lens, state.reconstructed)
    return slots, compact_bytes(entries, heads, packed, scored), doc


def _adopt(compressor: Host, batch: ScheduleBatch, i: int, doc: Compressed, slots: Tensor,
           registry: Any) -> None:
    """The node is the row's first slots; the request holds it locked, as a matched prefix, and
    goes on exactly as a request that started from it (`request_life.begin` for a hit). After the
    vote: plain inserts and assignments (its metadata was made before it, `_row_ready`)."""
    req, tree, key = batch.reqs[i], batch.tree_cache, doc.key
    state = compressor.state(req)
    n = int(slots.numel())
    doc.node = node = insert_document(tree, key, slots)
    tree.unlock(req.lock)  # the root's, or nothing: the cut already dropped a matched prefix's
    req.lock, req.last_node = tree.lock(node), node
    req.kv.cache_protected_len = n
    registry.add(doc)
    started_from(req, doc)
    # As a request that started from it: its next pass counts as its first, and KVzip's repeats
    # only what it read after the document, the document's entries scored as its cut scored them
    # (the scores it carries, kept with the document for every hit: `Document.carried`, which a
    # hit's pass resumes from, where its own cut's would have it repeat the document); its
    # decode policy's statistics of them (H2O, Batch-Max: its own reading of the document;
    # KV-Compress: seeded by the cut) are dropped, since no hit has them (`request_life.begin`):
    # they start at the document's end.
    state.passes = 0
    state.reconstructed = doc.carried(compressor.store.device)
    state.stats = [None] * compressor.store.num_layers
    state.stats_since = key.tokens
    trace_document(compressor, req, doc)
