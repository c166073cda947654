"""Pool and radix-tree invariants around a compaction, checked when `SGLKVC_CHECK=1`.

Costly (it walks the whole tree), so off in production; the end-to-end tests turn it on, and a
violation raises inside the scheduler, which stops the server and fails the test.
- a freed slot is held by neither the radix tree nor any running request;
- a compacted request holds no tree-owned slot (it copied the ones it kept);
- accounting: free + tree + slots owned by running requests == pool size;
- shared documents (`check_documents`): each registered document is its node, in the tree, with
  one slot per kept entry and the positions of its D tokens, and their metadata is within what
  the KV memory reserved for it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch

CHECK_ENV = "SGLKVC_CHECK"


class InvariantViolation(AssertionError):
    pass


def enabled() -> bool:
    return os.environ.get(CHECK_ENV, "") not in ("", "0")


def _rows(batches: list[ScheduleBatch]) -> list[tuple[Req, set[int], int]]:
    """(req, slots of its row, slots it owns) for every request of the given batches, once."""
    seen, out = set(), []
    for batch in batches:
        for j, req in enumerate(batch.reqs):
            if id(req) in seen or req.kv.req_pool_idx is None:
                continue
            seen.add(id(req))
            n = int(batch.seq_lens_cpu[j])
            row = set(batch.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].tolist())
            out.append((req, row, n - int(req.kv.cache_protected_len)))
    return out


def check_after_compaction(batches: list[ScheduleBatch], compacted: list[Req], freed: Tensor) -> None:
    """`batches`: every batch holding running requests (the compacted one first);
    `compacted`: the requests just compacted; `freed`: the slots they gave back."""
    batch = batches[0]
    tree = batch.tree_cache
    tree_slots = set(tree.all_values_flatten().tolist()) if tree.total_size() else set()
    freed_set = set(freed.tolist())
    if freed_set & tree_slots:
        raise InvariantViolation(f"freed {len(freed_set & tree_slots)} slot(s) the radix tree holds")
    owned = 0
    for other, row, n_owned in _rows(batches):
        owned += n_owned
        mine = any(other is req for req in compacted)
        if not mine and freed_set & row:  # a compacted row may reuse its own freed slots
            raise InvariantViolation(f"freed slot(s) still used by request {other.rid}")
        if mine and row & tree_slots:
            raise InvariantViolation("a compacted request still references tree-owned slots")
    allocator = batch.token_to_kv_pool_allocator
    total = allocator.size
    check_documents(tree)
    accounted = allocator.available_size() + len(tree_slots) + owned
    if accounted != total:
        raise InvariantViolation(
            f"pool accounting: free {allocator.available_size()} + tree {len(tree_slots)} "
            f"+ owned by running requests {owned} = {accounted} != {total}"
        )


def check_documents(tree: Any) -> None:
    """The registry of compressed documents agrees with the tree that holds them."""
    registry = getattr(tree, "documents", None)
    if registry is None:
        return
    budget = registry.metadata_budget
    if budget is not None and registry.metadata_bytes > budget:
        raise InvariantViolation(f"documents' metadata {registry.metadata_bytes} B over the {budget} B "
                                 "the KV memory reserved for it")
    held = sum(doc.metadata_bytes for doc in registry.by_key.values())
    if held != registry.metadata_bytes:
        raise InvariantViolation(f"documents' metadata counted {registry.metadata_bytes} B, held {held} B")
    indexed = sum(len(docs) for docs in registry.by_content.values()) + \
        sum(len(same) for after in registry.turns_after.values() for same in after.values())
    lengths = sum(sum(c.values()) for c in registry.lengths.values()) + \
        sum(sum(c.values()) for c in registry.turn_lengths.values())
    if indexed != len(registry.by_key) or lengths != len(registry.by_key):
        raise InvariantViolation(f"{indexed} documents indexed ({lengths} by length), {len(registry.by_key)} registered")
    for digest, doc in registry.by_key.items():
        above = doc.parent.lineage if doc.parent is not None else ()
        if doc.lineage != above + (doc,) or doc.chain_slots != sum(d.slots for d in doc.lineage):
            raise InvariantViolation(f"document {digest[:12]}: its chain is not its parent's and its own")
        node, k = doc.node, doc.entries
        if doc.parent is not None and (registry.by_key.get(doc.parent.key.digest) is not doc.parent
                                       or node.parent is not doc.parent.node):
            raise InvariantViolation(f"document {digest[:12]} extends one that is not its node's parent")
        if getattr(node, "sgl_kvc_document", None) is not doc or doc.key.digest != digest:
            raise InvariantViolation(f"document {digest[:12]} is not its node's")
        parent = node.parent
        if parent is None or parent.children.get(node.key.child_key(tree.page_size)) is not node:
            raise InvariantViolation(f"document {digest[:12]} is registered but not in the tree")
        if node.value is None or len(node.value) != doc.slots or len(node.key) != doc.slots:
            raise InvariantViolation(f"document {digest[:12]}: {doc.slots} slots, node of {len(node.key)} keys "
                                     f"and {None if node.value is None else len(node.value)} values")
        if doc.exact:  # a finished turn: one slot per token after its parent, no tables
            if doc.parent is None or doc.slots != doc.covers:
                raise InvariantViolation(f"turn {digest[:12]}: {doc.slots} slots for {doc.covers} tokens")
            continue
        kept = doc.kept_positions
        if doc.unit_lens is None and int(kept.shape[-1]) != k:
            raise InvariantViolation(f"document {digest[:12]}: {kept.shape[-1]} kept positions per head, not {k}")
        if doc.unit_lens is not None and int(doc.unit_lens.sum()) != kept.numel():  # packed: each head's own
            raise InvariantViolation(f"document {digest[:12]}: {kept.numel()} kept positions for "
                                     f"{int(doc.unit_lens.sum())} entries")
        first = 0 if doc.parent is None else doc.parent.key.tokens
        if kept.numel() and (int(kept.max()) >= doc.key.tokens or int(kept.min()) < first):
            raise InvariantViolation(f"document {digest[:12]}: kept positions outside its {doc.key.tokens} tokens")
