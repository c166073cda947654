"""A conversation turn's time to first token on this checkout against sgl-kvc at another commit,
side by side: both servers up at once, every turn sent to each in turn, one request at a time.

    python -m benchmarks.turn_latency --baseline da39249     # benchmarks/results/turn-latency.{json,md}
    python -m benchmarks.turn_latency --baseline 27acbdc --kv-head-budget policy --tag question  # turn-latency-question.*

The conversations of `benchmarks.conversations` (documents of about `--document-tokens` tokens in
the four filler styles, one fact per turn, each turn `[document, q1, a1, ..., qt]` on the chat
route, every earlier message the KVzip document at `--ratio`) on its `conversations` server (the
same flags, resident documents extended). Turn t of conversation c goes to one server, then the
other, one request in flight on the machine at a time, the order swapped every request, so that
what drifts on the machine meets both alike. Each server gets its own conversation history (its own
answers). Recorded per turn and server: TTFT and whole-request seconds, prompt tokens prefilled,
and whether the two servers answered alike; per turn, the median of the paired TTFT ratio
(this checkout / the baseline).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import commit_launcher, metadata_markdown, run_metadata
from benchmarks.conversations import ANSWER_TOKENS, make_conversations, pool_tokens
from benchmarks.shared_documents import Question, ask, server_flags
from loadtest.server import ServerProcess


def _turn(server: ServerProcess, q: Question, extra: dict[str, Any], tokens: int) -> dict[str, Any]:
    before = server.stats()["prefix_cache"]["prefilled_tokens"]
    a = ask(server.url, q, extra, tokens)
    after = server.wait_idle()["prefix_cache"]["prefilled_tokens"]
    return {"ttft": round(a.ttft, 4), "seconds": round(a.seconds, 4), "prefilled": after - before,
            "text": a.text, "right": a.correct, "error": a.error}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, metavar="COMMIT")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--document-tokens", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-head-budget", default="layer")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.turn_latency", argv)
    print(metadata_markdown(meta), flush=True)

    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    conversations, lengths = make_conversations(tok, args.conversations, args.document_tokens, args.turns, args.seed)
    pool = pool_tokens(lengths, args.turns, args.ratio, args.chunk, per_turn=args.answer_tokens + 28)
    _, kvc = server_flags(model, args.dtype, pool, args.chunk, args.kv_head_budget)
    extra = {"kv_compression": {"document": {"ratio": args.ratio}}}
    logs = Path(tempfile.mkdtemp(prefix="turn-latency-"))
    t0 = time.perf_counter()
    with commit_launcher(args.baseline) as (before, env, short):
        names = ["this", short]
        cmds = [[sys.executable, "-m", "sgl_kvc.launch", *kvc], [*before, *kvc]]
        envs = [None, env]
        with ServerProcess.launch(cmds[0], log_path=logs / "this.log") as a, \
                ServerProcess.launch(cmds[1], env=envs[1], log_path=logs / f"{short}.log") as b:
            servers = dict(zip(names, (a, b)))
            history = {n: [[{"role": "user", "content": c.document}] for c in conversations] for n in names}
            turns: list[dict[str, Any]] = []
            for t in range(args.turns):
                for c in conversations:
                    order = names if (t + c.index) % 2 == 0 else names[::-1]
                    out = {"turn": t + 1, "conversation": c.index, "first": order[0]}
                    for n in order:
                        q = Question(c.index, t, tuple(history[n][c.index] + [{"role": "user", "content": c.questions[t]}]),
                                     c.answers[t])
                        out[n] = _turn(servers[n], q, extra, args.answer_tokens)
                        history[n][c.index] = [*q.messages, {"role": "assistant", "content": out[n]["text"]}]
                    turns.append(out)
                    print(f"turn {t + 1} conversation {c.index}: " + ", ".join(
                        f"{n} {out[n]['ttft']:.2f} s ({out[n]['prefilled']} prefilled)" for n in names), flush=True)
    rows = []
    for t in range(1, args.turns + 1):
        at = [x for x in turns if x["turn"] == t and not x["this"]["error"] and not x[short]["error"]]
        rows.append({
            "turn": t,
            **{f"ttft_p50_{n}": round(statistics.median(x[n]["ttft"] for x in at), 3) for n in names},
            "ttft_ratio_p50": round(statistics.median(x["this"]["ttft"] / x[short]["ttft"] for x in at), 3),
            **{f"prefilled_{n}": round(statistics.mean(x[n]["prefilled"] for x in at)) for n in names},
            "same_answer": f"{sum(x['this']['text'] == x[short]['text'] for x in at)}/{len(at)}",
        })
    setup = {"conversations": args.conversations, "turns": args.turns, "document_tokens": lengths,
             "ratio": args.ratio, "entries": math.ceil(args.ratio * max(lengths)), "pool": pool,
             "dtype": args.dtype, "kv_head_budget": args.kv_head_budget, "chunk": args.chunk,
             "baseline": short, "wall_seconds": round(time.perf_counter() - t0)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "turn-latency" + (f"-{args.tag}" if args.tag else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "setup": setup, "rows": rows,
                                                             "requests": turns}, indent=1) + "\n")
    head = list(rows[0])
    body = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows)])
    (args.out / f"{stem}.md").write_text(
        f"{metadata_markdown(meta)}\n## A turn's TTFT, this checkout against {short}, interleaved\n\n"
        f"{args.conversations} conversations x {args.turns} turns, one request at a time, each turn sent to both "
        f"servers in alternating order.\n\nSetup: `{json.dumps(setup)}`\n\n{body}\n")
    print(body)


if __name__ == "__main__":
    main()
