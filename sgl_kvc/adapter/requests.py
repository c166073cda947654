"""What sgl-kvc reads from and does to one SGLang `Req`: its validated compression settings, its
chunked-prefill phase, and hearing when its row is released (a failed request is aborted by
`adapter/failures.py`).

Settings are validated once per request, when the request enters the scheduler's queue; a bad one
aborts that request with a 400 (SGLang's own `set_finish_with_abort` path) and is never read again,
so nothing a client sends can raise later inside the scheduler loop.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable

from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY, RequestCompression, RequestSettingError, from_custom_params, server_conflict,
)

_SETTINGS_ATTR = "_sgl_kvc_settings"
_RELEASE_ATTR = "_sgl_kvc_on_release"  # on SGLang's ReqToTokenPool
# What an invalid request runs with until its abort completes: nothing to compress.
_INERT = RequestCompression(policy="none")


def _parse(req: Any, config: KvcConfig | None = None) -> tuple[RequestCompression, str | None]:
    """The request's settings (validated, and resolved against the server's `config` when given),
    or the inert ones and why they are refused."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        settings = from_custom_params(custom)
        conflict = None if config is None else server_conflict(settings, config, f"custom_params.{CUSTOM_PARAMS_KEY}")
        if conflict is not None:
            raise conflict
        return settings, None
    except RequestSettingError as e:
        return _INERT, f"Invalid {e.param}: {e}"
    except Exception as e:  # noqa: BLE001 - a client's value must never raise in the scheduler
        return _INERT, f"Invalid custom_params ({type(e).__name__})"


def request_settings(req: Any) -> RequestCompression:
    """The request's validated settings (cached on the request when it entered the queue,
    `reject_invalid`); never raises."""
    settings = getattr(req, _SETTINGS_ATTR, None)
    if settings is None:
        settings, _ = _parse(req)
        setattr(req, _SETTINGS_ATTR, settings)
    return settings


def reject_invalid(req: Any, config: KvcConfig) -> bool:
    """When a request enters the scheduler's queue: parse its settings and resolve them against
    the server's `config` once; a bad or unservable one aborts it with a 400 before it is
    scheduled (and it runs with no compression until then)."""
    settings, error = _parse(req, config)
    setattr(req, _SETTINGS_ATTR, settings)
    if error is None or req.finished():
        return False
    req.set_finish_with_abort(error, status_code=HTTPStatus.BAD_REQUEST)
    return True


def is_middle_chunk(batch: Any, req: Any) -> bool:
    """True when this extend batch ran a chunk of `req`'s prompt that is not its last one.

    SGLang marks the request still being chunked as `batch.chunked_req`; its own counter
    `inflight_middle_chunks` is already decremented when an after-hook runs, so it cannot tell.
    """
    return getattr(batch, "chunked_req", None) is req or getattr(req, "inflight_middle_chunks", 0) > 0


def on_release(req_to_token_pool: Any, listener: Callable[[Any], None]) -> None:
    """Call `listener(req)` whenever a request gives its row back to `req_to_token_pool`
    (finished, aborted or retracted; SGLang's `release_kv_cache`), before the row is freed."""
    listeners = getattr(req_to_token_pool, _RELEASE_ATTR, ())
    setattr(req_to_token_pool, _RELEASE_ATTR, (*listeners, listener))


def released(req_to_token_pool: Any, req: Any) -> None:
    """Tell the listeners of `req_to_token_pool` that `req` releases its row."""
    for listener in getattr(req_to_token_pool, _RELEASE_ATTR, ()):
        listener(req)


def chunk_compressible(req: Any, config: Any) -> bool:
    """Whether `req` (SGLang's `Req`, or the `TokenizedGenerateReqInput` it is made from) is
    compressed between two chunks of its prompt (the chunk moment): a compressing request on a
    server with that moment on, unless it asked for prompt log-probabilities (they index the
    prompt's tokens) or carries multimodal inputs (their positions are not logical ones)."""
    if config.chunk_moment is None:
        return False
    prompt = getattr(req, "origin_input_ids", None)
    if prompt is None:  # the tokenized input, before its Req exists
        prompt = getattr(req, "input_ids", None) or ()
        settings, _ = _parse(req)
    else:
        settings = request_settings(req)
    if (settings.policy or config.policy) == "none":
        return False
    if getattr(req, "return_logprob", False) and 0 <= getattr(req, "logprob_start_len", -1) < len(prompt):
        return False
    return getattr(req, "multimodal_inputs", None) is None and getattr(req, "mm_inputs", None) is None


def shifted_fill_ids(req: Any, offset: int) -> None:
    """A request compacted between two chunks holds `offset` fewer entries than the tokens it
    has processed: SGLang reads the next chunk's tokens at `prefix_len` (its physical length) in
    `full_untruncated_fill_ids`, so that array starts `offset` tokens later (SGLang's
    `prepare_for_extend`: `get_fill_ids()[prefix_len:]`; its remaining prompt: `len(...) -
    prefix_len`)."""
    req.full_untruncated_fill_ids = (req.origin_input_ids + req.output_ids)[offset:]


def publish_exact_prefix(req: Any, tree_cache: Any) -> None:
    """Before the first compaction between chunks: what the request computed so far is still
    exact KV of its prompt, so the radix tree gets it, as SGLang would have published it before
    the next chunk (`checkpoint_kv_cache`); a later request with the same prefix hits it. Chunks
    computed after a compaction attended to a compressed cache: their KV is not the prompt's and
    is never published (the compaction sets `skip_radix_cache_insert`)."""
    if req.skip_radix_cache_insert:
        return
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    checkpoint_kv_cache(req, tree_cache)
