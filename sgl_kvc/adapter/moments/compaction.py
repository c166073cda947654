"""Compaction of requests' KV rows in SGLang: keep some entries, give the other slots back.

SGLang keeps one slot table (`req_to_token`) for all layers and heads and runs attention with
page size 1 over it. A compaction moves each request's kept entries into the first slots it
owns (`sgl_kvc.core.moves`), rewrites its row to those slots, shortens its lengths and
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

Two phases, so that a failure never leaves the pool inconsistent and tensor-parallel ranks can
agree before anything irreversible happens: `prepare_*` plans every request (nothing changed),
moves the kept entries (into slots no other row references) and readies each new row; `apply`
then rewrites the rows, drops their tree locks and frees the evicted slots, all at once. A request
that fails while it is prepared keeps its old row (SGLang frees it when the request is aborted)
and gives back only its newly allocated slots (`abandon`), as does one its caller decides not to
apply. The kept entries move in groups of at most `MOVE_GROUP_ENTRIES` gathered entries (a request
larger than that moves alone): a move that raises, out of memory for its gather for instance,
fails the requests of its group (their entries may be half moved), not the step's others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import Tensor

from sgl_kvc.adapter.safety import failpoints, invariants
from sgl_kvc.core.moves import UnitMoves, move_unit_entries, move_units_many, packed_slots, unit_moves
from sgl_kvc.policies import HeadSelection

# The most entries one batched move gathers at once, per layer and buffer (per-head rows: KV heads
# x kept slots; the unit pool: units): bounds a move's temporary memory, and so which requests one
# failed move takes with it.
MOVE_GROUP_ENTRIES = 1 << 18

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch


@dataclass(frozen=True)
class CompactionResult:
    kept: int  # slots the request's row holds after it (G for a packed request)
    freed: int  # slots returned to the allocator
    copied: int  # slots newly allocated for kept tree-owned entries (a first compaction)
    units: Tensor | None = None  # a packed request's new tables [L, H_kv, K] (unit pool)


class CompactionSkipped(RuntimeError):
    """Not enough free slots to privatise the kept tree-owned entries; nothing was changed."""


@dataclass(frozen=True)
class _Plan:
    i: int
    dest: Tensor  # the slots the request's row holds after the compaction
    evicted: Tensor  # owned slots given back
    copied: int  # slots newly allocated (the last of `dest`)
    result: CompactionResult
    row: Tensor | None = None  # per-head: the slots before, and each head's kept indices
    indices: Tensor | None = None
    units: UnitMoves | None = None  # unit pool: the entries' moves


@dataclass(frozen=True)
class Prepared:
    """Request i of the batch, its kept entries moved into the slots of its new `row` (int64);
    its row, lengths, tree lock and the pool's accounting are as they were."""

    i: int
    row: Tensor
    evicted: Tensor  # owned slots `apply` frees
    copied: int  # slots newly allocated for it (the last of `row`): `abandon` frees them
    result: CompactionResult


Outcome = Prepared | Exception


def prepare_per_head(batch: ScheduleBatch, items: Sequence[tuple[int, HeadSelection]]) -> list[Outcome]:
    """Per-head compaction of several requests of `batch` (those due in the same step), up to
    `apply`. Each keeps, in every (layer, KV head), its own entries `selection.kept(l, h)`
    (physical indices of its row; the same count in every head: a uniform per-head budget, or a
    shared selection). One gather + scatter per layer moves every request's kept entries. Per
    item: `Prepared`, or the exception that left it unchanged (`CompactionSkipped`: no free slot
    to copy the kept tree-owned entries into)."""

    def plan(item: tuple[int, HeadSelection]) -> _Plan:
        i, selection = item
        n = int(batch.seq_lens_cpu[i])
        k = selection.max_keep
        if selection.n != n or not bool((selection.lengths == k).all()):
            raise ValueError(
                f"per-head compaction needs {n} entries and one count for every head, got "
                f"n={selection.n}, counts {sorted(set(selection.lengths.flatten().tolist()))}"
            )
        row = _row(batch, i)
        indices = selection.indices.to(row.device)
        if indices.dim() != 3 or int(indices.shape[-1]) != k:
            raise ValueError(f"per-head compaction needs [layers, heads, {k}] kept indices, got {tuple(indices.shape)}")
        dest, evicted, copied = _destinations(batch, i, k)  # last: it may allocate
        return _Plan(i, dest, evicted, copied, CompactionResult(k, int(evicted.numel()), copied),
                     row=row, indices=indices)

    def move(plans: list[_Plan]) -> None:
        pool = batch.token_to_kv_pool_allocator.get_kvcache()
        move_units_many(pool, [(p.row, p.indices, p.dest) for p in plans])

    def entries(p: _Plan) -> int:  # gathered per layer and buffer: KV heads x kept slots
        return int(p.indices.shape[1]) * int(p.dest.numel())

    return _prepare_many(batch, items, plan, move, entries)


def prepare_units(
    batch: ScheduleBatch, items: Sequence[tuple[int, HeadSelection, Tensor]], unit_pools: tuple[Any, Any]
) -> list[Outcome]:
    """Variable per-head budgets on the unit pool (KV-Compress §4.2), up to `apply`. Item
    (i, selection, units): request i keeps, in (layer l, KV head h), the entries
    `selection.kept(l, h)` (columns of its per-head tables, `units` [L, H_kv, N]). Its kept
    entries, in (layer, head, column) order, fill the units of its first
    G = ceil(total / (L x H_kv)) owned slots (KV-Compress Alg. 1's MoveCache with a one-unit
    block); every other slot it owns is freed. Per item: `Prepared` (its result carries the new
    tables) or the exception that left it unchanged."""
    allocator = batch.token_to_kv_pool_allocator

    def plan(item: tuple[int, HeadSelection, Tensor]) -> _Plan:
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
        result = CompactionResult(g, int(evicted.numel()), copied, units=moves.table)
        return _Plan(i, dest, evicted, copied, result, units=moves)

    def move(plans: list[_Plan]) -> None:
        move_unit_entries(unit_pools, [p.units for p in plans])

    def entries(p: _Plan) -> int:  # gathered per buffer: units of every layer
        return int(p.units.src.numel())

    return _prepare_many(batch, items, plan, move, entries)


def compact_requests_per_head(
    batch: ScheduleBatch, items: Sequence[tuple[int, HeadSelection]], other_batches: tuple[ScheduleBatch, ...] = ()
) -> list[CompactionResult | Exception]:
    """`prepare_per_head`, then `apply` to every request it prepared."""
    return _apply_prepared(batch, prepare_per_head(batch, items), other_batches)


def compact_requests_units(
    batch: ScheduleBatch, items: Sequence[tuple[int, HeadSelection, Tensor]], unit_pools: tuple[Any, Any],
    other_batches: tuple[ScheduleBatch, ...] = (),
) -> list[CompactionResult | Exception]:
    """`prepare_units`, then `apply` to every request it prepared."""
    return _apply_prepared(batch, prepare_units(batch, items, unit_pools), other_batches)


def _apply_prepared(batch: ScheduleBatch, outcomes: list[Outcome], other_batches: tuple[ScheduleBatch, ...]) -> list[CompactionResult | Exception]:
    ready = [o for o in outcomes if isinstance(o, Prepared)]
    applied = iter(apply(batch, ready, other_batches))
    return [next(applied) if isinstance(o, Prepared) else o for o in outcomes]


def _prepare_many(
    batch: ScheduleBatch, items: Sequence[Any], plan: Callable[[Any], _Plan], move: Callable[[list[_Plan]], None],
    entries: Callable[[_Plan], int],
) -> list[Outcome]:
    """What the batched compactions share: `plan(item)` plans one request alone or raises for
    it alone; `move(plans)` moves the kept entries of a group of planned requests at once
    (`move_groups`, by the `entries` each gathers); then each new row is readied."""
    allocator = batch.token_to_kv_pool_allocator
    outcomes: list[Any] = []
    planned: list[tuple[int, _Plan]] = []  # (index in outcomes, plan)
    for item in items:
        try:
            planned.append((len(outcomes), plan(item)))
            outcomes.append(None)
        except Exception as e:  # noqa: BLE001 - this request alone
            outcomes.append(e)
    if not planned:
        return outcomes
    moved = []
    for group in move_groups(planned, lambda kp: entries(kp[1])):
        try:
            move([p for _, p in group])
        except Exception as e:  # noqa: BLE001 - every request of the group: its entries may be half moved
            for k, p in group:
                _give_back_copied(allocator, p.dest, p.copied)  # no row references them yet
                outcomes[k] = e
            continue
        moved += group
    for k, p in moved:
        try:
            outcomes[k] = _ready(batch, p)
        except Exception as e:  # noqa: BLE001 - this request alone; its old row still owns the rest
            _give_back_copied(allocator, p.dest, p.copied)
            outcomes[k] = e
    return outcomes


def move_groups(items: Sequence[Any], entries: Callable[[Any], int], limit: int | None = None) -> list[list[Any]]:
    """`items` in order, cut into groups of at most `limit` (default `MOVE_GROUP_ENTRIES`)
    `entries` each; an item larger than the limit is a group of its own."""
    limit = MOVE_GROUP_ENTRIES if limit is None else limit
    groups: list[list[Any]] = []
    total = 0
    for item in items:
        size = entries(item)
        if not groups or total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size
    return groups


def _ready(batch: ScheduleBatch, p: _Plan) -> Prepared:
    """Everything about request p.i's new row that can fail, before anything of it changes."""
    failpoints.check("rewrite_raise", batch.reqs[p.i])
    return Prepared(p.i, p.dest, p.evicted, p.copied, p.result)


def abandon(batch: ScheduleBatch, prepared: Prepared) -> None:
    """A prepared request whose compaction will not be applied: give back the slots allocated
    for it (its kept entries were copied over slots its old row still lists; it must be
    aborted, its KV is no longer its prompt's)."""
    _give_back_copied(batch.token_to_kv_pool_allocator, prepared.row, prepared.copied)


def apply(batch: ScheduleBatch, prepared: Sequence[Prepared], other_batches: tuple[ScheduleBatch, ...] = ()) -> list[CompactionResult | Exception]:
    """Commit prepared requests to SGLang: each row's tree lock dropped, its row and lengths
    rewritten; then the evicted slots of all of them freed in one call, and the invariants
    checked once. Per request: its result, or the exception of a failed unlock (its slots given
    back, its row as it was)."""
    allocator = batch.token_to_kv_pool_allocator
    outcomes: list[CompactionResult | Exception] = []
    done, evicted = [], []
    for p in prepared:
        try:
            _rewrite(batch, p)
        except Exception as e:  # noqa: BLE001 - this request alone (its caller aborts it)
            abandon(batch, p)
            outcomes.append(e)
            continue
        outcomes.append(p.result)
        done.append(batch.reqs[p.i])
        evicted.append(p.evicted)
    freed = (_free(allocator, failpoints.leak_slot(torch.cat(evicted), done)) if evicted
             else torch.zeros(0, dtype=torch.int64, device=batch.req_to_token_pool.req_to_token.device))
    if done and invariants.enabled():
        invariants.check_after_compaction([batch, *other_batches], done, freed)
    return outcomes


def _row(batch: ScheduleBatch, i: int) -> Tensor:
    """Request i's slots (its first seq_len entries), int64."""
    n = int(batch.seq_lens_cpu[i])
    return batch.req_to_token_pool.req_to_token[batch.reqs[i].kv.req_pool_idx, :n].to(torch.int64)


def _give_back_copied(allocator: Any, dest: Tensor, copied: int) -> None:
    """Free the `copied` slots `_destinations` newly allocated (the last of `dest`), for a
    request whose compaction will not happen."""
    if copied:
        allocator.free(dest[dest.numel() - copied :])


def _destinations(batch: ScheduleBatch, i: int, g: int) -> tuple[Tensor, Tensor, int]:
    """(the g slots a compaction of request i writes, the owned slots it gives back, how many
    of the g were newly allocated). The request's own slots come first (the tree's are never
    written); a request owning fewer than g needs new ones: at its first compaction everything
    it holds is the tree's (SGLang publishes a prompt as it reads it), and admission counted them
    (`sgl_kvc/footprint.py`)."""
    row = _row(batch, i)
    owned = row[int(batch.reqs[i].kv.cache_protected_len):]
    need = max(0, g - int(owned.numel()))
    if not need:
        return owned[:g], owned[g:], 0
    make_room_in_tree(batch.tree_cache, need)  # the request's own path is still locked
    allocator = batch.token_to_kv_pool_allocator
    if allocator.available_size() < need:
        raise CompactionSkipped(f"no {need} free slots to privatise the kept prefix")
    fresh = allocator.alloc(need).to(device=row.device, dtype=torch.int64)
    return torch.cat([owned, fresh]), owned[:0], need


def make_room_in_tree(tree_cache: Any, need: int) -> None:
    """Let SGLang evict unlocked tree nodes until `need` slots are free (if it can)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    evict_from_tree_cache(tree_cache, need)


def _free(allocator: Any, slots: Tensor) -> Tensor:
    if slots.numel():
        allocator.free(slots)
    return slots


def _rewrite(batch: ScheduleBatch, p: Prepared) -> None:
    """Drop the request's tree lock (the one call into SGLang, so it comes before any change),
    then write its new row and lengths (plain assignments)."""
    req = batch.reqs[p.i]
    kv = req.kv
    r2t = batch.req_to_token_pool.req_to_token
    row = p.row.to(r2t.dtype)
    if int(kv.cache_protected_len) > 0:
        batch.tree_cache.unlock(req.lock)
        req.lock = None
        kv.cache_protected_len = 0
    k = int(row.numel())
    r2t[kv.req_pool_idx, :k] = row
    kv.kv_committed_len = k
    kv.kv_allocated_len = k
    req.skip_radix_cache_insert = True
    set_seq_len(batch, p.i, k)


def set_seq_len(batch: ScheduleBatch, i: int, k: int) -> None:
    """Request i's row holds k slots now: the batch's lengths say so."""
    # New tensors rather than in-place writes: earlier forward inputs may still reference them.
    for name in ("seq_lens", "seq_lens_cpu", "orig_seq_lens"):
        t = getattr(batch, name, None)
        if t is not None:
            t = t.clone()
            t[i] = k
            setattr(batch, name, t)
    batch.seq_lens_sum = None
