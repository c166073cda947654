"""Requests sgl-kvc failed: each is aborted alone, once, and on every tensor-parallel rank.

A failure is an exception in sgl-kvc's work for one request (starting its state, scoring,
compacting, committing). `FailureLedger.fail` records it where it happens and drops the request
from sgl-kvc's bookkeeping at once (`drop`: its state, its observations; its KV never enters the
radix tree), so nothing sgl-kvc does later in the step reads it. The abort itself waits for the
end of the scheduler hook that found it (`settle`): with tensor parallelism every rank runs its
own scheduler, and they stay in lock step only if they abort the same requests in the same step,
so the ranks first sum their failures (`RankVote`) and each rank fails what any rank failed. A
failed request is never compressed again and is counted once.

How it is aborted: a request between two chunks of its prompt through SGLang's own abort of a
chunked prefill (its next chunk never runs: a prompt that needed compressing between chunks could
not fit uncompressed); any other through `to_finish`, SGLang's abort of a running request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, Iterable

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.safety.invariants import InvariantViolation
from sgl_kvc.adapter.safety.tp import RankVote, anywhere

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)



class FailedOnAnotherRank(RuntimeError):
    """The request failed on another tensor-parallel rank: it fails here too."""


def failure(req: Req) -> str | None:
    """Why sgl-kvc failed `req` (the message its client gets), or None."""
    return kvc_req.of(req).failure


@dataclass
class FailureLedger:
    drop: Callable[[Req], None]  # forget what sgl-kvc holds for a request (the compressor's)
    vote: RankVote | None = None  # None: a single rank
    _unsettled: list[Req] = field(default_factory=list)
    # Whether sgl-kvc worked for any request since the last settle. The same on every rank: the
    # ranks run the same batches with the same settings and, after each settle, know the same
    # failures, so they work for the same requests; only then can one have failed something.
    active: bool = False

    def fail(self, req: Req, what: str, error: BaseException, message: str | None = None) -> None:
        """Record that sgl-kvc failed to `what` `req`; a request fails once. `message`: what its
        client is told, where it says more than the generic one."""
        if failure(req) is not None:
            return
        if isinstance(error, FailedOnAnotherRank):
            logger.error("sgl-kvc: request %s failed on another tensor-parallel rank; aborting it here too", req.rid)
        else:
            logger.error("sgl-kvc failed to %s request %s; aborting it", what, req.rid, exc_info=error)
        kvc_req.of(req).failure = (message or f"sgl-kvc could not {what} this request ({type(error).__name__}); "
                                             "the server log has details")
        self.active = True
        self.drop(req)
        self._unsettled.append(req)

    def guarded(self, req: Req, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run sgl-kvc work for ONE request; an exception fails that request (None is returned)
        instead of reaching SGLang's event loop, where it would stop every request."""
        self.active = True
        try:
            return fn(*args)
        except InvariantViolation:
            raise  # SGLKVC_CHECK=1 exists to stop the server on a broken pool or tree
        except Exception as e:  # noqa: BLE001 - the point is to contain anything
            self.fail(req, what, e)
            return None

    def agree(self, reqs: Iterable[Req]) -> list[bool]:
        """Per request of `reqs` (the same list on every rank), whether it failed on any rank:
        here, or on another rank (then it is failed here too). One collective on every rank;
        none with a single rank."""
        reqs = list(reqs)
        here = [failure(r) is not None for r in reqs]
        if self.vote is None or not reqs:
            return here
        failed = anywhere(self.vote, here)
        for req, mine, theirs in zip(reqs, here, failed):
            if theirs and not mine:
                self.fail(req, "compress", FailedOnAnotherRank())
        return failed

    def settle(self, reqs: Iterable[Req], scheduler: Scheduler) -> int:
        """At the end of a scheduler hook: agree on the failures among `reqs` with the other
        ranks, then abort every request failed since the last settle. Returns how many. Where
        no rank worked for any request since the last settle (`active`), nothing can have
        failed, and the ranks skip the collective (a decode step with no pass due costs none)."""
        if self.active:
            self.agree(reqs)
        self.active = False
        unsettled, self._unsettled = self._unsettled, []
        for req in unsettled:
            abort(req, failure(req) or "sgl-kvc could not serve this request", scheduler)
        return len(unsettled)


def abort(req: Req, message: str, scheduler: Scheduler) -> None:
    """Finish `req` with an error its client sees (500: the server failed it, not the client).
    Between two chunks of its prompt it is released before its next chunk runs."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if req.finished():
        return
    reason = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    if scheduler is not None and getattr(scheduler, "chunked_req", None) is req:
        # SGLang's own abort of a chunked prefill (`Scheduler.process_pending_chunked_abort`, at
        # the top of the next scheduling step), with this reason for the client.
        req.discard_output_reason = reason
        scheduler._pending_chunked_abort_req = req
        return
    req.to_finish = reason
