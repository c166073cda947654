"""Refuse prompts with out-of-vocabulary token ids (and `extra_key` / `cache_salt` values in the
namespace of sgl-kvc's shared documents, a `logprob_start_len` below -1, a shared document its
prompt cannot compress) before they reach the scheduler.

SGLang 0.5.23 does not range-check prompt token ids: `"prompt": [999999]` (or `[-1]`) on
`/v1/completions`, `input_ids` on `/v1/chat/completions` or the native `/generate`, reaches the
model's embedding lookup, whose IndexError kills the scheduler and with it the server.

Every generate request, whatever its entry point (OpenAI routes, `/generate`, batches, the
Python engine), passes `TokenizerManager._validate_one_request(obj, input_ids)` in the HTTP
process once its prompt is tokenized. A BEFORE hook there raises `ValueError`, which SGLang's
handlers already answer as a 400 for that request alone (the OpenAI routes add the error
envelope, see `sgl_kvc.server.errors`).
"""

from __future__ import annotations

from typing import Any, Sequence

from sgl_kvc.adapter.sglang_api import Hook

TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def hook_table() -> list[Hook]:
    """Installed in every SGLang process; the hook only ever runs in the process that owns the
    TokenizerManager (the HTTP server)."""
    return [Hook(TARGET, _before_validate_one_request, "BEFORE", ("obj", "input_ids"),
                 "out-of-vocabulary prompt token ids, a reserved extra_key or cache_salt, a logprob_start_len "
                 "below -1, a document its prompt cannot compress are a 400")]


def out_of_vocab_message(input_ids: Sequence[Any] | None, vocab_size: int) -> str | None:
    """Why `input_ids` cannot be served by a model with `vocab_size` tokens, or None."""
    if not input_ids:
        return None  # empty prompts and input_embeds requests are SGLang's own checks
    try:
        # min/max run in C: a long prompt costs microseconds; the loop below only runs to
        # name the culprit.
        if 0 <= min(input_ids) and max(input_ids) < vocab_size:
            return None
    except TypeError:
        pass  # not all numbers
    for pos, tok in enumerate(input_ids):
        if not isinstance(tok, int) or not 0 <= tok < vocab_size:
            return (
                f"The prompt contains token id {tok!r} at position {pos}, which is not a "
                f"token of this model: token ids must be integers from 0 to {vocab_size - 1}."
            )
    return None


def _has_multimodal_input(manager: Any, obj: Any) -> bool:
    # A multimodal processor replaces the image/audio placeholders in the prompt with pad
    # values far outside the vocabulary (the model swaps in the encoder's embeddings there),
    # so such prompts are not range-checked. Without a processor, media fields do nothing
    # to the prompt and the check applies.
    if getattr(manager, "mm_processor", None) is None:
        return False
    return any(
        getattr(obj, name, None) is not None for name in ("image_data", "video_data", "audio_data")
    )


def _before_validate_one_request(
    manager: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any
) -> None:
    from sgl_kvc.adapter.documents import reserved_namespace

    # The shared documents' namespace is sgl-kvc's (the HTTP routes refuse it first, naming the
    # field; this covers every other entry point, the Python engine's included).
    for name in ("extra_key", "cache_salt"):
        message = reserved_namespace(name, getattr(obj, name, None))
        if message is not None:
            raise ValueError(message)
    message = logprob_start_message(getattr(obj, "return_logprob", None), getattr(obj, "logprob_start_len", None))
    if message is not None:
        raise ValueError(message)
    if input_ids is None or _has_multimodal_input(manager, obj):
        return None
    message = out_of_vocab_message(input_ids, manager.model_config.vocab_size)
    if message is not None:
        raise ValueError(message)
    _check_document(obj, len(input_ids))
    return None


def logprob_start_message(return_logprob: Any, start: Any, param: str = "logprob_start_len") -> str | None:
    """Why a `logprob_start_len` cannot be served, or None. -1 means the output's log-probabilities
    only; below it, SGLang (plain SGLang too) asserts in its scheduler loop when it processes the
    prefill's log-probabilities, and the server exits (found by `tests/hostile_documents.py`). Without
    `return_logprob` SGLang ignores the field."""
    if return_logprob is not True or not isinstance(start, int) or isinstance(start, bool) or start >= -1:
        return None
    return (f"Invalid '{param}': expected -1 (the output's log-probabilities only) or the prompt position "
            f"of the first log-probability to return (0 or more), but got {start} instead.")


def _check_document(obj: Any, prompt_len: int) -> None:
    """A document its prompt cannot compress is a 400 here, where the prompt is first tokenized,
    before a streamed request's stream starts (`PromptSettings.document_conflict`); the scheduler
    checks it again. Found there only, it was an error event inside a 200 stream, and a 400 whose
    field was not named. The settings are the ones the body guard parsed, where the request came
    through it (`REQUEST_SETTINGS`; on the chat route with the document's tokens counted), parsed
    here otherwise (the Python engine)."""
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.request_settings import (
        CUSTOM_PARAMS_KEY, REQUEST_SETTINGS, PromptSettings, RequestSettingError, from_custom_params,
    )

    sampling = getattr(obj, "sampling_params", None)
    custom = sampling.get("custom_params") if isinstance(sampling, dict) else None
    config = KvcConfig.from_env()
    if not isinstance(custom, dict) or CUSTOM_PARAMS_KEY not in custom or config is None or not config.compressing:
        return
    body = REQUEST_SETTINGS.get()
    settings = None if body is None else body.find(custom[CUSTOM_PARAMS_KEY])
    if settings is None:
        try:
            settings = PromptSettings(from_custom_params(custom), f"custom_params.{CUSTOM_PARAMS_KEY}",
                                      custom[CUSTOM_PARAMS_KEY])
        except RequestSettingError:
            return  # the HTTP layer names it; the scheduler refuses it on every other entry point
    conflict = settings.document_conflict(prompt_len, config)
    if conflict is not None:
        raise ValueError(f"Invalid '{conflict.param}': {conflict}.")
