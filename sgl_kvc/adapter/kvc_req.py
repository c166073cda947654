"""What sgl-kvc holds for one of SGLang's requests: one object (`KvcReq`) on one attribute of
SGLang's `Req`, owned by this module, and the request's settings read back from that `Req` once,
as it enters the queue (`admit`; `of_request` and `resolved` read what `admit` parsed). Each concern
reads and writes its own fields through `of`; nothing else of sgl-kvc's is set on a `Req`.

Below every other module of the adapter: it names their types only (under `TYPE_CHECKING`, from
modules that do not import it)."""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from sgl_kvc.request_settings import (
    CUSTOM_PARAMS_KEY, RequestCompression, RequestSettingError, from_custom_params, multimodal_conflict,
    server_conflict,
)

if TYPE_CHECKING:
    from sgl_kvc.adapter.documents.links import Document
    from sgl_kvc.adapter.documents.roles import DocumentPlan
    from sgl_kvc.adapter.documents.keys import ExtensionRule
    from sgl_kvc.core.request_state import ReqKvState
    from sgl_kvc.footprint import Sizes
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.request_settings import ResolvedCompression

ATTR = "_sgl_kvc"


@dataclass(eq=False)
class KvcReq:
    """sgl-kvc's fields of one request, grouped by the module that owns each."""

    # `admit` (below): its settings as parsed when it entered the queue, and resolved against the
    # server's (cached with the configuration they were resolved for)
    settings: RequestCompression | None = None
    resolved: tuple[Any, Any] | None = None
    # `adapter/scheduling/admission`: its footprint's sizes, set when it enters the queue, and
    # the longest cached prefix it may start from (None: any), set where a longer one leaves it
    # no room in the pool
    sizes: Sizes | None = None
    prefix_cap: int | None = None
    # `adapter/hooks` (the prefix-match limit): it must compute its whole prompt (H2O, Batch-Max:
    # their statistic sums every prompt query's attention), matching no node but a document's
    whole_prompt: bool = False
    # `adapter/moments/request_life`: its compression state while it holds a row
    state: ReqKvState | None = None
    # `adapter/safety/failures`: the message it is aborted with, once sgl-kvc failed it
    failure: str | None = None
    # `adapter/documents/plan`: what it does with the document it declares (its role, the node
    # its row starts from, the document it compresses), made when it enters the queue and at each
    # match; `rule`: how its document may extend a resident one; `prefix_contents`: the content
    # digests of its prompt's first tokens, by their number (`matching.py`)
    plan: DocumentPlan | None = None
    rule: ExtensionRule | None = None
    prefix_contents: dict[int, str] | None = None
    cuts: int = 0  # its row's cuts inside its document so far (`plan.py`)
    wait_since: float | None = None  # when it first waited for another's publication
    waited_out: bool = False  # it waited its bound out, and waits no more
    # `adapter/documents/radix_cache`: the document node its use was counted for
    counted_use: Any = None
    # `adapter/documents/turns`: the finished turn it started from, which the turn it kept
    # supersedes (dropped once its row is released, where no other request holds it)
    superseded_turn: Document | None = None
    read_turn: Document | None = None  # the turn its row started from before it adopted its extension


def of(req: Any) -> KvcReq:
    """`req`'s fields (created empty the first time)."""
    fields = getattr(req, ATTR, None)
    if fields is None:
        fields = KvcReq()
        setattr(req, ATTR, fields)
    return fields


def peek(req: Any) -> KvcReq | None:
    """`req`'s fields if it has any, else None: a read that attaches nothing (SGLang's request
    inputs that are not a `Req` have no room for one)."""
    return getattr(req, ATTR, None)


# --- read back from a scheduler request ------------------------------------------------------
# What an invalid request runs with until its abort completes: nothing to compress.
_INERT = RequestCompression(policy="none")


def _parse_request(req: Any, config: "KvcConfig | None" = None) -> tuple[RequestCompression, str | None]:
    """The request's settings (validated, and checked against the server's `config` when given),
    or the inert ones and why they are refused."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        settings = from_custom_params(custom)
        field = f"custom_params.{CUSTOM_PARAMS_KEY}"
        conflict = None if config is None else server_conflict(settings, config, field)
        if conflict is None and config is not None and getattr(req, "multimodal_inputs", None) is not None:
            # the processor's pad values are in its prompt (`adapter/kvzip/limits.unscorable`)
            conflict = multimodal_conflict(settings, config, field)
        if conflict is not None:
            raise conflict
        return settings, None
    except RequestSettingError as e:
        return _INERT, f"Invalid {e.param}: {e}"
    except Exception as e:  # noqa: BLE001 - a client's value must never raise in the scheduler
        return _INERT, f"Invalid custom_params ({type(e).__name__})"


def of_request(req: Any, cache: bool = True) -> RequestCompression:
    """The settings of a scheduler request (SGLang's `Req`; with `cache=False` also the tokenized
    input it is made from, left untouched), validated; cached on the request when it entered the
    queue (`admit`). Never raises."""
    fields = peek(req)
    settings = fields.settings if fields is not None else None
    if settings is None:
        settings, _ = _parse_request(req)
        if cache:
            of(req).settings = settings
    return settings


def resolved(req: Any, config: "KvcConfig") -> ResolvedCompression:
    """What a scheduler request runs with on this server (resolved once: the admission hooks ask
    for it several times per request per step)."""
    fields = peek(req)
    cached = fields.resolved if fields is not None else None
    if cached is not None and cached[0] is config:
        return cached[1]
    settings = of_request(req).resolve(config)
    of(req).resolved = (config, settings)
    return settings


def refused_by_sglang(req: Any) -> bool:
    """`req` (SGLang's `Req`) is finished, or SGLang refused it already as it entered the queue
    (its `to_finish`: a prompt past the longest input, a `logprob_start_len` past the prompt).
    SGLang's abort also cuts its prompt to one token: checked again, it drew a wrong refusal of
    sgl-kvc's ("the document (120 tokens) must end before the prompt does (1 tokens)") in place of
    SGLang's own, naming the wrong field (found by `tests/hostile_documents.py`)."""
    return req.finished() or getattr(req, "to_finish", None) is not None


def admit(req: Any, config: "KvcConfig") -> bool:
    """When a request enters the scheduler's queue: parse its settings and check them against the
    server's `config` once; a bad or unservable one aborts it with a 400 (SGLang's
    `set_finish_with_abort`) before it is scheduled, and it runs with no compression until then.
    True when it was refused. Nothing a client sends can raise later inside the scheduler loop."""
    settings, error = _parse_request(req, config)
    of(req).settings = settings
    of(req).resolved = None
    if error is None or refused_by_sglang(req):
        return False
    req.set_finish_with_abort(error, status_code=HTTPStatus.BAD_REQUEST)
    return True
