"""Compaction of one request's KV row: keep some tokens, give the others back at once.

SGLang keeps one slot table (`req_to_token`) for all layers and heads and runs attention with
page size 1 over it, so a compaction moves no KV data: it rewrites the request's row to the
kept slots, frees the evicted slots through the allocator and shortens the request's lengths.

Per-head compaction (`compact_requests_per_head`, KV-Compress §4.2 with page size 1): every
(layer, KV head) keeps its own `k` entries. They are packed into `k` slots the request owns:
slot `row[j]` then holds, in KV head h of layer l, the j-th kept entry of (l, h), so each head's
tokens differ while the row, the slot count and SGLang's page-size-1 attention stay as they are
(a decode query attends to every entry of its head, whatever token each entry is). The other
slots go back to the allocator: the evicted (token, head) pairs are really freed.

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
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from sgl_kvc.adapter import failpoints, invariants
from sgl_kvc.policies import HeadSelection


@dataclass(frozen=True)
class CompactionResult:
    kept: int  # entries (slots) the request's row holds after it
    freed: int  # slots returned to the allocator
    copied: int  # tree-owned slots copied into private ones
    units: Tensor | None = None  # a packed request's new tables [L, H_kv, K] (unit pool)


class CompactionSkipped(RuntimeError):
    """Not enough free slots to privatise the kept tree-owned tokens; nothing was changed."""


def compact_request(
    batch: Any, i: int, keep: Tensor, other_batches: tuple[Any, ...] = ()
) -> CompactionResult:
    """Keep physical indices `keep` (sorted, unique) of request `batch.reqs[i]`, in every layer
    and head. `other_batches` hold the other running requests (only read by the invariant check)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    req = batch.reqs[i]
    kv = req.kv
    allocator = batch.token_to_kv_pool_allocator
    n = int(batch.seq_lens_cpu[i])
    row = batch.req_to_token_pool.req_to_token[kv.req_pool_idx, :n].to(torch.int64)
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
        evict_from_tree_cache(batch.tree_cache, shared)
        if allocator.available_size() + int(evicted_owned.numel()) < shared:
            raise CompactionSkipped(f"no {shared} free slots to privatise the kept prefix")
    evicted_owned = _free(allocator, evicted_owned)
    if shared:
        private = allocator.alloc(shared).to(device=row.device, dtype=torch.int64)
        copy_slots(allocator.get_kvcache(), private, new_row[:shared])
        new_row[:shared] = private
    _finish(batch, i, new_row)
    if invariants.enabled():
        invariants.check_after_compaction([batch, *other_batches], [req], evicted_owned)
    return CompactionResult(kept=k, freed=int(evicted_owned.numel()), copied=shared)


def compact_requests_per_head(
    batch: Any, items: Sequence[tuple[int, HeadSelection]], other_batches: tuple[Any, ...] = ()
) -> list[CompactionResult | Exception]:
    """Per-head compaction of several requests of `batch` at once (those due in the same step).
    Each keeps, in every (layer, KV head), its own entries `selection.kept(l, h)` (physical
    indices of its row; the same count in every head: a uniform per-head budget). Each is planned
    alone, then one gather + scatter per layer moves every request's kept units
    and one call frees every evicted slot. Per item: its result, or the exception that left that
    request unchanged (`CompactionSkipped`: no free slot to privatise a long prefix hit)."""
    allocator = batch.token_to_kv_pool_allocator

    def plan(item: tuple[int, HeadSelection]) -> tuple[_PerHeadPlan, CompactionResult]:
        i, selection = item
        p = _plan_per_head(batch, i, selection)
        return p, CompactionResult(selection.max_keep, int(p.evicted.numel()), p.copied)

    def move(plans: list[_PerHeadPlan]) -> None:
        move_units_many(allocator.get_kvcache(), [(p.row, p.indices, p.dest) for p in plans])

    return _compact_many(batch, items, plan, move, other_batches)


def _compact_many(
    batch: Any, items: Sequence[Any], plan: Callable[[Any], tuple[Any, CompactionResult]],
    move: Callable[[list[Any]], None], other_batches: tuple[Any, ...],
) -> list[CompactionResult | Exception]:
    """What the batched compactions share: `plan(item)` plans one request alone (its plan has
    `i`, `dest`, `evicted`, `copied`) or raises `CompactionSkipped` / `ValueError` for it alone;
    `move(plans)` moves every planned request's kept entries at once; then one call frees every
    evicted slot, the rows are rewritten and the invariants checked once."""
    allocator = batch.token_to_kv_pool_allocator
    outcomes: list[CompactionResult | Exception] = []
    plans: list[Any] = []
    try:
        for item in items:
            try:
                p, result = plan(item)
                plans.append(p)
                outcomes.append(result)
            except (CompactionSkipped, ValueError) as e:
                outcomes.append(e)
        if not plans:
            return outcomes
        move(plans)
    except BaseException:
        # No request was changed yet: give back the slots allocated for long prefix hits,
        # which no row references (the requests keep their rows and are aborted by the caller).
        for p in plans:
            _give_back_copied(allocator, p.dest, p.copied)
        raise
    freed = _free(allocator, torch.cat([p.evicted for p in plans]))
    for p in plans:
        _finish(batch, p.i, p.dest)
    if invariants.enabled():
        invariants.check_after_compaction(
            [batch, *other_batches], [batch.reqs[p.i] for p in plans], freed
        )
    return outcomes


@dataclass(frozen=True)
class _PerHeadPlan:
    i: int
    row: Tensor  # the request's slots before compaction
    indices: Tensor  # [L, H_kv, k] kept physical indices per head
    dest: Tensor  # [k] the slots entry j of every head moves to
    evicted: Tensor  # owned slots given back
    copied: int  # slots newly allocated (a long prefix hit)


def _plan_per_head(batch: Any, i: int, selection: HeadSelection) -> _PerHeadPlan:
    """Destinations: the request's own slots first (the tree's are never written); only a
    request that owns fewer than k slots (a long prefix hit) needs new ones."""
    kv = batch.reqs[i].kv
    n = int(batch.seq_lens_cpu[i])
    k = selection.max_keep
    if selection.n != n or not bool((selection.lengths == k).all()):
        raise ValueError(
            f"per-head compaction needs {n} entries and one count for every head, got "
            f"n={selection.n}, counts {sorted(set(selection.lengths.flatten().tolist()))}"
        )
    row = batch.req_to_token_pool.req_to_token[kv.req_pool_idx, :n].to(torch.int64)
    dest, evicted, need = _destinations(batch, i, k)
    return _PerHeadPlan(i, row, selection.indices.to(row.device), dest, evicted, need)


def compact_requests_units(
    batch: Any, items: Sequence[tuple[int, HeadSelection, Tensor]], unit_pools: tuple[Tensor, Tensor],
    other_batches: tuple[Any, ...] = (),
) -> list[CompactionResult | Exception]:
    """Variable per-head budgets on the unit pool (KV-Compress §4.2): several requests of
    `batch` at once. Item (i, selection, units): request i keeps, in (layer l, KV head h), the
    entries `selection.kept(l, h)` (columns of its per-head tables, `units` [L, H_kv, N]).
    Its kept entries, in (layer, head, column) order, fill the units of its first
    G = ceil(total / (L x H_kv)) owned slots (KV-Compress Alg. 1's MoveCache with a one-unit
    block, done as one gather + scatter for every request, so sources may sit in destinations);
    every other slot it owns is freed. Per item: its result (with the new tables) or the
    exception that left it unchanged."""
    allocator = batch.token_to_kv_pool_allocator

    def plan(item: tuple[int, HeadSelection, Tensor]) -> tuple[_UnitPlan, CompactionResult]:
        i, selection, units = item
        num_layers, num_heads = selection.num_layers, selection.num_heads
        per_slot = num_layers * num_heads
        g = -(-selection.total // per_slot)
        if units.shape[-1] != selection.n:
            raise ValueError(f"a selection over {selection.n} columns for tables of {units.shape[-1]}")
        valid = selection.valid()
        src = units.gather(-1, torch.where(valid, selection.indices, 0))[valid]
        rel = torch.arange(src.numel())  # kept entry e goes to unit e of the packed slots
        table = torch.zeros_like(selection.indices)
        dest, evicted, copied = _destinations(batch, i, g)  # last: it may allocate
        try:
            dst = dest[rel // per_slot] * per_slot + rel % per_slot
            table[valid] = dst  # (layer, head, column) order, as src
        except BaseException:
            _give_back_copied(allocator, dest, copied)  # not planned yet: here, not by the driver
            raise
        return _UnitPlan(i, src, dst, dest, evicted, copied), CompactionResult(
            g, int(evicted.numel()), copied, units=table
        )

    def move(plans: list[_UnitPlan]) -> None:
        src = torch.cat([p.src for p in plans])
        dst = torch.cat([p.dst for p in plans])
        for buf in unit_pools:
            buf[dst] = buf[src]  # the gather completes before the scatter

    return _compact_many(batch, items, plan, move, other_batches)


@dataclass(frozen=True)
class _UnitPlan:
    i: int
    src: Tensor  # units the kept entries are read from, in (layer, head, column) order
    dst: Tensor  # units they are written to
    dest: Tensor  # the packed slots
    evicted: Tensor  # owned slots given back
    copied: int  # slots newly allocated (a long prefix hit)


def _give_back_copied(allocator: Any, dest: Tensor, copied: int) -> None:
    """Free the `copied` slots `_destinations` newly allocated (the last of `dest`), for a
    request whose compaction will not happen."""
    if copied:
        allocator.free(dest[dest.numel() - copied :])


def _destinations(batch: Any, i: int, g: int) -> tuple[Tensor, Tensor, int]:
    """(the g slots a compaction of request i writes, the owned slots it gives back, how many
    of the g were newly allocated). The request's own slots come first (the tree's are never
    written); only a request owning fewer than g (a long prefix hit) needs new ones."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    kv = batch.reqs[i].kv
    allocator = batch.token_to_kv_pool_allocator
    n = int(batch.seq_lens_cpu[i])
    row = batch.req_to_token_pool.req_to_token[kv.req_pool_idx, :n].to(torch.int64)
    owned = row[int(kv.cache_protected_len):]
    need = max(0, g - int(owned.numel()))
    if not need:
        return owned[:g], owned[g:], 0
    evict_from_tree_cache(batch.tree_cache, need)  # the request's own path is still locked
    if allocator.available_size() < need:
        raise CompactionSkipped(f"no {need} free slots to privatise the kept prefix")
    fresh = allocator.alloc(need).to(device=row.device, dtype=torch.int64)
    return torch.cat([owned, fresh]), owned[:0], need


def move_units(pool: Any, row: Tensor, indices: Tensor, dest: Tensor) -> None:
    """Per layer l and KV head h: entry j of (l, h) <- entry indices[l, h, j] of the row.

    Each layer's kept (token, head) units are gathered into a temporary before any is written,
    so sources may sit anywhere, destinations included (KV-Compress Alg. 1's MoveCache, done as
    gather + scatter). Works on SGLang's tensors and on the FP8 pool's `Fp8Rows` (codes and
    scales move together, no re-quantization)."""
    move_units_many(pool, [(row, indices, dest)])


def move_units_many(pool: Any, moves: Sequence[tuple[Tensor, Tensor, Tensor]]) -> None:
    """`move_units` for several requests (row, indices, dest) in one gather + scatter per layer
    and buffer. Requests own disjoint slots, so their moves do not interfere."""
    start = int(getattr(pool, "start_layer", 0))
    num_layers, num_heads = int(moves[0][1].shape[0]), int(moves[0][1].shape[1])
    device = moves[0][0].device
    heads = torch.arange(num_heads, device=device)[:, None]  # [H, 1]
    dest = torch.cat([d for _, _, d in moves])
    dst = dest[None, :].expand(num_heads, int(dest.numel()))
    for layer in range(num_layers):
        src = torch.cat([row[indices[layer]] for row, indices, _ in moves], dim=1)  # [H, sum k]
        for buf in pool.get_kv_buffer(start + layer):
            buf[dst, heads] = buf[src, heads]


def _free(allocator: Any, slots: Tensor) -> Tensor:
    if failpoints.active("leak_slot") and slots.numel():
        slots = slots[1:]  # planted accounting error (tests of SGLKVC_CHECK)
    if slots.numel():
        allocator.free(slots)
    return slots


def _finish(batch: Any, i: int, new_row: Tensor) -> None:
    """Drop the tree lock, write the request's new row and lengths."""
    req = batch.reqs[i]
    kv = req.kv
    if int(kv.cache_protected_len) > 0:
        batch.tree_cache.unlock(req.lock)
        req.lock = None
        kv.cache_protected_len = 0
    k = int(new_row.numel())
    r2t = batch.req_to_token_pool.req_to_token
    r2t[kv.req_pool_idx, :k] = new_row.to(r2t.dtype)
    kv.kv_committed_len = k
    kv.kv_allocated_len = k
    req.skip_radix_cache_insert = True
    _set_len(batch, i, k)


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
