"""Compaction of requests' KV rows in SGLang: keep some entries, give the other slots back.

SGLang keeps one slot table (`req_to_token`) for all layers and heads and runs attention with
page size 1 over it. A compaction moves each request's kept entries into the first slots it
owns (`sgl_kvc.core.compaction`), rewrites its row to those slots, shortens its lengths and
frees the rest through the allocator.

Per-head (`--kv-selection per-head`, KV-Compress §4.2 with page size 1): every (layer, KV head)
keeps its own k entries, packed into k slots the request owns: slot `row[j]` then holds, in KV
head h of layer l, the j-th kept entry of (l, h), so each head's tokens differ while the row,
the slot count and SGLang's page-size-1 attention stay as they are (a decode query attends to
every entry of its head, whatever token each is). A shared selection is the per-head one with
the same entries in every head. Variable budgets (the unit pool): kept entries of any layer and
head fill the request's first G = ceil(total / (L x H_kv)) slots unit by unit.

The radix rule (docs/architecture.md): the tree only ever holds full, exact KV. The request's
row positions [0, cache_protected_len) are slots owned by the tree (matched or checkpointed
prefix, locked by the request). They are never written or freed here: kept entries move into
slots the request owns, or into newly allocated ones where it owns fewer than it keeps (a long
prefix hit); then it drops its lock, so the tree's nodes become ordinary evictable cache and
later requests with the same prefix still hit them. The request is marked
`skip_radix_cache_insert`, so at finish SGLang inserts nothing of it into the tree.

Order, so a failure never leaves the pool inconsistent: plan every request (nothing changed),
move the kept entries (into slots no other row references), rewrite each row, then free the
slots of the rows that were rewritten. A request whose row rewrite fails keeps its old row
(SGLang frees it when the request is aborted) and gives back only its newly allocated slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from sgl_kvc.adapter import failpoints, invariants
from sgl_kvc.core.compaction import UnitMoves, move_unit_entries, move_units_many, packed_slots, unit_moves
from sgl_kvc.policies import HeadSelection


@dataclass(frozen=True)
class CompactionResult:
    kept: int  # slots the request's row holds after it (G for a packed request)
    freed: int  # slots returned to the allocator
    copied: int  # slots newly allocated for kept tree-owned entries (a long prefix hit)
    units: Tensor | None = None  # a packed request's new tables [L, H_kv, K] (unit pool)


class CompactionSkipped(RuntimeError):
    """Not enough free slots to privatise the kept tree-owned entries; nothing was changed."""


@dataclass(frozen=True)
class _Plan:
    i: int
    dest: Tensor  # the slots the request's row holds after the compaction
    evicted: Tensor  # owned slots given back
    copied: int  # slots newly allocated (the last of `dest`)
    row: Tensor | None = None  # per-head: the slots before, and each head's kept indices
    indices: Tensor | None = None
    units: UnitMoves | None = None  # unit pool: the entries' moves


def compact_requests_per_head(
    batch: Any, items: Sequence[tuple[int, HeadSelection]], other_batches: tuple[Any, ...] = ()
) -> list[CompactionResult | Exception]:
    """Per-head compaction of several requests of `batch` at once (those due in the same step).
    Each keeps, in every (layer, KV head), its own entries `selection.kept(l, h)` (physical
    indices of its row; the same count in every head: a uniform per-head budget). One gather +
    scatter per layer moves every request's kept entries and one call frees every evicted
    slot. Per item: its result, or the exception that left that request unchanged
    (`CompactionSkipped`: no free slot to privatise a long prefix hit)."""

    def plan(item: tuple[int, HeadSelection]) -> tuple[_Plan, CompactionResult]:
        i, selection = item
        n = int(batch.seq_lens_cpu[i])
        k = selection.max_keep
        if selection.n != n or not bool((selection.lengths == k).all()):
            raise ValueError(
                f"per-head compaction needs {n} entries and one count for every head, got "
                f"n={selection.n}, counts {sorted(set(selection.lengths.flatten().tolist()))}"
            )
        row = _row(batch, i)
        dest, evicted, copied = _destinations(batch, i, k)
        p = _Plan(i, dest, evicted, copied, row=row, indices=selection.indices.to(row.device))
        return p, CompactionResult(k, int(evicted.numel()), copied)

    def move(plans: list[_Plan]) -> None:
        pool = batch.token_to_kv_pool_allocator.get_kvcache()
        move_units_many(pool, [(p.row, p.indices, p.dest) for p in plans])

    return _compact_many(batch, items, plan, move, other_batches)


def compact_requests_units(
    batch: Any, items: Sequence[tuple[int, HeadSelection, Tensor]], unit_pools: tuple[Any, Any],
    other_batches: tuple[Any, ...] = (),
) -> list[CompactionResult | Exception]:
    """Variable per-head budgets on the unit pool (KV-Compress §4.2): several requests of
    `batch` at once. Item (i, selection, units): request i keeps, in (layer l, KV head h), the
    entries `selection.kept(l, h)` (columns of its per-head tables, `units` [L, H_kv, N]).
    Its kept entries, in (layer, head, column) order, fill the units of its first
    G = ceil(total / (L x H_kv)) owned slots (KV-Compress Alg. 1's MoveCache with a one-unit
    block); every other slot it owns is freed. Per item: its result (with the new tables) or
    the exception that left it unchanged."""
    allocator = batch.token_to_kv_pool_allocator

    def plan(item: tuple[int, HeadSelection, Tensor]) -> tuple[_Plan, CompactionResult]:
        i, selection, units = item
        if units.shape[-1] != selection.n:
            raise ValueError(f"a selection over {selection.n} columns for tables of {units.shape[-1]}")
        g = packed_slots(selection)
        dest, evicted, copied = _destinations(batch, i, g)  # last: it may allocate
        try:
            moves = unit_moves(selection, units, dest)
        except BaseException:
            _give_back_copied(allocator, dest, copied)  # not planned yet: here, not by the driver
            raise
        return _Plan(i, dest, evicted, copied, units=moves), CompactionResult(
            g, int(evicted.numel()), copied, units=moves.table
        )

    def move(plans: list[_Plan]) -> None:
        move_unit_entries(unit_pools, [p.units for p in plans])

    return _compact_many(batch, items, plan, move, other_batches)


def _compact_many(
    batch: Any, items: Sequence[Any], plan: Callable[[Any], tuple[_Plan, CompactionResult]],
    move: Callable[[list[_Plan]], None], other_batches: tuple[Any, ...],
) -> list[CompactionResult | Exception]:
    """What the batched compactions share: `plan(item)` plans one request alone or raises
    `CompactionSkipped` / `ValueError` for it alone; `move(plans)` moves every planned
    request's kept entries at once; then each row is rewritten, the slots of the rewritten
    rows freed in one call, and the invariants checked once."""
    allocator = batch.token_to_kv_pool_allocator
    outcomes: list[CompactionResult | Exception] = []
    planned: list[tuple[int, _Plan]] = []  # (index in outcomes, plan)
    try:
        for item in items:
            try:
                p, result = plan(item)
                planned.append((len(outcomes), p))
                outcomes.append(result)
            except (CompactionSkipped, ValueError) as e:
                outcomes.append(e)
        if not planned:
            return outcomes
        move([p for _, p in planned])
    except BaseException:
        # No request was changed yet: give back the slots allocated for long prefix hits,
        # which no row references (the requests keep their rows and are aborted by the caller).
        for _, p in planned:
            _give_back_copied(allocator, p.dest, p.copied)
        raise
    done, evicted = [], []
    for k, p in planned:
        try:
            _finish(batch, p.i, p.dest)
        except Exception as e:  # noqa: BLE001 - this request alone fails (its caller aborts it)
            _give_back_copied(allocator, p.dest, p.copied)  # its old row still owns the rest
            outcomes[k] = e
            continue
        done.append(batch.reqs[p.i])
        evicted.append(p.evicted)
    leaky = any(failpoints.hits("leak_slot", req) for req in done)
    freed = (_free(allocator, torch.cat(evicted), leaky) if evicted
             else torch.zeros(0, dtype=torch.int64, device=batch.req_to_token_pool.req_to_token.device))
    if done and invariants.enabled():
        invariants.check_after_compaction([batch, *other_batches], done, freed)
    return outcomes


def _row(batch: Any, i: int) -> Tensor:
    """Request i's slots (its first seq_len entries), int64."""
    n = int(batch.seq_lens_cpu[i])
    return batch.req_to_token_pool.req_to_token[batch.reqs[i].kv.req_pool_idx, :n].to(torch.int64)


def _give_back_copied(allocator: Any, dest: Tensor, copied: int) -> None:
    """Free the `copied` slots `_destinations` newly allocated (the last of `dest`), for a
    request whose compaction will not happen."""
    if copied:
        allocator.free(dest[dest.numel() - copied :])


def _destinations(batch: Any, i: int, g: int) -> tuple[Tensor, Tensor, int]:
    """(the g slots a compaction of request i writes, the owned slots it gives back, how many
    of the g were newly allocated). The request's own slots come first (the tree's are never
    written); only a request owning fewer than g (a long prefix hit) needs new ones."""
    row = _row(batch, i)
    owned = row[int(batch.reqs[i].kv.cache_protected_len):]
    need = max(0, g - int(owned.numel()))
    if not need:
        return owned[:g], owned[g:], 0
    _make_room_in_tree(batch.tree_cache, need)  # the request's own path is still locked
    allocator = batch.token_to_kv_pool_allocator
    if allocator.available_size() < need:
        raise CompactionSkipped(f"no {need} free slots to privatise the kept prefix")
    fresh = allocator.alloc(need).to(device=row.device, dtype=torch.int64)
    return torch.cat([owned, fresh]), owned[:0], need


def _make_room_in_tree(tree_cache: Any, need: int) -> None:
    """Let SGLang evict unlocked tree nodes until `need` slots are free (if it can)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    evict_from_tree_cache(tree_cache, need)


def _free(allocator: Any, slots: Tensor, leak: bool = False) -> Tensor:
    if leak and slots.numel():
        slots = slots[1:]  # planted accounting error (tests of SGLKVC_CHECK)
    if slots.numel():
        allocator.free(slots)
    return slots


def _finish(batch: Any, i: int, new_row: Tensor) -> None:
    """Write the request's new row, then its lengths, then drop its tree lock. Everything that
    can fail (the planted fault, the write itself) comes before the first change."""
    req = batch.reqs[i]
    kv = req.kv
    failpoints.maybe_raise("rewrite_raise", req, "rewriting the row of")
    k = int(new_row.numel())
    r2t = batch.req_to_token_pool.req_to_token
    r2t[kv.req_pool_idx, :k] = new_row.to(r2t.dtype)
    kv.kv_committed_len = k
    kv.kv_allocated_len = k
    req.skip_radix_cache_insert = True
    _set_len(batch, i, k)
    if int(kv.cache_protected_len) > 0:
        batch.tree_cache.unlock(req.lock)
        req.lock = None
        kv.cache_protected_len = 0


def _set_len(batch: Any, i: int, k: int) -> None:
    # New tensors rather than in-place writes: earlier forward inputs may still reference them.
    for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
        t = getattr(batch, name, None)
        if t is not None:
            t = t.clone()
            t[i] = k
            setattr(batch, name, t)
    batch.seq_lens_sum = None
