"""The compaction trace: one JSON line per compaction, in the file `SGLKVC_TRACE` names.

For tests and debugging: which logical positions every (layer, KV head) kept, from what.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from sgl_kvc.core.request_state import ReqKvState

TRACE_ENV = "SGLKVC_TRACE"


@dataclass(frozen=True)
class CompactionTrace:
    path: str
    tp_rank: int

    @classmethod
    def from_env(cls, tp_rank: int) -> "CompactionTrace | None":
        path = os.environ.get(TRACE_ENV)
        return cls(path, tp_rank) if path else None

    def write(
        self, rid: Any, moment: str, policy: str, n: int, logical_len: int, state: ReqKvState,
        physical_kept: int, began_at: int,
    ) -> None:
        """`kept_positions`: a list (shared selection) or, per head, [layer][KV head] lists
        (this rank's layers and heads; of different lengths under variable budgets).
        `n`: entries before the compaction; `began_at`: entries when the pass began;
        `physical_kept`: slots kept."""
        kept = state.kept_positions
        if state.packed_entries is not None:
            kept, lens = state.packed_positions(), state.unit_lens.tolist()
            positions = [[p[:m] for p, m in zip(ps, ms)] for ps, ms in zip(kept.tolist(), lens)]
        else:
            positions = kept.tolist()
        event = {
            "rid": rid,
            "tp_rank": self.tp_rank,
            "moment": moment,
            "policy": policy,
            "selection": "per-head" if kept.dim() > 1 else "shared",
            "logical_len": logical_len,
            "physical_len": n,
            "began_at": began_at,
            "physical_kept": physical_kept,
            "kept_positions": positions,
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
