"""Concurrent first requests of one document compress it once: a request waits (stays in the
queue) only behind another that is admitted and compresses the same document (`held_back`,
`waits_in_round`), and at most `--kv-document-wait` seconds in all (`stop_waiting`): the
publisher's prompt, hence how long it reads, is its own tenant's choice. After that the waiter
reads the document itself."""

from __future__ import annotations

import time
from typing import Any

from sgl_kvc import req_state
from sgl_kvc.adapter.documents.plan import declared, may_start_from, publishes
from sgl_kvc.adapter.documents.registry import DocumentRegistry


def held_back(waiting: list[Any], registry: DocumentRegistry) -> list[Any]:
    """The waiting requests that wait for their document to be published rather than compress it
    themselves: another request in flight (admitted, `compressing`) compresses it. Never behind one
    that is only queued (it may not be admitted for a long time, or ever: the first of them that
    is admitted compresses it, and the others wait for it from then on, `waits_in_round`), never
    past the server's bound (`stop_waiting`), and never one that may not start from it
    (`may_start_from`)."""
    held = []
    for req in waiting:
        key = declared(req)
        if key is None or registry.get(key) is not None or not may_start_from(req) or waited_out(req):
            continue
        by = registry.compressed_by(key)
        if by is not None and by is not req:
            _waits(req)
            held.append(req)
    return held


def waits_in_round(req: Any, admitted: list[Any], registry: DocumentRegistry | None) -> bool:
    """Whether `req`, about to be admitted in a prefill round, waits instead: a request this round
    already admitted (`admitted`, SGLang's `can_run_list`) compresses the same document, and will
    be registered as compressing it (`compressing`)."""
    key = declared(req)
    if (key is None or registry is None or registry.get(key) is not None or not may_start_from(req)
            or waited_out(req)):
        return False
    for other in admitted:
        k = declared(other)
        if other is not req and k is not None and k.digest == key.digest and publishes(other):
            _waits(req)
            return True
    return False


def overdue(held: list[Any], bound: float, now: float | None = None) -> list[bool]:
    """Which of the held requests have waited `bound` seconds (each since it first waited),
    by this process's clock: tensor-parallel ranks vote on it before acting (`stop_waiting`)."""
    now = time.monotonic() if now is None else now
    return [now - (req_state.of(req).wait_since or now) >= bound for req in held]


def stop_waiting(held: list[Any], late: list[bool], registry: DocumentRegistry) -> list[Any]:
    """The held requests that go on waiting. Those `late` (past `--kv-document-wait`, as every
    rank agreed) wait no more for this document: they read it themselves, whatever the publisher
    they waited for still reads (its prompt is of its own tenant's choosing), and are counted in
    `documents.waited_out`."""
    still = []
    for req, done in zip(held, late):
        if done:
            req_state.of(req).waited_out = True
            registry.stats.waited_out += 1
        else:
            still.append(req)
    return still


def waited_out(req: Any) -> bool:
    return req_state.of(req).waited_out


def _waits(req: Any) -> None:
    fields = req_state.of(req)
    if fields.wait_since is None:
        fields.wait_since = time.monotonic()


def compressing(admitted: list[Any], registry: DocumentRegistry) -> None:
    """Requests just admitted to read their prompt that compress their document: registered, so
    that later ones wait for it (`held_back`). Those that ended without publishing are forgotten."""
    registry.forget_gone()
    for req in admitted:
        key = declared(req)
        if key is not None and publishes(req) and registry.get(key) is None and registry.compressed_by(key) is None:
            registry.publishers[key.digest] = req
