"""What matching waiting requests costs a prefill round when tenants keep thousands of documents
and finished turns resident: the registry's indexes (`adapter/documents/registry.py`) against the
number of resident nodes.

    python -m benchmarks.document_rounds                  # benchmarks/results/document-rounds.{json,md}

One document of 1,000 tokens is resident, with T finished one-slot turns after it (T answers of
one token each to it, as a client that asks the same document T times leaves them) and R resident
compressed documents of other contents (of 7 lengths); 64 requests wait, each declaring a document that begins
with the resident one (a conversation's next turn, on a server that extends documents). A round
matches every waiting request once (SGLang matches each waiting request in every prefill round:
`matching.plan_match`, what `KvcRadixCache.match_prefix` runs first). The first round of a
request hashes its prompt's prefixes once; the median of later rounds is what a round costs.
No server: the plan and the registry are plain Python over stand-in nodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.common import metadata_markdown, run_metadata
from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents import DocumentKey, DocumentRegistry, ExtensionRule, RootDocument, Turn
from sgl_kvc.adapter.documents.keys import tokens_content, turn_key
from sgl_kvc.adapter.documents.matching import plan_match
from sgl_kvc.adapter.documents.roles import DocumentPlan, Role

DOC, WAITING, FAMILY = 1000, 64, "f" * 64


def _key(prompt: list[int], tokens: int, entries: int) -> DocumentKey:
    content = tokens_content(prompt[:tokens], FAMILY)
    return DocumentKey(digest=f"{content[:48]}{tokens:016x}", tokens=tokens, entries=entries, policy="kvzip",
                       family=FAMILY, content=content)


def _registry(prompt: list[int], turns: int, others: int) -> DocumentRegistry:
    registry = DocumentRegistry()
    node = SimpleNamespace
    root = RootDocument(key=_key(prompt, DOC, 300), node=node(), slots=300,
                        kept_positions=torch.zeros(1, 1, 300, dtype=torch.int32))
    registry.add(root)
    for i in range(turns):  # answers of one token to the same document: one-slot turns after it
        said = prompt[:DOC] + [50_000 + i]
        registry.add(Turn(key=turn_key(root.key, said), node=node(), slots=1, parent=root))
    for i in range(others):  # other documents of the same family, resident
        other = [60_000 + i] + prompt[1:DOC]
        registry.add(RootDocument(key=_key(other, DOC - i % 7, 300), node=node(), slots=300,
                                  kept_positions=torch.zeros(1, 1, 300, dtype=torch.int32)))
    return registry


def _waiting(prompt: list[int], k: int) -> SimpleNamespace:
    """A request declaring the first DOC + 40 tokens of `prompt` then its question, as `plan.declare` does."""
    ids = prompt[: DOC + 40] + [70_000 + k] * 12
    req = SimpleNamespace(origin_input_ids=ids, output_ids=[], return_logprob=False, logprob_start_len=-1)
    own = _key(ids, DOC + 40, 0)
    fields = kvc_req.of(req)
    fields.plan = DocumentPlan(role=Role.WHOLE, own=own, key=own, mode=Role.WHOLE)
    fields.rule = ExtensionRule(0.3, None, 4, None)
    return req


def one(turns: int, others: int, rounds: int) -> dict:
    prompt = list(range(10, 10 + DOC + 100))
    registry = _registry(prompt, turns, others)
    reqs = [_waiting(prompt, k) for k in range(WAITING)]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        plans = [plan_match(registry, req, len(req.origin_input_ids), len(req.origin_input_ids) - 1) for req in reqs]
        times.append(time.perf_counter() - t0)
    assert all(p.role is Role.EXTEND and p.parent is not None for p in plans), plans[0]
    later = times[1:] or times
    return {"resident_turns": turns, "resident_documents": others + 1, "waiting": WAITING, "first_round_ms": 1000 * times[0],
            "round_ms_p50": 1000 * statistics.median(later), "per_request_us": 1e6 * statistics.median(later) / WAITING}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resident", nargs="+", default=["0:0", "1000:0", "10000:0", "1000:1000", "10000:10000"],
                   help="TURNS:DOCUMENTS resident, one row each")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.document_rounds", argv)
    one(0, 0, 3)  # warm-up: imports, first allocations
    rows = [one(*map(int, r.split(":")), args.rounds) for r in args.resident]
    lines = ["| resident turns | resident documents | waiting | first round (ms) | round p50 (ms) | per request (µs) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['resident_turns']} | {r['resident_documents']} | {r['waiting']} | {r['first_round_ms']:.2f} "
              f"| {r['round_ms_p50']:.2f} | {r['per_request_us']:.1f} |" for r in rows]
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "document-rounds.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (args.out / "document-rounds.md").write_text(f"{metadata_markdown(meta)}\n{table}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
