"""What sgl-kvc reads from and does to one SGLang `Req` besides its settings (those are
`sgl_kvc/request_settings.py`): its chunked-prefill phase, and hearing when its row is released
(a failed request is aborted by `adapter/safety/failures.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from sgl_kvc.config import KvcConfig
from sgl_kvc.adapter.kvc_req import of_request, resolved

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

_RELEASE_ATTR = "_sgl_kvc_on_release"  # on SGLang's ReqToTokenPool


def is_middle_chunk(batch: ScheduleBatch, req: Req) -> bool:
    """True when this extend batch ran a chunk of `req`'s prompt that is not its last one.

    SGLang marks the request still being chunked as `batch.chunked_req`; its own counter
    `inflight_middle_chunks` is already decremented when an after-hook runs, so it cannot tell.
    """
    return getattr(batch, "chunked_req", None) is req or getattr(req, "inflight_middle_chunks", 0) > 0


def on_release(req_to_token_pool: ReqToTokenPool, listener: Callable[[Req], None]) -> None:
    """Call `listener(req)` whenever a request gives its row back to `req_to_token_pool`
    (finished, aborted or retracted; SGLang's `release_kv_cache`), before the row is freed."""
    listeners = getattr(req_to_token_pool, _RELEASE_ATTR, ())
    setattr(req_to_token_pool, _RELEASE_ATTR, (*listeners, listener))


def released(req_to_token_pool: ReqToTokenPool, req: Req) -> None:
    """Tell the listeners of `req_to_token_pool` that `req` releases its row."""
    for listener in getattr(req_to_token_pool, _RELEASE_ATTR, ()):
        listener(req)


def chunk_compressible(req: Req | TokenizedGenerateReqInput, config: KvcConfig) -> bool:
    """Whether `req` (SGLang's `Req`, or the `TokenizedGenerateReqInput` it is made from) is
    compressed between two chunks of its prompt (the chunk moment): a compressing request on a
    server with that moment on, unless it asked for prompt log-probabilities (they index the
    prompt's tokens) or carries multimodal inputs (their positions are not logical ones)."""
    if config.chunk_moment is None:
        return False
    prompt = getattr(req, "origin_input_ids", None)
    tokenized = prompt is None  # the tokenized input, before its Req exists
    if tokenized:
        prompt = getattr(req, "input_ids", None) or ()
    settings = of_request(req, cache=False).resolve(config) if tokenized else resolved(req, config)
    if not settings.compressing:
        return False
    if asks_prompt_logprobs(req, len(prompt)):
        return False
    return getattr(req, "multimodal_inputs", None) is None and getattr(req, "mm_inputs", None) is None


def asks_prompt_logprobs(req: Any, prompt_len: int) -> bool:
    """Whether `req` (SGLang's `Req`, or its tokenized input) asks for log-probabilities of
    some of its `prompt_len` prompt tokens (`logprob_start_len` within the prompt: `/generate`'s
    own field, `echo` with `logprobs` on `/v1/completions`). SGLang computes them in the forward
    that reads those tokens and expects one per prompt token from `logprob_start_len`, counted
    from the request's matched prefix (`prefix_len` slots taken as as many tokens): such a
    request reads each of those tokens itself, into a cache that holds every token before them."""
    return bool(getattr(req, "return_logprob", False)) and 0 <= getattr(req, "logprob_start_len", -1) < prompt_len


def shifted_fill_ids(req: Req, offset: int) -> None:
    """A request compacted between two chunks holds `offset` fewer entries than the tokens it
    has processed: SGLang reads the next chunk's tokens at `prefix_len` (its physical length) in
    `full_untruncated_fill_ids`, so that array starts `offset` tokens later (SGLang's
    `prepare_for_extend`: `get_fill_ids()[prefix_len:]`; its remaining prompt: `len(...) -
    prefix_len`)."""
    req.full_untruncated_fill_ids = (req.origin_input_ids + req.output_ids)[offset:]


def insert_exact_prefix(req: Req, tree_cache: BasePrefixCache) -> None:
    """Before the first compaction between chunks: what the request computed so far is still
    exact KV of its prompt, so the radix tree gets it, as SGLang would have published it before
    the next chunk (`checkpoint_kv_cache`); a later request with the same prefix hits it. Chunks
    computed after a compaction attended to a compressed cache: their KV is not the prompt's and
    is never published (the compaction sets `skip_radix_cache_insert`)."""
    if req.skip_radix_cache_insert:
        return
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    checkpoint_kv_cache(req, tree_cache)
