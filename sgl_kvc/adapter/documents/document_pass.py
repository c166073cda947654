"""Compressing a shared document and publishing it to the radix tree (`adapter/documents/`).

Between chunks (`publish_cut_rows`), on a server that compresses there: a chunk of the request that
declares the document ended at the document's end, and the chunk moment cut its row to the
document's k entries per (layer, KV head) with its question-free prompt policy (KVzip repeats
what it read since its last cut, the scores of what that kept carried), before any of its question
is read. Those k slots (G, packed) become the node as they are, and the request goes on as one that
started from it: its row's first slots are the node's, locked, and its own compactions copy them.

Otherwise (`publish`), right after a request that declares a document has read its prompt, and
before its own prompt pass: its entries [0, D) are exact KV of the document (nothing of it is
compressed yet), so a pass over those D entries alone, by the request's question-free prompt
policy, chooses what the document keeps (KVzip's reconstruction repeats the document only and
attends to it only, as kvpress compresses a context without its question). The kept entries are
copied, per (layer, KV head), into k fresh slots (`core/moves.py`; with variable or layer head
budgets, packed unit by unit into G slots as a compaction packs a request), which become a tree
node of their own. The request's row is only read: whatever fails here leaves the request as it
was, and the document is simply not published (the next request that declares it tries again).

There the k fresh slots come from the free pool or from evicting unlocked tree nodes (LRU), like any tree
insert: the node is unlocked cache at once, evicted before any request is retracted.

With tensor parallelism, vote, then act: every rank chooses each document's entries (its pass,
which may fail on one rank alone), the ranks vote, and only the documents chosen on every rank are
given room (evicting documents and tree nodes, alike on every rank: their trees are the same),
copied, their nodes' metadata made, and voted on again before anything is inserted: after the last
vote only plain inserts into the tree and the registry run. A failure on one rank loses that
document on every rank, never another, and the ranks' trees stay the same.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import Tensor

from sgl_kvc.adapter.documents.keys import DocumentKey
from sgl_kvc.adapter.documents.links import Compressed, compact_bytes
from sgl_kvc.adapter.documents.plan import cuts, declared, publishes_whole, started_from
from sgl_kvc.adapter.documents.registry import insert_document, registry_of
from sgl_kvc.adapter.safety import failpoints, invariants
from sgl_kvc.adapter.safety.failures import failure
from sgl_kvc.adapter.safety.tp import anywhere
from sgl_kvc.core.moves import move_unit_entries, move_units_many, packed_slots, unit_moves
from sgl_kvc.core.passes import StepWork, advance, pass_tables, start_pass
from sgl_kvc.core.reconstruction import CarriedScores, carry_scores
from sgl_kvc.core.request_state import Budget, ReqKvState

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sgl_kvc.adapter.kvzip.reconstruction import Reconstructor
    from sgl_kvc.adapter.safety.failures import FailureLedger
    from sgl_kvc.adapter.telemetry.trace import CompactionTrace
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.core.store import KvcStore
    from sgl_kvc.policies import HeadSelection, Policy


class Host(Protocol):
    """What compressing and publishing a document needs of the compressor that runs the moments
    (`adapter/moments/compressor.py`; the moments' own `Host` extends it), and nothing more."""

    config: KvcConfig
    store: KvcStore
    scheduler: Any
    failures: FailureLedger  # its TP vote
    reconstructor: Reconstructor  # KVzip's pass over the document
    metrics: Any
    document_bytes: int | None  # the documents' metadata budget
    trace: CompactionTrace | None

    def state(self, req: Any) -> ReqKvState | None: ...

    def policy(self, name: str, budget: int) -> Policy: ...

    def account(self, seconds: float) -> float: ...

    def state_from(self, req: Any, doc: Any) -> ReqKvState: ...

    def set_state(self, req: Any, state: ReqKvState) -> None: ...

logger = logging.getLogger(__name__)


def to_publish(compressor: Host, batch: ScheduleBatch, read: list[int]) -> list[tuple[int, DocumentKey]]:
    """The requests of `batch` (indices whose prompt is read) that publish their document now:
    they declare one not resident, did not start from it, hold its D entries exact (not compacted
    between chunks), and are the first in this batch to declare it. Decided from what every
    tensor-parallel rank holds alike (a request whose state failed here is still listed, and not
    ready in `publish`'s vote), so that the ranks run the same passes and vote together."""
    registry = registry_of(getattr(batch, "tree_cache", None))
    if registry is None:
        return []  # not sgl-kvc's prefix cache
    out, seen = [], set()
    for i in read:
        req = batch.reqs[i]
        key = declared(req)
        # Only where documents are never cut between chunks (`publishes_whole`): there a request
        # that reads its prompt whole would publish other entries than those its key's cuts keep.
        if key is None or req.finished() or not publishes_whole(req) or key.digest in seen:
            continue
        state = compressor.state(req)
        if state is not None and state.passes:
            continue  # compacted between chunks: its entries are no longer the document's
        if registry.get(key) is not None or int(batch.seq_lens_cpu[i]) <= key.tokens:
            continue
        seen.add(key.digest)
        out.append((i, key))
    return out


@dataclass
class Chosen:
    """A document's entries chosen by its pass over a request's row (`slots`), not yet copied:
    what `copy_kept` copies (the selection, and packed, its units) and what the node keeps."""

    i: int
    key: DocumentKey
    slots: Tensor
    selection: Any  # HeadSelection: the entries it copies
    units: Tensor | None  # packed: the units of the selection's columns
    kept_positions: Tensor
    carried: CarriedScores | None
    metadata: int  # its node's metadata bytes (`compact_bytes`)
    unit_lens: Tensor | None = None  # packed: each head's entries
    parent: Any = None  # an extension's: the document it extends


@dataclass
class Ready:
    chosen: Chosen
    dest: Tensor  # the fresh slots the kept entries were copied into (packed: G slots)
    table: Tensor | None  # packed: the units each kept entry went to


def publish_copies(compressor: Host, batch: ScheduleBatch, items: list[tuple[int, DocumentKey]]) -> None:
    """Score, copy and publish each item's document; a failure loses that document only. With
    tensor parallelism a document is published only where every rank copied it."""
    if not items:
        return
    store = compressor.store
    registry = registry_of(batch.tree_cache)

    def state(i: int, key: DocumentKey) -> ReqKvState:  # the document alone, as a request that read D tokens
        return ReqKvState(policy=compressor.policy(key.policy, key.entries), budget=Budget(key.entries),
                          selection="per-head", device=store.device)

    copy_and_publish(compressor, batch, items, state, lambda i, key: key.tokens,
                     lambda i, key, st: _choose(compressor, batch, i, key, st),
                     lambda r: _node(batch, r), lambda r, doc: _insert(compressor, batch, r, doc, registry))


def copy_and_publish(compressor: Host, batch: ScheduleBatch, items: list[tuple[int, DocumentKey]],
                     state: Callable[[int, DocumentKey], ReqKvState], entries: Callable[[int, DocumentKey], int],
                     choose: Callable[[int, DocumentKey, ReqKvState], Chosen], make: Callable[[Ready], Compressed],
                     insert: Callable[[Ready, Compressed], None]) -> None:
    """Publishing documents copied out of their requests' rows (`publish_copies`, and an
    extension's, `extensions.publish`): each item's pass state (`state(i, key)`), its
    reconstruction over its row's first `entries(i, key)` entries where its policy reads one
    (KVzip), `choose(i, key, state)` (its pass, no side effect), the ranks' vote; then, for the
    documents chosen everywhere, their room and copies (`copy_kept`) and their nodes' metadata
    (`make(ready)`, where a failure frees the copies), the ranks' vote again, and `insert(ready,
    doc)`, which only inserts. A failure loses that document only, never the request, whose row
    was only read; the requests waiting for it go either way."""
    t0 = time.perf_counter()
    registry = registry_of(batch.tree_cache)
    failed: dict[int, BaseException] = {}
    states: dict[int, ReqKvState] = {}
    for i, key in items:
        try:
            states[i] = state(i, key)
        except Exception as e:  # noqa: BLE001 - that document only
            failed[i] = e
    recon = [(i, states[i], "prefill", entries(i, key)) for i, key in items
             if i in states and states[i].policy.uses_reconstruction]
    if recon:
        compressor.reconstructor.run(compressor.scheduler, batch, recon, lambda req, e: failed.setdefault(
            batch.reqs.index(req), e))

    def chosen(i: int, key: DocumentKey) -> Chosen:
        if i in failed:
            raise failed[i]
        if compressor.state(batch.reqs[i]) is None:
            raise RuntimeError("its request failed on this rank")
        return choose(i, key, states[i])

    choices = [c for c, absent in voted(compressor, batch, items, chosen) if c is not None and not absent]
    copies = [(c, _guarded(batch, c.i, _copied, compressor, batch, c, make)[0]) for c in choices]
    agreed = anywhere(compressor.failures.vote, [made is None for _, made in copies])
    not_published = len(items) - len(choices)
    for (c, made), absent in zip(copies, agreed):
        if made is None or absent:
            if made is not None:
                batch.token_to_kv_pool_allocator.free(made[0].dest)
            not_published += 1
            continue
        try:
            insert(*made)  # plain inserts (a failure here would be a bug: the slots are not the tree's yet)
        except Exception:  # noqa: BLE001 - never the request's: its row was only read
            logger.exception("sgl-kvc: document of %s not published", batch.reqs[c.i].rid)
            batch.token_to_kv_pool_allocator.free(made[0].dest)
            not_published += 1
    registry.stats.not_published += not_published
    settle(batch, items, registry)
    if invariants.enabled():
        invariants.check_documents(batch.tree_cache)
    registry.stats.seconds += compressor.account(time.perf_counter() - t0)


def _copied(compressor: Host, batch: ScheduleBatch, chosen: Chosen,
            make: Callable[[Ready], Compressed]) -> tuple[Ready, Compressed] | None:
    """`chosen`'s entries copied into fresh slots (`copy_kept`) and its node's metadata made
    (`make`): everything of a publication that can fail, before the last vote. None where there
    is no room; a failure frees the copies."""
    ready = copy_kept(compressor, batch, chosen)
    if ready is None:
        return None
    try:
        return ready, make(ready)
    except BaseException:
        batch.token_to_kv_pool_allocator.free(ready.dest)
        raise


def _guarded(batch: ScheduleBatch, i: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - that document only
        logger.exception("sgl-kvc: document of %s not published", batch.reqs[i].rid)
        return None, e


def settle(batch: ScheduleBatch, items: list[tuple[int, DocumentKey]], registry: Any) -> None:
    """The requests held back for these documents may go: each is published or will not be."""
    for i, key in items:
        registry.settle(key, batch.reqs[i])


def voted(compressor: Host, batch: ScheduleBatch, items: list[tuple[int, DocumentKey]],
          prepare: Callable[[int, DocumentKey], Any]) -> list[tuple[Any, bool]]:
    """`prepare(i, key)` of each item (None where it raises here: logged, the document is not
    published, its request goes on), and whether it is missing on any rank (the ranks' vote)."""
    ready = [_guarded(batch, i, prepare, i, key)[0] for i, key in items]
    return list(zip(ready, anywhere(compressor.failures.vote, [r is None for r in ready])))


def _choose(compressor: Host, batch: ScheduleBatch, i: int, key: DocumentKey, state: ReqKvState) -> Chosen:
    """The document's pass over the request's first D entries: what it keeps (nothing copied)."""
    store = compressor.store
    req = batch.reqs[i]
    row = req.kv.req_pool_idx
    d, k = key.tokens, key.entries
    failpoints.check("document_raise", req)
    slots = store.req_to_token[row, :d].to(torch.int64)
    tables = pass_tables(store, compressor.config.kv_head_budget, state.policy, state, slots)
    packed = tables is not None
    state.pending = start_pass(store, row, state, state.policy, d, k, "prefill", tables)
    scores = state.pending.reconstruction  # KVzip's, kept with the document (`Compressed.carried`)
    due = advance(store, row, state, d, StepWork.unlimited(), compressor.config.kv_head_budget, i)
    if due is None:
        raise RuntimeError("an unlimited document pass did not finish")
    entries = due.selection.total if packed else int(due.kept_positions.numel())
    carried = None if scores is None else carry_scores(scores, due.selection, per_head_lengths=packed)
    metadata = compact_bytes(entries, due.selection.lengths.numel(), packed, carried is not None)
    return Chosen(i, key, slots, due.selection, due.units, due.kept_positions, carried, metadata,
                  unit_lens=due.selection.lengths if packed else None)


def copy_kept(compressor: Host, batch: ScheduleBatch, chosen: Chosen) -> Ready | None:
    """The entries `chosen` keeps of a request's row, copied per (layer, KV head) into fresh slots
    (packed, unit by unit into G slots); or None where the documents' metadata or the pool has no
    room for them, after evicting unlocked documents and tree nodes (the request's own path is
    locked: never evicted here). Alike on every rank: their trees and pools are the same."""
    from sgl_kvc.adapter.moments.compaction import make_room_in_tree

    tree, allocator = batch.tree_cache, batch.token_to_kv_pool_allocator
    selection, units, slots = chosen.selection, chosen.units, chosen.slots
    g = packed_slots(selection) if units is not None else selection.max_keep
    if not tree.make_document_room(chosen.metadata):
        return None  # its metadata would not fit its reservation: not published
    make_room_in_tree(tree, g)
    if allocator.available_size() < g:
        return None
    dest = allocator.alloc(g).to(device=slots.device, dtype=torch.int64)
    try:
        if units is not None:
            moves = unit_moves(selection, units, dest)
            move_unit_entries(compressor.store.unit_pools, [moves])
            return Ready(chosen, dest, moves.table)
        move_units_many(allocator.get_kvcache(), [(slots, selection.indices.to(slots.device), dest)])
    except BaseException:
        allocator.free(dest)
        raise
    return Ready(chosen, dest, None)


def _node(batch: ScheduleBatch, r: Ready) -> Compressed:
    """The document's metadata (before the last vote: it can fail, while the fresh slots are still
    only `copy_and_publish`'s to free)."""
    c = r.chosen
    failpoints.check("node_raise", batch.reqs[c.i])
    return Compressed.compact(c.key, None, c.kept_positions, int(r.dest.numel()), c.unit_lens, c.carried)


def _insert(compressor: Host, batch: ScheduleBatch, r: Ready, doc: Compressed, registry: Any) -> None:
    """The document's node: a plain tree insert (the node is unlocked cache at once), after which
    the slots are the tree's."""
    doc.node = insert_document(batch.tree_cache, r.chosen.key, r.dest)
    registry.add(doc)
    trace_document(compressor, batch.reqs[r.chosen.i], doc)


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
    expected = state.packed if state.units is not None else key.entries
    if kept != expected or state.logical_len(kept) != key.tokens or int(req.kv.cache_protected_len):
        raise RuntimeError(f"its row holds {kept} slots (cut to {expected} expected) covering "
                           f"{state.logical_len(kept)} tokens, {int(req.kv.cache_protected_len)} of them the tree's")
    if passes_before != cuts(req):  # never: only the key's cuts (`chunks.cut_at`) cut a document
        raise RuntimeError(f"its row was cut {passes_before} times before the document's end, "
                           f"{cuts(req)} of them where its key says")
    packed = state.units is not None
    entries = int(state.unit_lens.sum()) if packed else int(state.kept_positions.numel())
    heads = int(state.unit_lens.numel()) if packed else 0
    scored = state.reconstructed is not None  # KVzip: the scores its cut carried
    slots = compressor.store.req_to_token[req.kv.req_pool_idx, :kept].to(torch.int64, copy=True)
    failpoints.check("node_raise", req)
    doc = Compressed.compact(key, None, state.kept_positions, kept, state.unit_lens, state.reconstructed)
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


def trace_document(compressor: Host, req: Any, doc: Any) -> None:
    if not compressor.trace:  # tests only (SGLKVC_TRACE); the node is the tree's now, whatever happens here
        return
    try:
        key = doc.key
        kept, units, lens = doc.tables()
        trace_state = ReqKvState(policy=compressor.policy(key.policy, key.entries), budget=Budget(key.entries),
                                 kept_positions=kept, units=units, unit_lens=lens)
        compressor.trace.write(req.rid, "document", key.policy, key.tokens, key.tokens, trace_state, doc.slots,
                               key.tokens)
    except Exception:  # noqa: BLE001
        logger.exception("sgl-kvc: trace of a document not written")
