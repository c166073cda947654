"""Scheduler hooks, through SGLang's `HookRegistry` (applied by `load_plugins()`).

| target (sglang 0.5.23)                          | kind   | what for                               |
| ----------------------------------------------- | ------ | -------------------------------------- |
| ForwardBatch.init_new                           | after  | request state at first prefill; logical RoPE positions for compacted requests |
| Scheduler.process_batch_result                  | around | documents published (before); moments `prefill`, `chunk` |
| Scheduler.update_running_batch                  | around | moments `decode` and `preempt`; counts SGLang's retractions |
| PrefillAdder.add_one_req / running-token offset | around | admission by footprint (`adapter/scheduling/admission.py`); a document's waiters |
| PrefillAdder._check_prefill_budget              | around | a chunk-compressed prompt: one chunk + what its passes copy and keep |
| PrefillAdder.add_chunked_req                    | around | a prompt's next chunk: what its passes copy and keep, its reconstruction forward (KVzip) |
| Scheduler.handle_generate_request               | around | prompts longer than the pool, compressed between chunks |
| Scheduler.init_req_max_new_tokens               | around | a compressing request's output is bounded by the context; one that cannot fit even compressed is a 400 |
| Req.refresh_fill_ids                            | around | the next tokens of a prompt compressed between chunks or started from a shared document |
| Req.init_next_round_input                       | around | a prefix matched on a shared document: the tokens after it (`adapter/documents/__init__.py`) |
| Req._compute_max_prefix_len                     | around | recompute the observation window on a prefix hit; no longer a prefix than leaves room in the pool |
| Scheduler.get_next_batch_to_run                 | after  | peak number of requests in flight      |
| Scheduler.get_new_batch_prefill                 | around | a request waits while another compresses its document |
| Scheduler._add_request_to_queue                 | around | validate per-request settings (400)    |
| SchedulerInternalStateController.get_internal_state | after | `/v1/kvc/stats` snapshot          |
| ReqToTokenPool.free                             | before | a released request: its state dropped, its prefix hits counted |
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter import documents
from sgl_kvc.adapter.runtime import KvcRuntime, collect_stats, compressor_of
from sgl_kvc.adapter.safety.tp import anywhere, dp_rank
from sgl_kvc.adapter.scheduling import admission
from sgl_kvc.adapter.scheduling.admission import CHUNKED_ATTR
from sgl_kvc.adapter.scheduling.requests import chunk_compressible, released, shifted_fill_ids
from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.config import KvcConfig
from sgl_kvc.policies import policy_class
from sgl_kvc.adapter.kvc_req import admit, resolved

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder"
_REQ = "sglang.srt.managers.schedule_batch.Req"
_REQ_TO_TOKEN = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
_INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
)
STATS_KEY = "sgl_kvc"


def hook_table(config: KvcConfig) -> list[Hook]:
    """The scheduler hooks for this config (each with the target's parameters it reads)."""
    hooks = [
        Hook(f"{_SCHEDULER}.get_next_batch_to_run", _after_next_batch(config), "AFTER", (),
             "peak requests in flight"),
        Hook(f"{_INTERNAL_STATE}.get_internal_state", _after_internal_state(config), "AFTER", (),
             "/v1/kvc/stats"),
        Hook(f"{_SCHEDULER}.update_running_batch", _around_update_running(config), "AROUND", ("batch",),
             "decode and preempt moments"),
        Hook(f"{_REQ_TO_TOKEN}.free", _before_free, "BEFORE", ("req",), "a request's row released"),
    ]
    if config.compressing:
        # With --policy none nothing below may touch SGLang's per-step path.
        hooks += [
            Hook(f"{_FORWARD_BATCH}.init_new", _after_forward_batch(config), "AFTER",
                 ("batch", "model_runner"), "request state; logical positions"),
            Hook(f"{_SCHEDULER}.process_batch_result", _around_batch_result(config), "AROUND", ("batch",),
                 "shared documents published; prefill moment"),
            Hook(f"{_REQ}._compute_max_prefix_len", _around_max_prefix(config), "AROUND", ("input_len",),
                 "the observation window is recomputed on a prefix hit"),
            Hook(f"{_SCHEDULER}._add_request_to_queue", _around_add_to_queue(config), "AROUND", ("req",),
                 "per-request settings checked once"),
            Hook(f"{_ADDER}.add_one_req", admission.around_add_one_req(config), "AROUND", ("req",),
                 "admission by footprint"),
            Hook(f"{_ADDER}._get_running_request_total_token_offset", admission.around_running_offset(config),
                 "AROUND", ("req",), "admission by footprint"),
            Hook(f"{_SCHEDULER}.init_req_max_new_tokens",
                 admission.around_max_new_tokens(config, _reconstructor_of(config)), "AROUND",
                 ("req",), "output bounded by the context; a request that cannot fit even compressed is a 400"),
            Hook(f"{_ADDER}.add_chunked_req", admission.around_add_chunked_req(config), "AROUND",
                 ("req",), "the next chunk and the slots of the pass after it"),
            Hook(f"{_REQ}.refresh_fill_ids", _around_refresh_fill_ids, "AROUND", (),
                 "the next tokens after a compaction between chunks or a shared document"),
            Hook(f"{_REQ}.init_next_round_input", _around_init_next_round, "AROUND", (),
                 "a prefix matched on a shared document: the tokens after it"),
            Hook(f"{_SCHEDULER}.get_new_batch_prefill", _around_new_prefill(config), "AROUND", (),
                 "a request waits while another compresses its document"),
        ]
    if config.chunk_moment is not None:
        hooks += [
            Hook(f"{_ADDER}._check_prefill_budget", admission.around_check_prefill_budget(config), "AROUND",
                 ("req", "extend_input_len", "total_tokens"), "one chunk + what its passes copy and keep"),
            Hook(f"{_SCHEDULER}.handle_generate_request", _around_handle_generate(config), "AROUND",
                 ("recv_req",), "a prompt longer than the pool is accepted"),
        ]
    return hooks


def _after_next_batch(config: KvcConfig):
    def hook(plan: Any, scheduler: Scheduler, *args: Any, **kwargs: Any) -> Any:
        KvcRuntime.of(scheduler, config).observe_plan(plan)
        return plan

    return hook


def _reconstructor_of(config: KvcConfig) -> Callable[[Any], Any]:
    """The process's KVzip reconstruction pass, looked up from a scheduler."""
    return lambda scheduler: compressor_of(scheduler.tp_worker.model_runner, config).reconstructor


def _after_internal_state(config: KvcConfig):
    def hook(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
        scheduler = controller.scheduler
        stats = collect_stats(scheduler, KvcRuntime.of(scheduler, config))
        # With --dp-size N every rank answers; the HTTP side orders and sums them by rank.
        stats["dp_rank"] = dp_rank()
        result.internal_state[STATS_KEY] = stats
        return result

    return hook


def _after_forward_batch(config: KvcConfig):
    def hook(fb: ForwardBatch, cls: Any, batch: ScheduleBatch, model_runner: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        if getattr(batch, "reqs", None) is None or model_runner.is_draft_worker:
            return fb
        compressor = compressor_of(model_runner, config)
        offsets = None
        if fb.forward_mode.is_extend():
            compressor.begin_extend(batch)  # per-request failures abort that request only
            offsets = compressor.extend_position_offsets(batch, fb)
        elif fb.forward_mode.is_decode():
            compressor.begin_decode(batch, fb)
            offsets = compressor.decode_position_offsets(fb.req_pool_indices)
        if offsets is not None:
            # RoPE positions stay logical: a compacted request's next tokens sit at the positions
            # they have in the full sequence, not at its (shorter) physical length.
            fb.positions = fb.positions + offsets.to(fb.positions.dtype)
        return fb

    return hook


def _before_free(pool: Any, req: Req, *args: Any, **kwargs: Any) -> None:
    # Every finished, aborted or retracted request gives its row back here (SGLang's
    # `release_kv_cache`): what sgl-kvc held for it goes at the same moment.
    released(pool, req)


def _around_batch_result(config: KvcConfig):
    def hook(original: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch, *args: Any, **kwargs: Any):
        compressor = compressor_of(scheduler.tp_worker.model_runner, config)
        compressor.serve(scheduler)
        extend = batch.forward_mode.is_extend()
        if extend:  # shared documents, while every request of the batch still holds its row
            compressor.before_prefill_result(batch)
        result = original(scheduler, batch, *args, **kwargs)
        if extend:  # the prompt moments
            compressor.after_prefill(batch)
        return result

    return hook


def _around_update_running(config: KvcConfig):
    def hook(original: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch, *args: Any, **kwargs: Any):
        model_runner = scheduler.tp_worker.model_runner
        compressor = compressor_of(model_runner, config)  # None with --policy none
        if compressor is not None:
            compressor.serve(scheduler)
            if "decode" in config.compress_on:
                compressor.before_decode(batch)
            if "preempt" in config.compress_on and not batch.check_decode_mem():
                compressor.before_preempt(batch)
        before = list(batch.reqs)
        out = original(scheduler, batch, *args, **kwargs)
        # A retracted request released its row (its state went with it, `request_life.released`)
        # and restarts from its tokens.
        remaining = {id(r) for r in batch.reqs}
        retracted = sum(1 for r in before if id(r) not in remaining and r.is_retracted)
        if compressor is not None:
            compressor.retracted(retracted)
        else:
            KvcRuntime.of(scheduler, config).retracted(retracted, model_runner)
        return out

    return hook


def _around_add_to_queue(config: KvcConfig):
    def hook(original: Callable[..., Any], scheduler: Scheduler, req: Req, *a: Any, **kw: Any):
        # The one place every new (and retracted) request passes: settings a client put in
        # `custom_params` are checked here, against this server's configuration too, so a bad
        # or unservable one is a 400 for that request and is never read again by the hooks below.
        if not admit(req, config):
            split = admission.scheduler_chunk(scheduler, req, config) is not None
            documents.declare(req, config, getattr(scheduler, "tree_cache", None), split=split,
                            chunk=admission.server_chunk(scheduler, config))
        admission.remember(req, config, scheduler)
        return original(scheduler, req, *a, **kw)

    return hook


def _around_max_prefix(config: KvcConfig):
    def hook(original: Callable[..., Any], req: Req, input_len: int, *args: Any, **kwargs: Any):
        limit = original(req, input_len, *args, **kwargs)
        kvc_req.of(req).whole_prompt = False
        cap = kvc_req.of(req).prefix_cap  # a longer prefix would leave it no room in the pool
        if cap is not None:
            limit = min(limit, cap)
        if "prefill" not in config.compress_on or not resolved(req, config).compressing:
            return limit
        settings = resolved(req, config)
        budget = settings.budget.at(input_len)
        policy = policy_class(settings.policy)
        if policy.accumulate_prefill and not getattr(req.kv, "holds_kv", False):
            # H2O / Batch-Max score by the attention every prompt query paid each token; a prefix
            # served from the tree was never attended by this request's queries. Such a request
            # computes its whole prompt (its own earlier chunks, held in its row, still count),
            # unless it can never be compressed: its prompt and all its output within its budget.
            # Only a shared document it declares may stand for part of it: its entries have no
            # statistic by design, theirs start at its end (`KvcRadixCache.match_prefix`).
            if input_len + int(req.sampling_params.max_new_tokens or 0) > budget:
                kvc_req.of(req).whole_prompt = True
            return limit
        # Recompute the last `window` prompt tokens even on a prefix hit when their queries may
        # score the prompt (the observation window): by the pass after prefill, or by a later
        # pass, before `window` decode queries have taken their place in the window. A prompt
        # that stays within its budget for that long matches exactly as on plain SGLang.
        if input_len + config.kv_window <= budget:
            return limit
        return min(limit, max(input_len - config.kv_window, 0))

    return hook


def _around_handle_generate(config: KvcConfig):
    def hook(original: Callable[..., Any], scheduler: Scheduler, recv_req: Any, *args: Any, **kwargs: Any):
        chunk = getattr(scheduler, "chunked_prefill_size", None)
        radix = not getattr(scheduler.tree_cache, "disable", True)  # else SGLang admits by the whole prompt
        if not chunk or chunk <= 0 or not radix or not chunk_compressible(recv_req, config):
            return original(scheduler, recv_req, *args, **kwargs)
        # A prompt compressed between its chunks is bounded by the model's context, not by
        # the pool: SGLang's limits (`TpModelWorker.get_worker_info`: the smaller of the two)
        # are lifted for this request only. (Without the radix cache SGLang admits an
        # `ignore_eos` request by its whole prompt, `PrefillAdder.add_one_req_ignore_eos`: the
        # pool bounds it there.) `init_req_max_new_tokens` runs inside, before SGLang has set the
        # new Req's `logprob_start_len`, so it is told here that the request is compressed
        # between chunks (`CHUNKED_ATTR`).
        saved = scheduler.max_req_len, scheduler.max_req_input_len
        scheduler.max_req_len = int(scheduler.model_config.context_len) - 1
        scheduler.max_req_input_len = scheduler.max_req_len - 5
        setattr(scheduler, CHUNKED_ATTR, True)
        try:
            return original(scheduler, recv_req, *args, **kwargs)
        finally:
            scheduler.max_req_len, scheduler.max_req_input_len = saved
            setattr(scheduler, CHUNKED_ATTR, None)

    return hook


def _around_new_prefill(config: KvcConfig):
    def hook(original: Callable[..., Any], scheduler: Scheduler, *args: Any, **kwargs: Any):
        # Concurrent first requests for one document: one compresses it, the others stay in the
        # queue meanwhile (left out of this round's admission, then put back in front, in order)
        # and start from it once it is published (`documents.held_back`), or, once they have
        # waited --kv-document-wait, read it themselves (`documents.stop_waiting`).
        registry = documents.registry_of(getattr(scheduler, "tree_cache", None))
        if registry is None:
            return original(scheduler, *args, **kwargs)
        held = documents.held_back(scheduler.waiting_queue, registry)
        if held:
            late = documents.overdue(held, config.kv_document_wait)
            # Each rank's clock decides alone; the ranks' schedulers must admit the same requests,
            # so one that is late on any rank stops waiting on every rank (every rank holds the
            # same requests here: the vote is taken by all or by none).
            late = anywhere(compressor_of(scheduler.tp_worker.model_runner, config).failures.vote, late)
            held = documents.stop_waiting(held, late, registry)
        if held:
            ids = {id(r) for r in held}
            scheduler.waiting_queue = [r for r in scheduler.waiting_queue if id(r) not in ids]
        try:
            plan = original(scheduler, *args, **kwargs)
        finally:
            if held:
                scheduler.waiting_queue = held + scheduler.waiting_queue
        documents.compressing(getattr(getattr(plan, "batch_to_run", None), "reqs", None) or [], registry)
        return plan

    return hook


def _around_init_next_round(original: Callable[..., Any], req: Req, *args: Any, **kwargs: Any):
    if kwargs.get("tree_cache", args[0] if args else None) is None:
        # No match this round (SGLang's next chunk of a prompt it is reading): its prefix, and
        # the shift of its fill ids (`_around_refresh_fill_ids`), stay what they are.
        return original(req, *args, **kwargs)
    documents.unmatched(req)  # its tokens are matched afresh, unshifted
    out = original(req, *args, **kwargs)
    documents.matched(req)
    return out


def _around_refresh_fill_ids(original: Callable[..., Any], req: Req, *args: Any, **kwargs: Any):
    out = original(req, *args, **kwargs)
    state = kvc_req.of(req).state
    shift = documents.plan_of(req).fill_offset if state is None else state.offset if state.fill_shift else 0
    if shift:
        shifted_fill_ids(req, shift)
    return out
