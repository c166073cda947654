"""What a finished request's row leaves in the tree, at its release (`KvcRadixCache`'s
`claim_kv_row`): a finished turn after its document (`turns.py`) or a reply and a turn after it
(`replies.py`), or nothing; the ranges of the row whose slots the tree then keeps, which every
`free_kv_row` of the release leaves out (SGLang frees a row in one or two calls:
`--strip-thinking-cache` reports part of it over-allocated), until `on_release`.

With tensor parallelism every rank releases the same requests in the same order and finds the
same candidate (from SGLang's fields and the registry, alike on every rank). A request that may
keep anything is voted on before anything is evicted or inserted: one rank's failure (a planted
fault, a bug) keeps nothing on every rank, so that the ranks' trees stay the same.
"""

from __future__ import annotations

import logging
from typing import Any

from sgl_kvc import req_state
from sgl_kvc.adapter.documents import replies, turns
from sgl_kvc.adapter.documents.plan import plan_of
from sgl_kvc.adapter.documents.registry import DocumentRegistry
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.tp import everywhere

logger = logging.getLogger(__name__)


def keep(tree: Any, registry: DocumentRegistry, req: Any) -> list[tuple[int, int]]:
    """Publish what the finished `req` leaves (a turn, or a reply and a turn) and return the
    ranges of its row whose slots the tree now owns (SGLang must not free them); [] for none."""
    fields = req_state.peek(req)
    if fields is None or fields.rule is None or plan_of(req).own is None or not turns.answered(req):
        return []  # (alike on every rank: none of them votes)
    found = None
    try:
        found = turns.candidate(registry, req) or replies.candidate(tree, registry, req)
        if found is not None:
            failpoints.check("turn_raise", req)
    except Exception:  # noqa: BLE001 - a turn lost, never the release
        logger.exception("a finished turn of %s was not kept", getattr(req, "rid", "?"))
        found = None
    if registry.vote is not None:
        found = found if everywhere(registry.vote, [found is not None])[0] else None
    if found is None:
        return []
    try:
        return found.publish(tree, registry)
    except Exception:  # noqa: BLE001 - publish inserts nothing before its checks pass
        logger.exception("a finished turn of %s was not kept", getattr(req, "rid", "?"))
        return []


def without(ranges: list[tuple[int, int]], kept: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` (half-open) less every range of `kept`."""
    out = list(ranges)
    for k0, k1 in kept:
        cut = []
        for a, b in out:
            if a < k0:
                cut.append((a, min(b, k0)))
            if b > k1:
                cut.append((max(a, k1), b))
        out = [(a, b) for a, b in cut if a < b]
    return out
