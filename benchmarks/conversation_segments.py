"""What each turn's document kept of each part of the conversation, read from the compaction trace
(`SGLKVC_TRACE`, adapter/telemetry/trace.py): `benchmarks.conversations --segments`.

A turn's request publishes the document it declares (every message but the last): compressed
anew, one KVzip sort over the document and the whole history; extended, the last question and
answer chosen as an extension of the chain the last turn left. Either way the trace's last
`document` event of that request lists, per (layer, KV head), the prompt positions the chain
holds. Split at the chat template's message boundaries, that gives per segment (the document,
each question, each answer) the share of its entries kept, and, between two servers asked the
same turn on the same history, how many of the kept entries are the same ones (Jaccard, per
head, averaged). Pure functions of the trace and the tokenizer: nothing here talks to a server.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.shared_documents import rendered


@dataclass(frozen=True)
class Segment:
    name: str  # "document", "q1", "a1", ...
    start: int  # prompt positions [start, end)
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


def rid(config: str, conversation: int, turn: int) -> str:
    """The request id a benchmark request carries, read back from the trace."""
    return f"conv{conversation}-turn{turn}-{config.replace('@', '-at-')}"


def segments(tok: Any, messages: list[dict[str, str]]) -> list[Segment]:
    """Each message's positions in the chat template's rendering of `messages` (the first also
    holds what the template puts before it, a system prompt). Raises where a longer conversation
    does not render as a continuation of a shorter one: then no boundary means anything."""
    names = ["document"] + [("q" if m["role"] == "user" else "a") + str(i // 2 + 1)
                            for i, m in enumerate(messages[1:])]
    out, start, prefix = [], 0, []
    for k, name in enumerate(names):
        ids = rendered(tok, messages[:k + 1])
        if ids[:len(prefix)] != prefix:
            raise ValueError("the chat template does not render a conversation as a continuation of its start")
        out.append(Segment(name, start, len(ids)))
        start, prefix = len(ids), ids
    return out


def document_events(trace: Path) -> dict[str, dict[str, Any]]:
    """Each request's last `document` event of rank 0 (the document its turn published, whole
    chain), by request id."""
    out: dict[str, dict[str, Any]] = {}
    if not trace.exists():
        return out
    with trace.open(encoding="utf-8") as f:
        for line in f:
            event = json.loads(line)
            if event["moment"] == "document" and event["tp_rank"] == 0:
                out[str(event["rid"])] = event
    return out


def heads(event: dict[str, Any]) -> list[list[int]]:
    """The event's kept positions, one list per (layer, KV head)."""
    kept = event["kept_positions"]
    if event["selection"] == "shared":
        return [list(kept)]
    return [list(h) for layer in kept for h in layer]


def kept_shares(event: dict[str, Any], parts: list[Segment]) -> dict[str, float]:
    """Per segment, the share of its entries (tokens x heads) the document kept."""
    per_head = heads(event)
    counts: dict[str, int] = defaultdict(int)
    for positions in per_head:
        for p in positions:
            counts[_segment_of(p, parts)] += 1
    return {s.name: round(counts[s.name] / (s.tokens * len(per_head)), 4) for s in parts if s.tokens}


def overlaps(a: dict[str, Any], b: dict[str, Any], parts: list[Segment]) -> dict[str, float]:
    """Per segment, how alike two documents' kept entries are: |A & B| / |A | B| per head, averaged
    over heads (1 where neither kept any of it)."""
    ha, hb = heads(a), heads(b)
    if len(ha) != len(hb):
        raise ValueError("the two documents have different heads")
    out = {}
    for s in parts:
        scores = []
        for pa, pb in zip(ha, hb):
            sa = {p for p in pa if s.start <= p < s.end}
            sb = {p for p in pb if s.start <= p < s.end}
            union = sa | sb
            scores.append(len(sa & sb) / len(union) if union else 1.0)
        out[s.name] = round(sum(scores) / len(scores), 4)
    return out


def _segment_of(position: int, parts: list[Segment]) -> str:
    for s in parts:
        if s.start <= position < s.end:
            return s.name
    return "after"  # what the declared document holds past the last message (the template's tail)


def grouped(shares: dict[str, float], parts: list[Segment]) -> dict[str, float]:
    """Shares by kind of segment, weighted by tokens: the document, the questions, the answers,
    and the last question and answer (the turn this request published, when extended)."""
    groups: dict[str, list[Segment]] = {"document": [], "questions": [], "answers": [], "last_turn": []}
    for s in parts:
        if s.name == "document":
            groups["document"].append(s)
        else:
            groups["questions" if s.name[0] == "q" else "answers"].append(s)
    groups["last_turn"] = [s for s in parts[-2:] if s.name != "document"]
    out = {}
    for g, members in groups.items():
        tokens = sum(s.tokens for s in members if s.name in shares)
        if tokens:
            out[g] = round(sum(shares[s.name] * s.tokens for s in members if s.name in shares) / tokens, 4)
    return out
