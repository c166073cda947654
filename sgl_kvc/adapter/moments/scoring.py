"""A moment's passes, scored: started, staged over scheduler steps within the step's work
(`--kv-pass-work`, shared among the moment's passes), or, for a shared selection, scored in one
step with the tensor-parallel ranks' scores averaged first. A finished selection is due for the
moment's compaction (`Host.due`, compacted by `commit.flush`). Before a pass starts, whether its
compaction could have the fresh slots it copies into (`room_for`); where not, it is put off with
a back-off (`put_off`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank
from sgl_kvc.core.passes import DueCompaction, StepWork, advance, pass_tables, start_pass
from sgl_kvc.core.views import layer_views, prompt_moments, prompt_reconstruction, with_gaps
from sgl_kvc.footprint import compaction_copies
from sgl_kvc.policies import HeadSelection

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sgl_kvc.adapter.moments.host import Host
    from sgl_kvc.core.request_state import ReqKvState


def run_passes(
    comp: Host, batch: ScheduleBatch, pending: list[tuple[int, ReqKvState]],
    starts: list[tuple[int, ReqKvState, int]], moment: str, whole: bool = False,
) -> None:
    """Advance the staged passes and start the new ones of one moment. The step's work
    (`--kv-pass-work`) is shared equally among them, so no request waits behind another's
    whole pass (each still makes progress every step); `whole`: every pass runs to its end.
    The finished ones are due for the step's compaction (`commit.flush`)."""
    runs = len(pending) + len(starts)
    if not runs:
        return
    limit = 0 if whole else comp.config.kv_pass_work
    share = max(1, limit // runs) if limit > 0 else 0

    def work() -> StepWork:
        return StepWork(allowance=share) if limit > 0 else StepWork.unlimited()

    for i, state in pending:
        comp.failures.guarded(batch.reqs[i], "compress", advance_pass, comp, batch, i, state, work())
    for i, state, target in starts:
        comp.failures.guarded(batch.reqs[i], "compress", start, comp, batch, i, state, target, moment, work())


def start(
    comp: Host, batch: ScheduleBatch, i: int, state: ReqKvState, target: int, moment: str, work: StepWork
) -> None:
    """Begin a pass to `target` entries and run what `work` allows of it."""
    if not state.per_head:
        compress_shared(comp, batch, i, state, target, moment)
        return
    failpoints.check("compress_raise", batch.reqs[i])
    t0 = time.perf_counter()
    row = batch.reqs[i].kv.req_pool_idx
    n = int(batch.seq_lens_cpu[i])
    policy = comp.policy(state.policy_name(moment), state.effective_budget(n))
    tables = pass_tables(comp.store, comp.config.kv_head_budget, policy, state, comp.store.req_to_token[row, :n])
    # a staged pass in progress is superseded
    state.pending = start_pass(comp.store, row, state, policy, n, target, moment, tables)
    comp.account(time.perf_counter() - t0)
    advance_pass(comp, batch, i, state, work)


def advance_pass(comp: Host, batch: ScheduleBatch, i: int, state: ReqKvState, work: StepWork) -> None:
    """Score what `work` allows of the request's pass; a finished selection is due for this
    moment's compaction (`commit.flush`)."""
    t0 = time.perf_counter()
    row = batch.reqs[i].kv.req_pool_idx
    n = int(batch.seq_lens_cpu[i])
    due = advance(comp.store, row, state, n, work, comp.config.kv_head_budget, i)
    if due is not None:
        comp.due.append(due)
    comp.account(time.perf_counter() - t0)


def compress_shared(comp: Host, batch: ScheduleBatch, i: int, state: ReqKvState, target: int, moment: str) -> None:
    """The shared selection: one set of tokens for every layer and head, in one step (with
    tensor parallelism, scores averaged over the ranks first)."""
    t0 = time.perf_counter()
    req = batch.reqs[i]
    n = int(batch.seq_lens_cpu[i])
    try:
        failpoints.check("compress_raise", req)
        policy = comp.policy(state.policy_name(moment), state.effective_budget(n))
        positions = state.positions(n)
        views = layer_views(comp.store, req.kv.req_pool_idx, state, n, positions, comp.layers(),
                            values=policy.uses_values,
                            moments=prompt_moments(comp.store, state, policy, moment),
                            reconstruction=prompt_reconstruction(state, policy, moment))
        combined, error = policy.combined_score(views), None
    except Exception as e:  # noqa: BLE001 - raised below, after the other ranks heard of it
        combined, error = None, e
    reduce = None if failpoints.hits("tp_local_scores", req) else comp.reduce_scores  # the planted fault: each rank from its own heads
    if reduce is not None:
        # Every rank joins the all-reduce, the one whose scoring failed too: it would wait forever.
        combined, failed_anywhere = reduce.reduce(combined, n, failed=error is not None)
        if failed_anywhere and error is None:
            error = FailedOnAnotherRank()
    if error is not None:
        raise error
    chosen = policy.choose(views, combined, target)
    stats = None
    if state.policy.uses_stats:  # the decode policy's statistic, whichever policy chose
        stats = with_gaps(comp.first_layer, [state.policy.carry_stats(v, chosen) for v in views])
    selection = HeadSelection.broadcast(chosen, len(views), comp.store.kv_heads, n)
    comp.due.append(DueCompaction(
        i=i, state=state, policy=policy, moment=moment, selection=selection,
        kept_positions=positions[chosen], stats=stats, began_at=n, staged=False,
    ))  # fmt: skip
    comp.account(time.perf_counter() - t0)


def room(batch: ScheduleBatch) -> int:
    """Slots a compaction or a forward of this moment can take now: free, or the tree's unlocked."""
    return batch.token_to_kv_pool_allocator.available_size() + batch.tree_cache.evictable_size()


def room_for(batch: ScheduleBatch, i: int, target: int) -> bool:
    """Whether request i's compaction to `target` entries can have the fresh slots it copies
    the tree's kept entries into (free slots, or the tree's unlocked ones), before its pass is
    scored: a pass that could not be compacted would only spend the step's allowance."""
    req = batch.reqs[i]
    copies = compaction_copies(int(batch.seq_lens_cpu[i]), int(req.kv.cache_protected_len), target)
    if not copies:
        return True
    return room(batch) >= copies


def put_off(comp: Host, state: ReqKvState, n: int) -> None:
    """A pass of this request was not run, or its compaction not applied, for lack of free
    slots: no new pass starts until it has grown by 2, 4, ... tokens (at most `--kv-buffer`),
    so it does not take the step's allowance from the others every step meanwhile."""
    comp.stats.skipped += 1
    state.skips += 1
    state.retry_at = state.logical_len(n) + min(1 << state.skips, max(1, comp.config.kv_buffer))
