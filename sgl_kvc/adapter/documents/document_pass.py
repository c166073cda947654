"""Compressing a shared document and publishing it to the radix tree (`adapter/documents/`).

From copies (`publish_copies`; a row cut between chunks at the document's end is published from
its own first slots instead, `cut_rows.py`): right after a request that declares a document has
read its prompt, and before its own prompt pass: its entries [0, D) are exact KV of the document (nothing of it is
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
from sgl_kvc.adapter.documents.plan import plan_of
from sgl_kvc.adapter.documents.registry import insert_document, registry_of
from sgl_kvc.adapter.safety import failpoints, invariants
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
        key = plan_of(req).key
        # Only where documents are never cut between chunks (`DocumentPlan.publishes_whole`): there a request
        # that reads its prompt whole would publish other entries than those its key's cuts keep.
        if key is None or req.finished() or not plan_of(req).publishes_whole or key.digest in seen:
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


def trace_document(compressor: Host, req: Any, doc: Any) -> None:
    if not compressor.trace:  # tests only (SGLKVC_TRACE); the node is the tree's now, whatever happens here
        return
    try:
        key = doc.key
        kept, units, lens = doc.tables()
        trace_state = ReqKvState(policy=compressor.policy(key.policy, key.entries), budget=Budget(key.entries),
                                 kept_positions=kept)
        if units is not None:
            trace_state.pack(units, lens, int(doc.slots), kept)
        compressor.trace.write(req.rid, "document", key.policy, key.tokens, key.tokens, trace_state, doc.slots,
                               key.tokens)
    except Exception:  # noqa: BLE001
        logger.exception("sgl-kvc: trace of a document not written")
