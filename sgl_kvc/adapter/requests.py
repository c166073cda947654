"""What sgl-kvc reads from and does to one SGLang `Req`: its validated compression settings, its
chunked-prefill phase, aborting it with a message, and hearing when its row is released.

Settings are validated once per request, when the request enters the scheduler's queue; a bad one
aborts that request with a 400 (SGLang's own `set_finish_with_abort` path) and is never read again,
so nothing a client sends can raise later inside the scheduler loop.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable

from sgl_kvc.request_settings import RequestCompression, RequestSettingError, from_custom_params

_SETTINGS_ATTR = "_sgl_kvc_settings"
_RELEASE_ATTR = "_sgl_kvc_on_release"  # on SGLang's ReqToTokenPool
_ERROR_ATTR = "_sgl_kvc_settings_error"
# What an invalid request runs with until its abort completes: nothing to compress.
_INERT = RequestCompression(policy="none")


def _parse(req: Any) -> tuple[RequestCompression, str | None]:
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        return from_custom_params(custom), None
    except RequestSettingError as e:
        return _INERT, f"Invalid {e.param}: {e}"
    except Exception as e:  # noqa: BLE001 - a client's value must never raise in the scheduler
        return _INERT, f"Invalid custom_params ({type(e).__name__})"


def request_settings(req: Any) -> RequestCompression:
    """The request's validated settings (cached on the request); never raises."""
    settings = getattr(req, _SETTINGS_ATTR, None)
    if settings is None:
        settings, error = _parse(req)
        setattr(req, _SETTINGS_ATTR, settings)
        setattr(req, _ERROR_ATTR, error)
    return settings


def settings_error(req: Any) -> str | None:
    """Why the request's settings are invalid, or None."""
    request_settings(req)
    return getattr(req, _ERROR_ATTR, None)


def reject_invalid(req: Any) -> bool:
    """Abort a request whose settings are invalid with a 400 before it is scheduled."""
    error = settings_error(req)
    if error is None or req.finished():
        return False
    req.set_finish_with_abort(error, status_code=HTTPStatus.BAD_REQUEST)
    return True


def abort_running(req: Any, message: str) -> None:
    """Finish a scheduled request at its next step with an error the client sees (SGLang's
    own abort path for running requests: `to_finish`, then its normal release)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if not req.finished():
        req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")


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
