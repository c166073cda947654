"""The failure ledger: a request sgl-kvc fails is dropped at once, aborted alone and once, at the
end of the hook, on every tensor-parallel rank (the vote stands in for the other rank)."""

from __future__ import annotations

from http import HTTPStatus
from types import SimpleNamespace

import torch

from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank, FailureLedger, failure
from sgl_kvc.adapter.safety.tp import RankVote


def _req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, to_finish=None, discard_output_reason=None, finished=lambda: False)


def _ledger(other_rank: list[int] | None = None) -> tuple[FailureLedger, list]:
    """A ledger whose vote adds `other_rank`'s failures (None: a single rank); and what it dropped."""
    dropped: list = []
    vote = None
    if other_rank is not None:
        vote = RankVote(2, lambda t: t.add_(torch.tensor(other_rank, dtype=t.dtype)))
    return FailureLedger(drop=dropped.append, vote=vote), dropped


def test_a_request_fails_once_and_is_aborted_when_the_hook_settles() -> None:
    ledger, dropped = _ledger()
    a, b = _req("a"), _req("b")
    ledger.fail(a, "compress", ValueError("first"))
    ledger.fail(a, "compress", RuntimeError("second"))  # the same request again: nothing more
    assert dropped == [a] and "ValueError" in failure(a)
    assert a.to_finish is None  # not before the hook ends
    assert ledger.settle([a, b], scheduler=None) == 1
    assert a.to_finish.status_code == HTTPStatus.INTERNAL_SERVER_ERROR and "sgl-kvc could not compress" in a.to_finish.message
    assert b.to_finish is None and failure(b) is None
    assert ledger.settle([a, b], scheduler=None) == 0  # counted once


def test_a_request_failed_on_another_rank_fails_here_too() -> None:
    ledger, dropped = _ledger(other_rank=[0, 1, 0])
    reqs = [_req("a"), _req("b"), _req("c")]
    ledger.guarded(reqs[1], "compress", lambda: None)  # worked for it here too, and succeeded
    assert ledger.settle(reqs, scheduler=None) == 1
    assert dropped == [reqs[1]] and FailedOnAnotherRank.__name__ in failure(reqs[1])
    assert [r.to_finish is not None for r in reqs] == [False, True, False]


def test_guarded_work_that_raises_fails_its_request_only() -> None:
    ledger, _ = _ledger()
    a, b = _req("a"), _req("b")
    assert ledger.guarded(a, "start", lambda: 1 / 0) is None
    assert ledger.guarded(b, "start", lambda: 7) == 7
    assert failure(a) is not None and failure(b) is None


def test_a_request_between_two_chunks_is_released_before_its_next_chunk() -> None:
    """Through SGLang's abort of a chunked prefill, with sgl-kvc's message for the client."""
    ledger, _ = _ledger()
    req = _req("long")
    scheduler = SimpleNamespace(chunked_req=req, _pending_chunked_abort_req=None)
    ledger.fail(req, "compress", ValueError("planted"))
    ledger.settle([req], scheduler)
    assert scheduler._pending_chunked_abort_req is req and req.to_finish is None
    assert req.discard_output_reason.status_code == HTTPStatus.INTERNAL_SERVER_ERROR


def test_no_collective_where_no_rank_worked_for_a_request() -> None:
    """A decode step with no pass due on any rank: the ranks skip the vote; one with work votes."""
    calls: list[int] = []
    ledger = FailureLedger(drop=lambda r: None, vote=RankVote(2, lambda t: calls.append(1)))
    reqs = [_req("a"), _req("b")]
    assert ledger.settle(reqs, scheduler=None) == 0 and calls == []
    ledger.guarded(reqs[0], "compress", lambda: None)
    ledger.settle(reqs, scheduler=None)
    assert calls == [1]
    ledger.settle(reqs, scheduler=None)  # a quiet step again
    assert calls == [1]
