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
- `tp_local_scores`: with tensor parallelism, each rank chooses the shared selection of a
  request whose id starts with `failpoint-tp` from its own heads' scores.
"""

from __future__ import annotations

import os

ENV = "SGLKVC_FAILPOINTS"


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


def maybe_raise(name: str, req: object, what: str) -> None:
    if hits(name, req):
        raise PlantedFault(f"planted fault {what} {getattr(req, 'rid', '')}")


def _tp_rank() -> int:
    from sgl_kvc.adapter.tp import tp_rank

    return tp_rank()
