"""Planted faults for tests, named in `SGLKVC_FAILPOINTS` (comma separated) at server start.

They prove that the safety nets work on a live server: that an exception in sgl-kvc code for
one request aborts only that request (on every tensor-parallel rank), and that `SGLKVC_CHECK=1`
catches a broken pool. Nothing is active unless the variable names it; a client cannot turn one
on. `name@R` plants the fault on tensor-parallel rank R only (a fault one rank sees alone).

- `compress_raise`: compressing a request whose id starts with `failpoint-compress` raises.
- `rewrite_raise`: rewriting the row of a request whose id starts with `failpoint-rewrite`
  raises, after its kept entries moved (with others of the same step) and before any row or
  slot of it changed.
- `leak_slot`: compacting a request whose id starts with `failpoint-leak` forgets to free one
  evicted slot (an accounting error).
- `observe_raise`: recording the attention observations (window queries) of a request whose id
  starts with `failpoint-observe` raises in the second layer of the rank, after the first
  layer recorded its own.
- `reconstruct_raise`: scoring the reconstruction pass (KVzip) of a request whose id starts with
  `failpoint-reconstruct` raises in the first layer of the rank, while SGLang runs the pass's
  forward with the other requests due in the same moment.
- `kvzip_plan_raise`: planning the reconstruction pass (KVzip) of a request whose id starts with
  `failpoint-kvzip` raises, before any of its forwards (`kvzip_plan_raise@R`: on rank R only, so
  that the ranks must agree on the forwards they run without it).
- `document_raise`: publishing the shared document of a request whose id starts with
  `failpoint-document` raises after its pass, before its entries are copied into the node's slots
  or its cut row becomes the node (`document_raise@R`: on rank R only, so that the ranks must agree
  not to publish it).
- `node_raise`: making the node of the shared document (or extension) a request whose id starts
  with `failpoint-node` publishes raises where the node's metadata is made (`Compressed.compact`):
  from copies, after its entries were copied into the node's fresh slots; from a cut row, after its
  row was checked. Either way before the ranks' last vote (`node_raise@R`: on rank R only).
- `adopt_raise`: a request whose id starts with `failpoint-adopt`, which extends a resident document
  on a server that compresses documents between chunks, raises when it would go on from the
  extension it published (`extensions.adopt`), before its row changed.
- `turn_raise`: keeping the finished turn (or compacted reply) of a request whose id starts with
  `failpoint-turn` raises after its checks, before its node is inserted (SGLang's release then
  frees its row whole).
- `tp_local_scores`: with tensor parallelism, each rank chooses the shared selection of a
  request whose id starts with `failpoint-tp` from its own heads' scores.
- `skip_compaction`: the compaction of a request whose id starts with `failpoint-skip-<moment>`
  finds no free slots for its kept entries (as in a full pool) at that moment (`chunk`,
  `prefill`, `decode` or `preempt`); its selection was made.

Serving code reaches them only through this module, one call per site (docs/safety.md, "Checks
for tests"); `sgl_kvc/core/` knows nothing of them.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

ENV = "SGLKVC_FAILPOINTS"

# What a raising fault says it was doing, per name.
_DOING = {"compress_raise": "compressing", "rewrite_raise": "rewriting the row of",
          "reconstruct_raise": "scoring the context reconstruction of",
          "kvzip_plan_raise": "planning the context reconstruction of",
          "document_raise": "publishing the shared document of",
          "node_raise": "making the node of the shared document of",
          "adopt_raise": "going on from the published extension of", "turn_raise": "keeping the finished turn of"}
# On the observation store: the rows of the batch being run that `observe_raise` is planted
# for (set by `observing`; the store itself knows nothing of it).
_OBSERVE_ROWS_ATTR = "_sgl_kvc_failpoint_rows"


class PlantedFault(RuntimeError):
    pass


def active(name: str) -> bool:
    for entry in os.environ.get(ENV, "").split(","):
        planted, _, rank = entry.strip().partition("@")
        if planted == name:
            return not rank or int(rank) == _tp_rank()
    return False


def hits(name: str, req: object) -> bool:
    """Whether failpoint `name` is planted for request `req` (id `failpoint-<first word of name>...`)."""
    return active(name) and str(getattr(req, "rid", "")).startswith("failpoint-" + name.split("_")[0])


def check(name: str, req: object) -> None:
    """A site where a planted fault raises (`compress_raise`, `rewrite_raise`, `reconstruct_raise`,
    `kvzip_plan_raise`, `document_raise`, `node_raise`, `adopt_raise`, `turn_raise`)."""
    if hits(name, req):
        raise PlantedFault(f"planted fault {_DOING[name]} {getattr(req, 'rid', '')}")


def skips(req: object, moment: str) -> bool:
    """Whether `skip_compaction` makes the compaction of `req` at `moment` find no free slots."""
    return hits("skip_compaction", req) and str(getattr(req, "rid", "")).startswith(f"failpoint-skip-{moment}")


def leak_slot(slots: Any, reqs: Sequence[object]) -> Any:
    """The evicted slots a compaction frees: one fewer when `leak_slot` is planted for one of the
    compacted requests `reqs` (an accounting error `SGLKVC_CHECK` must catch)."""
    if slots.numel() and any(hits("leak_slot", req) for req in reqs):
        return slots[1:]
    return slots


def observing(store: object, reqs: Sequence[object], rows: Sequence[int]) -> None:
    """Before a forward batch (request i in row rows[i]) observed by `store`: the rows
    `observe_raise` is planted for."""
    if active("observe_raise"):
        setattr(store, _OBSERVE_ROWS_ATTR, frozenset(r for req, r in zip(reqs, rows) if hits("observe_raise", req)))


def check_observation(store: object, layer: int, rows: Sequence[int]) -> None:
    """`store` records the queries of `rows` in the rank's layer `layer` (0: its first):
    `observe_raise` raises in the second layer for its rows."""
    planted = getattr(store, _OBSERVE_ROWS_ATTR, None)
    if planted and layer == 1 and planted.intersection(rows):
        raise PlantedFault(f"planted fault observing rows {sorted(planted)}")


def _tp_rank() -> int:
    from sgl_kvc.adapter.safety.tp import tp_rank

    return tp_rank()
