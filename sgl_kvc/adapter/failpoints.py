"""Planted faults for tests, named in `SGLKVC_FAILPOINTS` (comma separated) at server start.

They prove that the safety nets work on a live server: that an exception in sgl-kvc code for
one request aborts only that request, and that `SGLKVC_CHECK=1` catches a broken pool. Nothing
is active unless the variable names it; a client cannot turn one on.

- `compress_raise`: compressing a request whose id starts with `failpoint-` raises.
- `leak_slot`: a compaction forgets to free one evicted slot (an accounting error).
- `tp_local_scores`: with tensor parallelism, each rank chooses from its own heads' scores.
"""

from __future__ import annotations

import os

ENV = "SGLKVC_FAILPOINTS"
RID_PREFIX = "failpoint-"


class PlantedFault(RuntimeError):
    pass


def active(name: str) -> bool:
    return name in os.environ.get(ENV, "").split(",")
