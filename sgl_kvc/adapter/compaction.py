"""Compaction of one request's KV row: keep some tokens, give the others back at once.

SGLang keeps one slot table (`req_to_token`) for all layers and heads and runs attention with
page size 1 over it, so a compaction moves no KV data: it rewrites the request's row to the
kept slots, frees the evicted slots through the allocator and shortens the request's lengths.

The radix rule (docs/radix-and-eviction.md): the tree only ever holds full, exact KV. The
request's row positions [0, cache_protected_len) are slots owned by the tree (matched or
checkpointed prefix, locked by the request). A compacting request copies the kept ones of those
into private slots, then drops its lock, so the tree's nodes become ordinary evictable cache and
later requests with the same prefix still hit them. Slots the request owns and evicts are freed.
Tree-owned slots are never freed here. The request is marked `skip_radix_cache_insert`, so at
finish SGLang inserts nothing of it into the tree (its row no longer matches its token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.adapter import failpoints, invariants


@dataclass(frozen=True)
class CompactionResult:
    kept: int
    freed: int  # slots returned to the allocator
    copied: int  # tree-owned slots copied into private ones


class CompactionSkipped(RuntimeError):
    """Not enough free slots to privatise the kept tree-owned tokens; nothing was changed."""


def compact_request(
    batch: Any, i: int, keep: Tensor, other_batches: tuple[Any, ...] = ()
) -> CompactionResult:
    """Keep physical indices `keep` (sorted, unique) of request `batch.reqs[i]`.
    `other_batches` hold the other running requests (only read by the invariant check)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    req = batch.reqs[i]
    kv = req.kv
    tree = batch.tree_cache
    allocator = batch.token_to_kv_pool_allocator
    r2t = batch.req_to_token_pool.req_to_token
    n = int(batch.seq_lens_cpu[i])
    row = r2t[kv.req_pool_idx, :n].to(torch.int64)
    keep = keep.to(device=row.device, dtype=torch.int64)
    k = int(keep.numel())

    mask = torch.zeros(n, dtype=torch.bool, device=row.device)
    mask[keep] = True
    protected = int(kv.cache_protected_len)
    owned = torch.arange(n, device=row.device) >= protected
    evicted_owned = row[owned & ~mask]
    new_row = row[keep]

    shared = int((keep < protected).sum())  # keep is sorted: these come first
    if shared:
        # Make room while the tree path is still locked, so eviction cannot take the sources;
        # check before changing anything, so a skipped compaction leaves the request intact.
        evict_from_tree_cache(tree, shared)
        if allocator.available_size() + int(evicted_owned.numel()) < shared:
            raise CompactionSkipped(f"no {shared} free slots to privatise the kept prefix")
    if failpoints.active("leak_slot") and evicted_owned.numel():
        evicted_owned = evicted_owned[1:]  # planted accounting error (tests of SGLKVC_CHECK)
    freed = int(evicted_owned.numel())
    if freed:
        allocator.free(evicted_owned)
    if shared:
        private = allocator.alloc(shared).to(device=row.device, dtype=torch.int64)
        copy_slots(allocator.get_kvcache(), private, new_row[:shared])
        new_row[:shared] = private
    if protected > 0:
        tree.unlock(req.lock)
        req.lock = None
        kv.cache_protected_len = 0

    r2t[kv.req_pool_idx, :k] = new_row.to(r2t.dtype)
    kv.kv_committed_len = k
    kv.kv_allocated_len = k
    req.skip_radix_cache_insert = True
    _set_len(batch, i, k)
    if invariants.enabled():
        invariants.check_after_compaction([batch, *other_batches], req, evicted_owned)
    return CompactionResult(kept=k, freed=freed, copied=shared)


def copy_slots(pool: Any, dst: Tensor, src: Tensor) -> None:
    """Copy the KV of slots `src` into slots `dst`, every layer (SGLang's own move needs a
    copy kernel that is only set up for speculative decoding)."""
    start = int(getattr(pool, "start_layer", 0))
    for layer_id in range(start, start + int(pool.layer_num)):
        k, v = pool.get_kv_buffer(layer_id)
        k[dst] = k[src]
        v[dst] = v[src]


def _set_len(batch: Any, i: int, k: int) -> None:
    # New tensors rather than in-place writes: earlier forward inputs may still reference them.
    for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
        t = getattr(batch, name, None)
        if t is not None:
            t = t.clone()
            t[i] = k
            setattr(batch, name, t)
    batch.seq_lens_sum = None
