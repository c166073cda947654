"""The moments before a decode step: the decode moment, when a request's cache reaches its
policy's trigger (R-KV: budget + buffer, §3.1), and the preempt moment, when SGLang's decode
memory check fails (`compressor.py` describes both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_kvc.adapter.moments.commit import flush, settle
from sgl_kvc.adapter.moments.scoring import put_off, room_for, run_passes, start
from sgl_kvc.core.passes import StepWork

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sgl_kvc.adapter.moments.host import Host


def before_decode(comp: Host, batch: ScheduleBatch) -> None:
    """Before a decode step: advance the staged passes, and start a pass for each request whose
    cache reached its decode policy's trigger (one put off for lack of slots waits out its
    back-off); the finished ones are compacted together."""
    comp.step_seconds = 0.0
    pending, starts = [], []
    for i, req in enumerate(batch.reqs):
        state = comp.state(req)
        if state is None or state.policy.name == "none" or req.finished():
            continue
        if state.pending is not None:
            pending.append((i, state))
            continue
        n = int(batch.seq_lens_cpu[i])
        if state.retry_at > state.logical_len(n):
            continue  # put off for lack of slots (`scoring.put_off`)
        target = comp.policy(state.policy.name, state.effective_budget(n)).target_length(n)
        if target is not None and target < n:
            if room_for(batch, i, target):
                starts.append((i, state, target))
            else:
                put_off(comp, state, n)
    run_passes(comp, batch, pending, starts, "decode")
    flush(comp, batch)
    settle(comp, batch)


def before_preempt(comp: Host, batch: ScheduleBatch) -> bool:
    """Compress over-budget requests until the next decode step fits. True if it fits."""
    order = sorted(range(len(batch.reqs)), key=lambda j: -int(batch.seq_lens_cpu[j]))
    compressed = fits = False
    for i in order:
        req = batch.reqs[i]
        state = comp.state(req)
        if state is None or state.policy.name == "none" or req.finished():
            continue
        n = int(batch.seq_lens_cpu[i])
        budget = state.effective_budget(n)
        if n > budget and not room_for(batch, i, budget):
            comp.stats.skipped += 1  # another may free slots: the next is tried
        elif n > budget:
            passes = state.passes
            work = StepWork.unlimited()  # retraction is the alternative: the pass runs whole
            comp.failures.guarded(req, "compress", start, comp, batch, i, state, budget, "preempt", work)
            flush(comp, batch)
            compressed |= state.passes > passes
            if batch.check_decode_mem():
                fits = True
                break
    settle(comp, batch)
    if fits and compressed:
        comp.stats.avoided_retractions += 1
        if comp.metrics:
            comp.metrics.avoided_retraction()
    return fits or batch.check_decode_mem()
