"""What sgl-kvc holds for one of SGLang's requests: one object (`KvcReq`) on one attribute of
SGLang's `Req`, owned by this module. Each concern reads and writes its own fields through `of`;
nothing else of sgl-kvc's is set on a `Req`.

A leaf module: it imports nothing of sgl-kvc at run time, so every module may use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgl_kvc.adapter.documents.links import Document
    from sgl_kvc.adapter.documents.plan import DocumentPlan
    from sgl_kvc.adapter.documents.keys import ExtensionRule
    from sgl_kvc.core.request_state import ReqKvState
    from sgl_kvc.footprint import Sizes
    from sgl_kvc.request_settings import RequestCompression

ATTR = "_sgl_kvc"


@dataclass(eq=False)
class KvcReq:
    """sgl-kvc's fields of one request, grouped by the module that owns each."""

    # `request_settings`: its settings as parsed when it entered the queue, and resolved
    # against the server's (cached with the configuration they were resolved for)
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
    # `adapter/moments/compressor`: its compression state while it holds a row
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
