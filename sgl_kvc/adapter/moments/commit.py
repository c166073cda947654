"""A moment's compactions and their commit: the selections that finished in the moment are
compacted together, each kind by its own routine (`adapter/moments/compaction.py`); the
tensor-parallel ranks vote on what moved everywhere (`vote`), and each request is committed (its
state, position offset and counters) or, where its compaction could not have the fresh slots it
copies into, put off with a back-off or, between two chunks, failed alone (`CHUNK_SKIPPED`).
Each moment's hook ends by settling its failures on every rank (`settle`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sgl_kvc.adapter import documents
from sgl_kvc.adapter.moments.compaction import (
    CompactionResult,
    CompactionSkipped,
    Prepared,
    abandon,
    apply,
    prepare_per_head,
    prepare_units,
)
from sgl_kvc.adapter.moments.scoring import put_off
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank, failure
from sgl_kvc.adapter.safety.tp import agree
from sgl_kvc.core.reconstruction import carry_through

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sgl_kvc.adapter.moments.host import Host
    from sgl_kvc.core.passes import DueCompaction

logger = logging.getLogger(__name__)

# What the client of a prompt read in chunks is told when the pass between two of its chunks finds
# no free slots for the entries it keeps.
CHUNK_SKIPPED = ("sgl-kvc could not compress this request between two chunks of its prompt: the KV "
                 "pool had no free slots for the entries it keeps, and its next chunk cannot fit "
                 "uncompressed; retry when the server is less loaded")


def flush(comp: Host, batch: ScheduleBatch) -> None:
    """Compact the requests whose selection finished in this step, together: each kind (per
    head or shared; packed in the unit pool) by its routine, in batched moves of bounded size. Then
    the ranks agree on what moved everywhere (`vote`), that is applied, and each request is
    committed. With tensor parallelism every rank flushes every step on which any rank worked
    for a request (`FailureLedger.active`), due or not; a step with no work has no collective."""
    due = [d for d in comp.due if failure(batch.reqs[d.i]) is None]
    comp.due = []
    if not due and (comp.failures.vote is None or not comp.failures.active):
        return  # nothing due here, and (no work on any rank) nowhere: no collective
    t0 = time.perf_counter()
    comp.stats.max_compacted_together = max(comp.stats.max_compacted_together, len(due))
    outcomes: dict[int, Prepared | Exception] = {
        d.i: CompactionSkipped("planted: no free slots") for d in due if failpoints.skips(batch.reqs[d.i], d.moment)
    }
    packed = [d for d in due if d.units is not None and d.i not in outcomes]  # variable budgets: the unit pool
    rows = [d for d in due if d.units is None and d.i not in outcomes]  # per-head uniform and shared selections
    if packed:
        items = [(d.i, d.selection, d.units) for d in packed]
        outcomes.update(zip((d.i for d in packed), prepare_units(batch, items, comp.store.unit_pools)))
    if rows:
        outcomes.update(zip((d.i for d in rows), prepare_per_head(batch, [(d.i, d.selection) for d in rows])))
    ready = vote(comp, batch, outcomes)
    applied = dict(zip((p.i for p in ready), apply(batch, ready, other_batches(comp, batch))))
    for d in due:
        outcome = applied.get(d.i, outcomes[d.i])
        if isinstance(outcome, CompactionSkipped) and d.moment == "chunk":
            # Its next chunk cannot fit uncompressed: it fails alone, before that chunk runs.
            comp.stats.skipped += 1
            comp.failures.fail(batch.reqs[d.i], "compress", outcome, message=CHUNK_SKIPPED)
        elif isinstance(outcome, CompactionSkipped):
            logger.debug("compression of %s put off: %s", batch.reqs[d.i].rid, outcome)
            put_off(comp, d.state, int(batch.seq_lens_cpu[d.i]))
        elif isinstance(outcome, Exception):
            comp.failures.fail(batch.reqs[d.i], "compress", outcome)
        else:
            comp.failures.guarded(batch.reqs[d.i], "compress", commit, comp, batch, d, outcome)
    comp.account(time.perf_counter() - t0)


def vote(comp: Host, batch: ScheduleBatch, outcomes: dict[int, Prepared | Exception]) -> list[Prepared]:
    """The prepared compactions to apply, the same on every rank: a request whose compaction
    failed on any rank (or which failed there earlier in the step) fails on all; one skipped
    everywhere is skipped; one skipped on some ranks and prepared on others (their pools no
    longer agree) fails. A prepared one not applied is abandoned. `outcomes` is updated."""
    tally = torch.zeros(len(batch.reqs), 3, dtype=torch.int64, device="cpu")  # failed, skipped, prepared (host)
    for i, req in enumerate(batch.reqs):
        outcome = outcomes.get(i)
        if failure(req) is not None or _failed(outcome):
            tally[i, 0] = 1
        elif isinstance(outcome, CompactionSkipped):
            tally[i, 1] = 1
        elif isinstance(outcome, Prepared):
            tally[i, 2] = 1
    tally = agree(comp.failures.vote, tally)
    ready = []
    for i, (failed, skipped, prepared) in enumerate(tally.tolist()):
        outcome = outcomes.get(i)
        if isinstance(outcome, Prepared):
            if not failed and not skipped:
                ready.append(outcome)
                continue
            abandon(batch, outcome)  # its entries moved here: it cannot go on uncompressed
            outcomes[i] = FailedOnAnotherRank()
        elif isinstance(outcome, CompactionSkipped) and (failed or prepared):
            outcomes[i] = FailedOnAnotherRank()
        elif outcome is None and (failed or skipped or prepared):
            comp.failures.fail(batch.reqs[i], "compress", FailedOnAnotherRank())
    return ready


def commit(comp: Host, batch: ScheduleBatch, d: DueCompaction, outcome: CompactionResult) -> None:
    """After request d.i's compaction: its state, position offset, query count, counters."""
    req = batch.reqs[d.i]
    state, row = d.state, req.kv.req_pool_idx
    n = d.n or d.selection.n  # a packed request's tables are wider than its row
    if d.moment == "chunk":
        # The next chunk extends the kept entries (SGLang resumes at `prefix_len`, which it
        # sets from `extend_end` when it stashes a chunk), and its tokens are read `offset`
        # further on (`shifted_fill_ids`).
        req.prefix_len = req.extend_end = outcome.kept
        # SGLang counts a chunk's cache hits as its prefix minus what the request computed
        # before it (`already_computed`): that is now the kept entries, so the usage's
        # cached_tokens stays what the tree gave (it went negative by every dropped entry).
        req.already_computed = outcome.kept
        state.fill_shift = True
    logical_len = state.logical_len(n)  # the offset is still the one before compaction
    if d.stats is not None:
        state.stats = d.stats
    state.kept_positions = d.kept_positions
    # between chunks, the scores of the kept entries' reconstruction (the next prompt pass
    # repeats only what is read since); after the prompt, nothing, but for a conversation's
    # request (one that may keep a reply, `adapter/documents/turns.py`) the scores of its
    # prefill pass or of the document it started from, through its decode passes: its next
    # turn starts from what the reply kept and repeats only what they do not cover
    if d.moment == "chunk":
        state.reconstructed = d.carried
    elif not documents.may_reply(req):
        state.reconstructed = None
    elif d.moment == "prefill":
        state.reconstructed = d.carried
    elif state.reconstructed is not None:
        state.reconstructed = carry_through(state.reconstructed, d.selection)
    if outcome.units is not None:  # packed into the unit pool
        state.pack(outcome.units, d.selection.lengths, outcome.kept, d.kept_positions)
    if comp.trace:
        comp.trace.write(req.rid, d.moment, d.policy.name, n, logical_len, state, outcome.kept, d.began_at)
    state.offset = logical_len - outcome.kept
    comp.store.set_offset(row, state.offset)
    state.passes += 1
    state.skips = state.retry_at = 0
    comp.store.trim_queries(row, outcome.kept)
    if outcome.freed:
        reopen_admission(comp, batch)
    comp.stats.passes += 1
    comp.stats.staged_passes += int(d.staged)
    comp.stats.evicted_tokens += n - outcome.kept
    comp.stats.max_row_slots = max(comp.stats.max_row_slots, n)
    setattr(comp.stats, f"{d.moment}_passes", getattr(comp.stats, f"{d.moment}_passes") + 1)
    if comp.metrics:
        comp.metrics.compressed(d.moment, n - outcome.kept)


def reopen_admission(comp: Host, batch: ScheduleBatch) -> None:
    """A compaction freed slots: let the scheduler try its waiting requests again. SGLang
    stops admitting once a request did not fit (`batch_is_full`) and reopens only when a
    request leaves; freed slots are the same news (sglang 0.5.23, `Scheduler
    .get_new_batch_prefill`). Without this, a request admitted while another's staged pass
    still held its whole prompt would keep the queue shut until that request finished."""
    for b in (batch, getattr(comp.scheduler, "running_batch", None)):
        if b is not None and getattr(b, "batch_is_full", False):
            b.batch_is_full = False


def other_batches(comp: Host, batch: ScheduleBatch) -> tuple[ScheduleBatch, ...]:
    """The other running batch (read only by the invariant check)."""
    running = getattr(comp.scheduler, "running_batch", None)
    return (running,) if running is not None and running is not batch else ()


def settle(comp: Host, batch: ScheduleBatch) -> None:
    """End of a moment's hook: the ranks agree on what failed, and it is aborted."""
    comp.stats.failed_requests += comp.failures.settle(batch.reqs, comp.scheduler)


def _failed(outcome: Prepared | Exception | None) -> bool:
    return isinstance(outcome, Exception) and not isinstance(outcome, CompactionSkipped)
