"""Admission by what a compressing request will really hold (`sgl_kvc/footprint.py`).

SGLang's `PrefillAdder` admits a request for its prompt + `max_new_tokens` and, in each prefill
round, counts for every running request the tokens it may still generate. A compressing request
holds less once compressed, and, while a compaction copies its kept entries out of the radix
tree's slots, more. These hooks give SGLang those numbers, all from one function, so that no
admitted request is retracted (SGLang's preemption) for memory its admission did not count and no
compaction finds its fresh slots taken:

| hook (sglang 0.5.23)                                  | what it counts                                   |
| ----------------------------------------------------- | ------------------------------------------------ |
| Scheduler.init_req_max_new_tokens                     | a request that cannot fit even compressed is refused (a 400), not cut short |
| PrefillAdder.add_one_req                              | a waiting request: its footprint beyond its cached prefix |
| PrefillAdder._check_prefill_budget                    | a prompt compressed between chunks: one chunk and what its first pass copies |
| PrefillAdder.add_chunked_req                          | a prompt's next chunk and the slots of the pass after it; with its last chunk, the rest of its life |
| PrefillAdder._get_running_request_total_token_offset  | a running request: what it may still take, a pending compaction's copies included |

A request's sizes are fixed when it enters the queue (`remember`), after SGLang has set its
`max_new_tokens`, so a ratio budget (`--kv-budget-ratio`) is read at the length it may reach.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter import documents
from sgl_kvc.adapter.kvzip.limits import forward_slots, question_slots
from sgl_kvc.adapter.scheduling.requests import chunk_compressible
from sgl_kvc.config import KvcConfig
from sgl_kvc.footprint import Moments, Now, Sizes, compaction_copies, most_held
from sgl_kvc.request_settings import ResolvedCompression
from sgl_kvc.adapter.kvc_req import resolved

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

# On the Scheduler while it admits a new request that is compressed between chunks
# (`hooks._around_handle_generate`).
CHUNKED_ATTR = "_sgl_kvc_admitting_chunked"


def sizes_of(config: KvcConfig, settings: ResolvedCompression, prompt: int, max_new: int,
             chunk: int | None, published: bool = True) -> Sizes:
    """The sizes of a request with these settings, prompt and most new tokens (`chunk`: the size
    its prompt is read in when it is compressed between chunks, else None; `published`: whether
    SGLang puts what it reads into the radix tree)."""
    budget = settings.budget.at(prompt + max_new)
    return Sizes(budget=budget, buffer=config.kv_buffer, keep=config.chunk_target(budget), chunk=chunk,
                 published=published, reconstruction=forward_slots(config, settings, prompt),
                 question=question_slots(config, settings, prompt))


def _radix(scheduler: Scheduler) -> bool:
    return not getattr(scheduler.tree_cache, "disable", True)


def server_chunk(scheduler: Scheduler, config: KvcConfig) -> int | None:
    """The chunk size prompts are read in where this server compresses them between chunks (the
    chunk moment, chunked prefill, the radix cache), else None."""
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    if config.chunk_moment is None or not chunk or chunk <= 0 or not _radix(scheduler):
        return None
    return int(chunk)


def scheduler_chunk(scheduler: Scheduler, req: Any, config: KvcConfig) -> int | None:
    """The chunk size `req`'s prompt is read in when it is compressed between chunks, else None
    (without the radix cache SGLang admits some requests by their whole prompt)."""
    chunk = server_chunk(scheduler, config)
    if chunk is None or not chunk_compressible(req, config):
        return None
    return chunk


def remember(req: Req, config: KvcConfig, scheduler: Scheduler) -> None:
    """When `req` enters the scheduler's queue (new, or retracted): its sizes, read once."""
    settings = resolved(req, config)
    if not settings.compressing or req.sampling_params.max_new_tokens is None:
        kvc_req.of(req).sizes = None
        return
    kvc_req.of(req).sizes = (sizes_of(config, settings, len(req.origin_input_ids),
                                       int(req.sampling_params.max_new_tokens),
                                       scheduler_chunk(scheduler, req, config), _radix(scheduler)))


def sizes(req: Req, config: KvcConfig) -> Sizes | None:
    """`req`'s sizes, or None if it does not compress."""
    cached = kvc_req.of(req).sizes
    if cached is not None:
        return cached
    settings = resolved(req, config)
    max_new = req.sampling_params.max_new_tokens
    if not settings.compressing or max_new is None:
        return None
    return sizes_of(config, settings, len(req.origin_input_ids), int(max_new), None)


def _out_left(req: Req) -> int:
    return max(0, int(req.sampling_params.max_new_tokens) - len(req.output_ids))


def _compacted(req: Req) -> bool:
    state = kvc_req.of(req).state
    return state is not None and state.compressed


def _document_adjusted(req: Req, s: Sizes, config: KvcConfig) -> tuple[Sizes, int]:
    """A request with a shared document (`adapter/documents/__init__.py`): its sizes with its budget
    beyond the document's part of its row (`DocumentPlan.held_for_document`), and the tokens a hit
    reads beyond its row's slots (D - k; 0 otherwise)."""
    plan = documents.plan_of(req)
    return _with_document(s, plan.held_for_document, config), plan.fill_offset


def _with_document(s: Sizes, part: int, config: KvcConfig) -> Sizes:
    """Sizes whose budget applies beyond a document's `part` of the row."""
    if not part:
        return s
    budget = s.budget + part
    return replace(s, budget=budget, keep=config.chunk_target(budget))


def admission_demand(req: Req, config: KvcConfig) -> int | None:
    """Slots a waiting request (new or retracted) holds at most beyond its cached prefix (SGLang
    has matched it, `prefix_len`, and locks it while admitting), or None if it does not compress."""
    s = sizes(req, config)
    if s is None:
        return None
    s, shift = _document_adjusted(req, s, config)
    cached = int(req.prefix_len)
    fill = len(req.origin_input_ids) + len(req.output_ids) - shift
    now = Now(held=cached, tree=cached, prompt_left=max(0, fill - cached), out_left=_out_left(req))
    return most_held(Moments.of(config), s, now) - cached


def fitting_prefix(req: Req, config: KvcConfig, total: int) -> int | None:
    """The longest prefix, at most the one SGLang matched, with which `req` (waiting, not a
    document's) fits a pool of `total` slots: its prefix is held whole from the start, so a long
    cached prefix can leave no room for what its compression needs beside it (KVzip's
    reconstruction forward, a pass's copies) where the same prompt read in chunks fits. None if
    none does (its arrival check refuses such a request first)."""
    s = sizes(req, config)
    if s is None:
        return None
    cached = int(req.prefix_len)
    fill = len(req.origin_input_ids) + len(req.output_ids)
    step = max(1, s.chunk or cached or 1)
    for p in [*range(cached, 0, -step), 0]:
        now = Now(held=p, tree=p, prompt_left=max(0, fill - p), out_left=_out_left(req))
        if most_held(Moments.of(config), s, now) <= total:
            return p
    return None


def _fit_prefix(req: Req, adder: Any, config: KvcConfig) -> None:
    """Where `req`'s matched prefix leaves it no room in the pool even with the pool empty, match
    it again, no longer than what fits (`fitting_prefix`, through `hooks._around_max_prefix`):
    SGLang would otherwise try to admit it in every round, and never could, while every request
    behind it waits."""
    if not int(req.prefix_len) or documents.plan_of(req).key is not None:
        return
    total = int(adder.token_to_kv_pool_allocator.size)
    demand = admission_demand(req, config)
    if demand is None or int(req.prefix_len) + demand <= total:
        return
    cap = fitting_prefix(req, config, total)
    if cap is None:
        return
    kvc_req.of(req).prefix_cap = cap
    req.init_next_round_input(adder.tree_cache)


def running_need(req: Req, config: KvcConfig) -> tuple[int, int] | None:
    """(slots a running request may still take, of them the fresh slots of a compaction still due
    on what it holds now), or None if it does not compress."""
    s = sizes(req, config)
    if s is None:
        return None
    # Its prompt moments are over: a pass after prefill put off is its decode policy's, which
    # reads no reconstruction.
    s = replace(s, reconstruction=0, question=0)
    s, shift = _document_adjusted(req, s, config)
    held, tree = int(req.kv.kv_committed_len), int(req.kv.cache_protected_len)
    # A pass after prefill not done yet: staged over steps, or put off for lack of slots.
    due = not _compacted(req) and len(req.origin_input_ids) - shift > s.budget
    moments = Moments.of(config)
    total = most_held(moments, s, Now(held, tree, 0, _out_left(req), due)) - held
    copies = most_held(moments, s, Now(held, tree, 0, 0, due)) - held
    return total, copies


def chunk_need(req: Req, config: KvcConfig, held: int, read: int, compacted: bool) -> int | None:
    """Slots a prompt read in chunks takes in the next prefill round if it is not compressed
    first, as its next chunk is admitted (`_around_add_chunked_req`): the chunk and the fresh slots
    of a pass after it; with its last chunk, the rest of its life. `held`: slots its row holds,
    `read`: prompt tokens read, `compacted`: whether it has been compacted (else everything it
    holds is the tree's, published chunk by chunk). None if it does not compress."""
    s = sizes(req, config)
    if s is None:
        return None
    s, _ = _document_adjusted(req, s, config)
    left = len(req.origin_input_ids) - read
    if left <= 0:
        return 0
    now = Now(held=held, tree=0 if compacted else held, prompt_left=left, out_left=_out_left(req))
    return _round_need(Moments.of(config), s, now)[0]


def _round_need(moments: Moments, s: Sizes, now: Now, cut: int | None = None) -> tuple[int, int]:
    """(slots the next round takes for a prompt read in chunks, of them those of the pass after a
    middle chunk: its copies, or its reconstruction forward's, which is freed before it copies).
    `cut`: the entries its shared document's key cuts its row to where that chunk ends
    (`documents.next_cut`), whatever its own budget keeps."""
    if s.chunk is None or now.prompt_left <= s.chunk:
        return most_held(moments, s, now) - now.held, 0
    after = now.held + s.chunk
    keep = cut or s.keep
    publishing = s.published and now.tree >= now.held
    copies = compaction_copies(after, after if publishing else now.tree, keep) if after > keep else 0
    extra = max(copies, s.cut_forward) if after > keep else 0
    return s.chunk + extra, extra


# --- hooks ------------------------------------------------------------------------------------
def around_add_one_req(config: KvcConfig) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], adder: Any, req: Req, *args: Any, **kwargs: Any):
        if config.kv_document_wait > 0 and documents.waits_in_round(
                req, adder.can_run_list, documents.registry_of(adder.tree_cache)):
            # A request this round admitted compresses its document: it waits for it, left in
            # the queue, and the round goes on with the requests after it (SGLang's own `continue`
            # for a request it cannot take now). Only behind an admitted one: a first request
            # still queued, admitted or not, never holds it (`documents.held_back`).
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.CONTINUE
        cap = documents.chunk_cap(req)
        align = kwargs.get("truncation_align_size")
        if cap is not None and align and cap < align:
            # SGLang aligns a cut chunk down to `truncation_align_size` (deterministic inference on
            # FlashInfer: its prefill split tiles): a first chunk capped at its document's end by
            # less than that would be aligned to nothing, in every round, so the request would
            # never be admitted and every request behind it would wait forever. This one chunk
            # ends at the document's end unaligned (where the document is cut, the same for every
            # request that compresses it).
            kwargs["truncation_align_size"] = None
        _fit_prefix(req, adder, config)
        demand = admission_demand(req, config)
        if demand is None:
            return original(adder, req, *args, **kwargs)
        # SGLang reserves the extend + max_new_tokens: make that the request's footprint.
        sp = req.sampling_params
        extend = len(req.full_untruncated_fill_ids) - int(req.prefix_len)  # shifted after a document
        saved = sp.max_new_tokens
        sp.max_new_tokens = len(req.output_ids) + max(demand - extend, 0)
        try:
            result = original(adder, req, *args, **kwargs)
        finally:
            sp.max_new_tokens = saved
        if getattr(adder, "new_chunked_req", None) is req:
            # Admitted for its first chunk only: the pass after it copies what it keeps out of
            # the tree (and first runs its reconstruction forward, KVzip) into slots requests
            # admitted after it in this round must not take.
            _reserve(adder, _chunk_copies(req, config))
            _end_round_if_capped(adder, req)
        return result

    return hook


def around_check_prefill_budget(config: KvcConfig) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], adder: Any, req: Req, *args: Any, **kwargs: Any):
        s = sizes(req, config)
        if s is not None and s.chunk is not None and kwargs.get("chunk_limit") and "total_tokens" in kwargs:
            demand = admission_demand(req, config)
            # Compressed between chunks, it never holds more than that (a chunk beyond what its
            # passes keep): SGLang's check of its whole prompt would refuse what fits.
            kwargs["total_tokens"] = min(kwargs["total_tokens"], demand)
            cap = documents.chunk_cap(req)
            if cap is not None:  # its first chunk ends at its document's end, at the latest
                kwargs["chunk_limit"] = min(kwargs["chunk_limit"], cap)
        return original(adder, req, *args, **kwargs)

    return hook


def around_add_chunked_req(config: KvcConfig) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], adder: Any, req: Req, *args: Any, **kwargs: Any):
        cap = documents.chunk_cap(req)
        if cap is not None:
            # Its next chunk ends at its document's end, at the latest (SGLang's own per-round
            # cap on the chunk it continues, `chunked_req_limit`).
            saved_limit = adder.chunked_req_limit
            adder.chunked_req_limit = cap if saved_limit is None else min(saved_limit, cap)
            try:
                result = _add_chunked(config, original, adder, req, *args, **kwargs)
            finally:
                adder.chunked_req_limit = saved_limit
            if result is req:
                _end_round_if_capped(adder, req)
            return result
        return _add_chunked(config, original, adder, req, *args, **kwargs)

    return hook


def _add_chunked(config: KvcConfig, original: Callable[..., Any], adder: Any, req: Req, *args: Any, **kwargs: Any):
    s = sizes(req, config)
    if s is None or (s.chunk is None and not s.reconstruction):
        return original(adder, req, *args, **kwargs)
    s, _ = _document_adjusted(req, s, config)
    now = _chunked_now(req)
    need, copies = _round_need(Moments.of(config), s, now, documents.next_cut(req))
    sp = req.sampling_params
    saved = sp.max_new_tokens
    # With its last chunk SGLang reserves the chunk + max_new_tokens: make that the rest of the
    # request's life (its pass after prefill copies, its generation).
    sp.max_new_tokens = len(req.output_ids) + max(need - now.prompt_left, 0)
    try:
        result = original(adder, req, *args, **kwargs)
    finally:
        sp.max_new_tokens = saved
    added = bool(adder.can_run_list) and adder.can_run_list[-1] is req
    if added and result is req:  # a middle chunk: SGLang reserves the chunk alone
        _reserve(adder, copies)
    return result


def around_running_offset(config: KvcConfig) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], adder: Any, req: Req, *args: Any, **kwargs: Any):
        offset = original(adder, req, *args, **kwargs)
        need = running_need(req, config)
        if need is None:
            return offset
        total, copies = need
        # SGLang's own estimate of the tokens it will still generate (scaled down where early
        # stops are expected) never covers a compaction's copies: those are added.
        return min(total, offset + copies)

    return hook


def around_max_new_tokens(config: KvcConfig, reconstructor_of: Callable[[Scheduler], Any]) -> Callable[..., Any]:
    """`reconstructor_of(scheduler)`: the process's KVzip reconstruction pass (it says whether a
    prompt leaves its forwards the positions they need)."""

    def hook(original: Callable[..., Any], scheduler: Scheduler, req: Req, *args: Any, **kwargs: Any):
        settings = resolved(req, config)
        if not settings.compressing or req.finished():
            return original(scheduler, req, *args, **kwargs)
        if forward_slots(config, settings, len(req.origin_input_ids)):  # its prompt policy repeats the context
            reconstructor = reconstructor_of(scheduler)
            short = reconstructor.refusal(scheduler, req.origin_input_ids)
            if short is not None:
                _set_max_new(req.sampling_params, 0)
                req.set_finish_with_abort(short)
                return None
        # SGLang bounds prompt + output by the pool and silently cuts the output to fit; a
        # compressing request holds far less, so only the context bounds its output, unless it
        # cannot fit the pool even compressed: then it is refused (a 400), as SGLang refuses a
        # request longer than the context, or, with --allow-auto-truncate, its output is cut to
        # what fits and it ends with finish_reason "length", as SGLang cuts one there.
        sp = req.sampling_params
        prompt = len(req.origin_input_ids)
        wanted = sp.max_new_tokens if sp.max_new_tokens is not None else 1 << 30
        limit = getattr(scheduler, "max_new_tokens_limit", None)
        if limit:
            wanted = min(wanted, limit)
        max_new = max(0, min(wanted, int(scheduler.model_config.context_len) - 1 - prompt - 1))
        chunk = int(scheduler.chunked_prefill_size) if getattr(scheduler, CHUNKED_ATTR, None) else None
        pool = int(scheduler.max_total_num_tokens)
        moments = Moments.of(config)
        published = _radix(scheduler)
        # a shared document's part of its row (`adapter/documents/__init__.py`), its own budget beyond
        part = documents.declared_part(req, config, split=chunk is not None)

        def held(out: int) -> int:  # on an empty pool
            s = _with_document(sizes_of(config, settings, prompt, out, chunk, published), part, config)
            return most_held(moments, s, Now(prompt_left=prompt, out_left=out))

        if held(max_new) < pool:
            _set_max_new(sp, max_new)
            return None
        fits = _most_that_fits(held, max_new, pool)
        if fits is not None and _allow_auto_truncate():
            logger.warning("Request %s cannot hold %d new tokens even compressed in the KV pool of %d "
                           "tokens; its max_new_tokens is cut to %d (--allow-auto-truncate)",
                           req.rid, max_new, pool, fits)
            _set_max_new(sp, fits)
            return None
        _set_max_new(sp, 0)
        req.set_finish_with_abort(_too_large(config, settings, prompt, max_new, held(max_new), pool, chunk, fits,
                                             part))
        return None

    return hook


# --- helpers ----------------------------------------------------------------------------------
def _chunked_now(req: Req) -> Now:
    """A prompt read in chunks, at the start of the round that reads its next chunk."""
    held, tree = int(req.kv.kv_committed_len), int(req.kv.cache_protected_len)
    left = len(req.full_untruncated_fill_ids) - int(req.prefix_len)
    return Now(held=held, tree=tree, prompt_left=max(0, left), out_left=_out_left(req))


def _chunk_copies(req: Req, config: KvcConfig) -> int:
    """The fresh slots of the pass after the first chunk of a prompt compressed between chunks:
    everything it holds then is the tree's (its cached prefix, and the chunk SGLang publishes)."""
    s = sizes(req, config)
    if s is None or s.chunk is None:
        return 0
    after = int(req.extend_end)  # the first chunk's end
    keep = documents.plan_of(req).cut_at(after) or s.keep  # a cut of its document's key there keeps that many
    if after >= len(req.origin_input_ids) + len(req.output_ids) or after <= keep:
        return 0  # its last chunk (the pass after prefill is in its footprint), or no pass yet
    # its reconstruction forward (KVzip), or its question's, is freed before the pass copies
    return max(compaction_copies(after, after, keep), s.cut_forward)


def _end_round_if_capped(adder: Any, req: Req) -> None:
    """A chunk cut short at its document's end leaves the round room for more chunk tokens, but
    SGLang reads one prompt in chunks at a time: no other request may start being chunked in this
    round (its chunk budget is spent, as an uncut chunk would have spent it)."""
    if documents.chunk_cap(req) is not None and adder.rem_chunk_tokens is not None:
        adder.rem_chunk_tokens = 0


def _reserve(adder: Any, slots: int) -> None:
    """Hold `slots` more of this prefill round's memory for a request it admitted (SGLang's
    `PrefillBudget.reserve`, as if they were tokens it will generate)."""
    if slots > 0:
        adder.memory_budget.reserve(0, slots)


def _set_max_new(sp: Any, max_new: int) -> None:
    sp.max_new_tokens = max_new
    sp.min_new_tokens = min(sp.min_new_tokens, max_new)


def _most_that_fits(held: Callable[[int], int], max_new: int, pool: int) -> int | None:
    """The most new tokens (at least 1) whose footprint fits the pool, or None."""
    if held(1) >= pool:
        return None
    lo, hi = 1, max_new  # held(lo) fits, held(hi) does not; held never falls as the output grows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if held(mid) < pool else (lo, mid)
    return lo


def _allow_auto_truncate() -> bool:
    from sglang.srt.runtime_context import get_serving

    return bool(getattr(get_serving(), "allow_auto_truncate", False))


def _too_large(config: KvcConfig, settings: ResolvedCompression, prompt: int, max_new: int, held: int,
               pool: int, chunk: int | None, fits: int | None, document: int = 0) -> str:
    """The 400's message: what the request would hold at once, and what would fit."""
    s = _with_document(sizes_of(config, settings, prompt, max_new, chunk), document, config)
    read = f"one chunk ({chunk}) of its prompt" if chunk else f"its prompt ({prompt})"
    own = f"its budget ({s.budget - document}) + its document's entries ({document})" if document else \
        f"its budget ({s.budget})"
    growth = (f"{own} + buffer ({s.buffer})" if Moments.of(config).generation
              else f"{own} + max_tokens ({max_new}), decode compression being off")
    advice = (f"max_tokens of at most {fits} fits" if fits is not None else "a smaller budget or prompt is needed")
    if s.reconstruction:
        read += f", one reconstruction forward ({s.reconstruction}: a smaller --kvzip-chunk takes less)"
    return (f"The KV pool ({pool} tokens) cannot hold this request even compressed: it would hold up to "
            f"{held} tokens at once ({read}, the copies of what a compression keeps, {growth}); {advice}")
