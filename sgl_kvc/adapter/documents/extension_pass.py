"""Publishing a document that extends a resident one (`matching.py`).

A request that started from a resident document its own extends holds, right after the forward
that read its extension (before SGLang processes the result, and before any pass of its own),
the parent's entries (the chain's slots, tree-owned) then its extension's exact entries. A pass
over those, by the document's question-free prompt policy, keeps every entry of the parent (held:
the chain above is shared, never chosen again) and chooses the extension's own entries among
its tokens, scored in the context of what the parent kept (KVzip repeats only the extension,
resuming from the scores the parent carries, as a request starting from the parent would). The
chosen entries are copied into fresh slots, which become a child node of the parent's in the
tree. The request's row is only read: it goes on as it was, and whatever fails here loses the
extension only (the next request that declares it tries again). A chain compressed again
(`Kind.REBUILD`: at its budget or depth, or a reply) holds none of the parent's entries: the same
pass keeps its budget among them all, into a document of its own (under the root, not under the
parent). As every publication, voted before anything is evicted or inserted
(`document_pass.copy_and_publish`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sgl_kvc.adapter.documents.document_pass import Chosen, Host, Ready, copy_and_publish, trace_document
from sgl_kvc.adapter.documents.keys import DocumentKey, Kind
from sgl_kvc.adapter.documents.links import Compressed, Document, compact_bytes
from sgl_kvc.adapter.documents.nodes import insert_child, insert_document, node_path
from sgl_kvc.adapter.documents.plan import declared, extends, extension_due, extension_lost
from sgl_kvc.adapter.documents.registry import registry_of
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.core.passes import StepWork, advance_uniform, advance_variable, start_pass
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
        if req.finished() or extends(req) is None:
            continue
        key = declared(req)
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
                     lambda r: _insert(compressor, batch, r))


def _parent(batch: ScheduleBatch, i: int) -> Document:
    parent = extends(batch.reqs[i])
    if parent is None:
        raise RuntimeError("it extends no resident document")
    return parent


def _row_entries(key: DocumentKey, parent: Document) -> int:
    """The row's entries the extension's pass reads: the chain's slots, then its own tokens."""
    return parent.chain_slots + key.tokens - parent.key.tokens


def _chain_state(compressor: Host, key: DocumentKey, parent: Document) -> ReqKvState:
    """The extension's pass state: a row that starts from `parent`, as a request's that started
    from it (`Compressor._begin` for a hit), with nothing of its own compacted."""
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
    packed = store.unit_layout is not None
    tables = state.tables(slots, *store.unit_layout) if packed else None
    # uniform: every head keeps the chain's `held` entries and `own` of its own; packed, each head
    # its chain's entries, and the request `own` per head of its own, by the policy's allocation
    state.pending = start_pass(store, row, state, state.policy, n, own if packed else held + own, "prefill",
                               tables, held=held)
    scores = state.pending.reconstruction
    if packed:
        due_pass = advance_variable(store, row, state, n, StepWork.unlimited(), compressor.config.kv_head_budget, i)
    else:
        due_pass = advance_uniform(store, row, state, n, StepWork.unlimited(), i)
    if due_pass is None:
        raise RuntimeError("an unlimited extension pass did not finish")
    selection = due_pass.selection
    device = selection.indices.device
    if packed:
        held_lens = state.unit_lens.long().to(device) * (held > 0)
    else:
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


def _insert(compressor: Host, batch: ScheduleBatch, r: Ready) -> None:
    """The extension's node: a child of its parent's (`nodes.insert_child`); a rebuild's, a
    document of its own under the root (`insert_document`)."""
    c = r.chosen
    tree = batch.tree_cache
    parent = None if c.key.kind is Kind.REBUILD else c.parent
    doc = Compressed.compact(c.key, None, c.kept_positions, int(r.dest.numel()), c.unit_lens, c.carried, parent=parent)
    doc.node = insert_document(tree, c.key, r.dest) if parent is None else insert_child(tree, parent, c.key, r.dest)
    registry_of(tree).add(doc)
    trace_document(compressor, batch.reqs[c.i], doc)
