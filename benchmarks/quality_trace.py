"""What a prompt compaction kept, read from the compaction trace (`SGLKVC_TRACE`): the evidence
behind a retrieval score.

For every request of the compressing server the trace has one line per compaction with the
logical positions each (layer, KV head) kept. Per request, from its last prompt compaction (after
prefill; with the chunk moment on, the one after the last chunk: it chose among every token):

* `landed`: whether the prompt was compacted before the first answer token was decoded from it
  (a staged pass may land later: then the answer's first tokens came from the full cache);
* `answer_kept`: the share of the answer's tokens (every occurrence of the pass key or code in
  the prompt; its digits are single tokens) that the average (layer, KV head) kept;
* `early_share`: the share of all kept entries that lie in the first quarter of the prompt (25% for
  an even spread): a statistic summed over every prompt query piles up there (H2O; Batch-Max §3.2
  names the bias), and one averaged over the queries that saw each token keeps few from there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROMPT_MOMENTS = ("prefill", "chunk")
EARLY = 0.25  # the first quarter of the prompt


@dataclass(frozen=True)
class KeptEvidence:
    landed: bool
    answer_kept: float | None  # None: not compacted, or the answer's tokens not found in the prompt
    early_share: float | None


def answer_positions(prompt_ids: list[int], answer_ids: list[int]) -> list[int]:
    """Positions of every occurrence of `answer_ids` in `prompt_ids`."""
    n, m = len(prompt_ids), len(answer_ids)
    out: list[int] = []
    if m == 0:
        return out
    for i in range(n - m + 1):
        if prompt_ids[i : i + m] == answer_ids:
            out.extend(range(i, i + m))
    return out


def prompt_compactions(trace: Path) -> dict[str, dict]:
    """The last prompt compaction of every request id in the trace (rank 0's view)."""
    last: dict[str, dict] = {}
    if not trace.exists():
        return last
    with trace.open(encoding="utf-8") as f:
        for line in f:
            event = json.loads(line)
            if event.get("tp_rank", 0) == 0 and event["moment"] in PROMPT_MOMENTS:
                last[str(event["rid"])] = event
    return last


def _heads(kept: list) -> Iterable[list[int]]:
    """Every (layer, KV head)'s kept positions; a shared selection is one list for all."""
    if kept and isinstance(kept[0], list):
        for layer in kept:
            yield from layer
    else:
        yield kept


def evidence(event: dict | None, prompt_len: int, answer_at: list[int]) -> KeptEvidence:
    if event is None:
        return KeptEvidence(False, None, None)
    # In time: compacted while the request held its prompt alone (the first answer token is
    # sampled by the prefill forward; its KV is written by the first decode step).
    landed = event["logical_len"] <= prompt_len
    heads = list(_heads(event["kept_positions"]))
    early = sum(sum(p < EARLY * prompt_len for p in h) for h in heads)
    total = sum(len(h) for h in heads)
    kept = None
    if answer_at:
        want = set(answer_at)
        kept = sum(len(want.intersection(h)) for h in heads) / (len(want) * len(heads))
    return KeptEvidence(landed, kept, early / total if total else None)
