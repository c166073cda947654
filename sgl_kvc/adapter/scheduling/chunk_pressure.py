"""Whether a prompt read in chunks must be compressed before its next chunk (the `chunk` moment).

SGLang gives the prompt it is reading in chunks (its `chunked_req`) the first place in the next
prefill round, with as much of its next chunk as the round's memory allows
(`PrefillAdder.add_chunked_req`): free slots plus what evicting the radix tree frees, minus what
the running requests reserve (`_get_running_request_total_token_offset`; on a compressing server,
by their footprint, `adapter/scheduling/admission.py`). `next_chunk_room` computes that room between the
chunk that just ran and the next one. When it cannot hold what the next round takes for the
prompt (its next chunk and the slots a pass after it copies the kept entries into), the request
is compressed now and the chunk runs whole; otherwise the prompt is compressed once, after its
last chunk, with its question read, exactly as a prompt that was never chunked.

What compressing the running requests would free is not counted: they are compressed at their own
moments (decode, preempt), so under load a prompt is cut back a little earlier, never too late.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler


def next_chunk_room(scheduler: Scheduler, batch: ScheduleBatch | None = None) -> int:
    """Tokens the next prefill round can give a chunk, as SGLang's admission counts them: the
    running requests' reservations, and those of the requests `batch` (the extend batch that just
    ran, not yet merged into the running batch) admitted beside the chunk."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
    running = getattr(scheduler, "running_batch", None)
    reqs = list(getattr(running, "reqs", None) or [])
    if batch is not None:
        seen = {id(r) for r in reqs}
        chunked = getattr(batch, "chunked_req", None)
        reqs += [r for r in batch.reqs if id(r) not in seen and r is not chunked and not r.finished()]
    # SGLang's own reservation of a running request (with sgl-kvc's hook on it): a method that
    # reads only the round's `new_token_ratio` of its adder.
    adder = SimpleNamespace(new_token_ratio=scheduler.new_token_ratio_tracker.current)
    reserved = sum(PrefillAdder._get_running_request_total_token_offset(adder, req) for req in reqs)
    return int(free - reserved)


def needs_compression(scheduler: Scheduler, req: Req, need: int, batch: ScheduleBatch | None = None) -> bool:
    """Whether `req`, a prompt read in chunks, must be compressed before its next chunk: what the
    next round takes for it uncompressed (`need`: its next chunk and the fresh slots the pass after
    that chunk copies its kept entries into, `adapter/admission.chunk_need`) would not fit the room
    the next round has. (SGLang puts every chunk of the prompt into the radix tree as it goes, so
    until its first compaction every entry it holds is the tree's.)"""
    if need <= 0:
        return False
    return need > next_chunk_room(scheduler, batch)
