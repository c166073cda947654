"""Whether a prompt read in chunks must be compressed before its next chunk (the `chunk` moment).

SGLang gives the prompt it is reading in chunks (its `chunked_req`) the first place in the next
prefill round, with as much of its next chunk as the round's memory allows
(`PrefillAdder.add_chunked_req`): free slots plus what evicting the radix tree frees, minus what
the running requests reserve for their outputs (`_get_running_request_total_token_offset`; on a
compressing server, by their compressed footprint). `next_chunk_room` computes that room between
the chunk that just ran and the next one. When it cannot hold the next chunk (and the slots the
compaction copies the kept entries into), the request is compressed now, to its budget, and the
chunk runs whole; otherwise the prompt is compressed once,
after its last chunk, with its question read, exactly as a prompt that was never chunked.

What compressing the running requests would free is not counted: they are compressed at their own
moments (decode, preempt), so under load a prompt is cut back a little earlier, never too late.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler


def next_chunk_room(scheduler: Scheduler) -> int:
    """Tokens the next prefill round can give a chunk, as SGLang's admission counts them."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    free = scheduler.token_to_kv_pool_allocator.available_size() + scheduler.tree_cache.evictable_size()
    running = getattr(scheduler, "running_batch", None)
    reqs = getattr(running, "reqs", None) or []
    # SGLang's own reservation of a running request (with sgl-kvc's hook on it): a method that
    # reads only the round's `new_token_ratio` of its adder.
    adder = SimpleNamespace(new_token_ratio=scheduler.new_token_ratio_tracker.current)
    reserved = sum(PrefillAdder._get_running_request_total_token_offset(adder, req) for req in reqs)
    return int(free - reserved)


def needs_compression(scheduler: Scheduler, req: Req, processed: int, keep: int) -> bool:
    """Whether `req`, whose prompt has been read up to `processed` tokens, must be compressed
    before its next chunk: that chunk (one `chunked_prefill_size`, or the rest of the prompt)
    and the `keep` slots the compaction itself may need would not fit the room the next round
    has. (SGLang puts every chunk of the prompt into the radix tree as it goes, so the first
    compaction copies the kept entries out of the tree's slots into `keep` new ones.)"""
    remaining = len(req.origin_input_ids) - processed
    if remaining <= 0:
        return False
    chunk = getattr(scheduler, "chunked_prefill_size", None) or remaining
    return min(chunk, remaining) + keep > next_chunk_room(scheduler)
