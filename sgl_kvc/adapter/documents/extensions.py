"""A conversation's extension (docs/architecture.md, "Shared documents", conversations): what a
turn's request publishes of the document it started from (`due`, `publish`), and how it reads its
question from it (`adopt`).

**The extension.** A request that started from a resident document its own extends holds, right
after the forward that read its extension (before SGLang processes the result, and before any
pass of its own), the parent's entries (the chain's slots, tree-owned) then its extension's exact
entries. A pass over those, by the document's question-free prompt policy, keeps every entry of
the parent (the chain above is shared, never chosen again) and chooses the extension's own entries
among its tokens, scored in the context of what the parent kept (KVzip repeats only the extension,
resuming from the scores the parent carries). The chosen entries are copied into fresh slots, a
child node of the parent's. The request's row is only read: whatever fails here loses the
extension only. A chain compressed again (`Kind.REBUILD`: at its budget or depth, or after a
reply) keeps its budget among all of them, into a document of its own under the root. As every
publication, voted before anything is evicted or inserted (`document_pass.copy_and_publish`).

**Its question.** Where documents are compressed between chunks, a request reads its question
after its document is compressed, never beside it exact (`plan.py`, `SPLIT`). So does an
extension's request (`DocumentPlan.adopts`): one of its chunks ends at its extension's end, and
once the extension is published it goes on as a request that started from it (`adopt`): its row
becomes the chain's slots, its own exact entries of the extension are freed, and it answers from
what the conversation keeps, as every later request with that document does. Its answer is then what the
next turn's request reads as the last turn (`turns.py`): had it read its question beside the last
question and answer exact, each turn would answer from one more turn held exact than the
conversation keeps, and a conversation drifted from turn to turn (an answer one less than the
last, turn after turn). A server that reads prompts whole publishes the extension from a request
that read its question after it exact, as it publishes any document from a request that read it
whole.

Everything here follows from SGLang's fields, the request's state and the registry, alike on every
tensor-parallel rank, and each publication is voted across ranks before it acts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents.document_pass import Chosen, Host, Ready, copy_and_publish, trace_document
from sgl_kvc.adapter.documents.keys import DocumentKey, Kind
from sgl_kvc.adapter.documents.links import Compressed, Document, compact_bytes
from sgl_kvc.adapter.documents.plan import extension_due, extension_lost, plan_of, started_from
from sgl_kvc.adapter.documents.registry import insert_child, insert_document, node_path, registry_of
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import failure
from sgl_kvc.core.passes import StepWork, advance, pass_tables, start_pass
from sgl_kvc.core.reconstruction import CarriedScores, carry_scores
from sgl_kvc.core.request_state import Budget, ReqKvState
from sgl_kvc.policies import HeadSelection

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch


def due(compressor: Host, batch: ScheduleBatch) -> list[tuple[int, DocumentKey]]:
    """The requests of `batch` whose row holds their extension exact now (`extension_due`), the
    first in the batch of each extension not resident. One whose row was compacted before its
    extension was read will not publish it: requests waiting for it go."""
    registry = registry_of(getattr(batch, "tree_cache", None))
    if registry is None:
        return []
    out, seen = [], set()
    for i, req in enumerate(batch.reqs):
        if req.finished() or plan_of(req).extends is None:
            continue
        key = plan_of(req).key
        if extension_due(req, int(batch.seq_lens_cpu[i])) is None:
            if extension_lost(req):
                registry.settle(key, req)
            continue
        if key.digest in seen or registry.get(key) is not None:
            continue
        seen.add(key.digest)
        out.append((i, key))
    return out


def publish(compressor: Host, batch: ScheduleBatch, items: list[tuple[int, DocumentKey]]) -> None:
    """Choose, copy and publish each item's extension; a failure (anywhere in it, on any rank)
    loses that extension only."""
    if not items:
        return
    copy_and_publish(compressor, batch, items,
                     lambda i, key: _chain_state(compressor, key, _parent(batch, i)),
                     lambda i, key: _row_entries(key, _parent(batch, i)),
                     lambda i, key, state: _choose(compressor, batch, i, key, _parent(batch, i), state),
                     lambda r: _node(batch, r), lambda r, doc: _insert(compressor, batch, r, doc))


def adopt(compressor: Host, batch: ScheduleBatch, items: list[tuple[int, DocumentKey]]) -> None:
    """After the chunk moment: each request of `items` (indices whose chunk ended at the end of
    the extension they publish, `DocumentPlan.ended_at`) whose extension is resident now (published
    from its row right after that chunk, `publish`, or by another request meanwhile) goes on as a
    request that started from it: its row becomes the chain's slots, its own exact entries of the
    extension are freed, and it reads its question from what the conversation keeps, as a
    `SPLIT` request reads its own from its document's cut and as every later request with that
    document does. Where the extension is not resident (its publication failed), it reads its
    question after its extension exact. A failure fails that request alone."""
    registry = registry_of(getattr(batch, "tree_cache", None))
    if registry is None:
        return
    for i, key in items:
        req = batch.reqs[i]
        doc = registry.get(key)
        if doc is None or req.finished() or compressor.state(req) is None or failure(req) is not None:
            continue
        compressor.failures.guarded(req, "compress", _adopt, compressor, batch, i, doc)


def _adopt(compressor: Host, batch: ScheduleBatch, i: int, doc: Document) -> None:
    """Everything that can fail first (nothing changed then); then the new lock, the old one's
    release, and plain assignments."""
    from sgl_kvc.adapter.moments.compaction import set_seq_len
    from sgl_kvc.adapter.scheduling.requests import shifted_fill_ids

    req, tree = batch.reqs[i], batch.tree_cache
    kv, r2t = req.kv, batch.req_to_token_pool.req_to_token
    chain = node_path(doc.node)[1]
    k, n, held = int(chain.numel()), int(batch.seq_lens_cpu[i]), int(kv.cache_protected_len)
    if k != doc.chain_slots or not 0 < held <= n:
        raise RuntimeError(f"its extension's chain has {k} slots ({doc.chain_slots} expected); "
                           f"its row {n}, {held} of them the tree's")
    failpoints.check("adopt_raise", req)
    own = r2t[kv.req_pool_idx, held:n].to(torch.int64, copy=True)  # the extension's tokens it read, exact
    state = compressor.state_from(req, doc)
    start = plan_of(req).start
    lock = tree.lock(doc.node)  # first: the new node is never unlocked in between
    try:
        tree.unlock(req.lock)
    except BaseException:
        tree.unlock(lock)
        raise
    req.lock, req.last_node = lock, doc.node
    kv.cache_protected_len = kv.kv_committed_len = kv.kv_allocated_len = k
    r2t[kv.req_pool_idx, :k] = chain.to(device=r2t.device, dtype=r2t.dtype)
    set_seq_len(batch, i, k)
    # The next chunk extends the chain's slots (SGLang resumes at `prefix_len`, set from
    # `extend_end`), and its usage counts no cache hit for them (`already_computed`): the tokens
    # they stand for past its start were read by this request.
    req.prefix_len = req.extend_end = req.already_computed = k
    batch.token_to_kv_pool_allocator.free(own.to(chain.device))
    started_from(req, doc)
    if start is not None and start.exact:
        kvc_req.of(req).read_turn = start  # which the turn it keeps supersedes (`turns.supersedes`)
    compressor.set_state(req, state)
    shifted_fill_ids(req, doc.offset)


def _parent(batch: ScheduleBatch, i: int) -> Document:
    parent = plan_of(batch.reqs[i]).extends
    if parent is None:
        raise RuntimeError("it extends no resident document")
    return parent


def _row_entries(key: DocumentKey, parent: Document) -> int:
    """The row's entries the extension's pass reads: the chain's slots, then its own tokens."""
    return parent.chain_slots + key.tokens - parent.key.tokens


def _chain_state(compressor: Host, key: DocumentKey, parent: Document) -> ReqKvState:
    """The extension's pass state: a row that starts from `parent`, as a request's that started
    from it (`request_life.begin` for a hit), with nothing of its own compacted."""
    store = compressor.store
    state = ReqKvState(policy=compressor.policy(key.policy, key.entries), budget=Budget(key.entries),
                       selection="per-head", device=store.device)
    parent.start(state, store.device)
    return state


def _choose(compressor: Host, batch: ScheduleBatch, i: int, key: DocumentKey, parent: Document,
            state: ReqKvState) -> Chosen:
    """The extension's pass: its own kept entries (nothing copied)."""
    store = compressor.store
    req = batch.reqs[i]
    row = req.kv.req_pool_idx
    failpoints.check("document_raise", req)
    n = _row_entries(key, parent)
    # a rebuild holds none of the chain's entries: it chooses among them all
    held = 0 if key.kind is Kind.REBUILD else parent.chain_slots
    own = key.entries - key.parent_entries
    slots = store.req_to_token[row, :n].to(torch.int64)
    if not torch.equal(slots[:parent.chain_slots].cpu(), node_path(parent.node)[1].cpu()):
        raise RuntimeError("its row does not start with the slots of the document it extends")
    tables = pass_tables(store, compressor.config.kv_head_budget, state.policy, state, slots)
    packed = tables is not None
    # uniform: every head keeps the chain's `held` entries and `own` of its own; packed, each head
    # its chain's entries, and the request `own` per head of its own, by the policy's allocation
    state.pending = start_pass(store, row, state, state.policy, n, own if packed else held + own, "prefill",
                               tables, held=held)
    scores = state.pending.reconstruction
    due_pass = advance(store, row, state, n, StepWork.unlimited(), compressor.config.kv_head_budget, i)
    if due_pass is None:
        raise RuntimeError("an unlimited extension pass did not finish")
    selection = due_pass.selection
    device = selection.indices.device
    if packed and held:
        held_lens = state.unit_lens.long().to(device)
    else:  # (a rebuild holds nothing, whether or not the chain it compresses again was packed)
        held_lens = torch.full_like(selection.lengths, held)
    mine, cols = _own(selection, held_lens)
    carried = None
    if scores is not None:
        chain = carry_scores(scores, selection, per_head_lengths=packed)
        at = chain.layers[0].device
        lengths = [m.to(at) for m in mine.lengths.unbind(0)] if packed else None
        carried = CarriedScores(chain.end, [s.gather(1, c.to(at)) for s, c in zip(chain.layers, cols)], lengths)
    positions = due_pass.kept_positions
    positions = positions.gather(-1, cols.to(positions.device)) * mine.valid().to(positions.device)
    metadata = compact_bytes(mine.total, int(mine.lengths.numel()), packed, carried is not None)
    return Chosen(i, key, slots, mine, due_pass.units, positions, carried, metadata,
                  unit_lens=mine.lengths if packed else None, parent=parent)


def _own_columns(selection: HeadSelection, held_lens: Tensor) -> Tensor:
    """Where each head's own entries are in `selection`'s columns: after its held ones."""
    width = int((selection.lengths - held_lens).max()) if selection.lengths.numel() else 0
    cols = held_lens[..., None] + torch.arange(width, device=held_lens.device)
    return cols.clamp(max=max(selection.max_keep - 1, 0))


def _own(selection: HeadSelection, held_lens: Tensor) -> tuple[HeadSelection, Tensor]:
    """The entries `selection` keeps after each head's first `held_lens`, which it must keep
    (the chain's: a pass that held them keeps them first, in order), and their columns in
    `selection` (`_own_columns`)."""
    cols = torch.arange(selection.max_keep, device=held_lens.device)
    first = cols < held_lens[..., None]
    if not bool(((selection.indices == cols) | ~first).all()) or bool((selection.lengths < held_lens).any()):
        raise RuntimeError("the extension's pass did not keep the entries of the document it extends")
    lengths = selection.lengths - held_lens
    cols = _own_columns(selection, held_lens)
    own = selection.indices.gather(-1, cols)
    valid = torch.arange(own.shape[-1], device=own.device) < lengths[..., None]
    return HeadSelection(indices=torch.where(valid, own, HeadSelection.PAD), lengths=lengths, n=selection.n), cols


def _node(batch: ScheduleBatch, r: Ready) -> Compressed:
    """The extension's metadata (before the last vote: it can fail); a rebuild's has no parent."""
    c = r.chosen
    parent = None if c.key.kind is Kind.REBUILD else c.parent
    failpoints.check("node_raise", batch.reqs[c.i])
    return Compressed.compact(c.key, None, c.kept_positions, int(r.dest.numel()), c.unit_lens, c.carried, parent=parent)


def _insert(compressor: Host, batch: ScheduleBatch, r: Ready, doc: Compressed) -> None:
    """The extension's node: a child of its parent's (`registry.insert_child`); a rebuild's, a
    document of its own under the root (`insert_document`). After the vote: plain inserts."""
    c, tree, parent = r.chosen, batch.tree_cache, doc.parent
    doc.node = insert_document(tree, c.key, r.dest) if parent is None else insert_child(tree, parent, c.key, r.dest)
    registry_of(tree).add(doc)
    trace_document(compressor, batch.reqs[c.i], doc)
