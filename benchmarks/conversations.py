"""A multi-turn workload (SCBench's multi-turn setting): conversations over an uploaded document,
each turn one more question.

    python -m benchmarks.conversations                     # docs/benchmarks.md has the results
    python -m benchmarks.conversations --conversations 8 --turns 8 --document-tokens 3072
    python -m benchmarks.conversations --explain --answer-tokens 192 --decode rkv --kv-buffer 16  # long answers


`--conversations` conversations, each over its own document (`benchmarks.shared_documents`'s
documents: about `--document-tokens` tokens of filler in the four styles in turn, with one fact per
turn). Turn t asks the t-th fact ("What is the code of the red door? Answer with the number
only."; with `--explain`, the number and then where the document says so, a long answer) after
every earlier question and the server's own earlier answers, as a chat client resends a
conversation: `[document, q1, a1, ..., qt]` as streaming `/v1/chat/completions`. The
turns of different conversations are interleaved: every conversation's turn 1 (`--clients` at
once), then every conversation's turn 2, and so on.

Servers, one after the other, with the same model, dtype, chunk size and pool (`--max-total-tokens`:
about a third of the conversations at their last turn, whole, plus the room one request
compressing its document needs, `pool_tokens`):
- `plain`: SGLang itself (`--policy none`, its radix cache on): each turn prefills what the cache no
  longer holds of the conversation;
- `per-request`: every request compresses its own prompt after prefill, by KVzip to the entries
  `--ratio` of its document would keep;
- `documents`: every turn declares its conversation so far as a shared document (the default
  `messages`: every message but the last), compressed by KVzip to `--ratio` of its tokens and
  shared, each turn's document read and compressed anew (`--kv-document-extend off`);
- `conversations`: the same requests on a server that extends resident documents (the default
  `--kv-document-extend resident`): each turn starts from the last turn's document and from the
  last question and answer its request left in the tree (a turn, adapter/documents/turns.py),
  reads only what the template renders after that answer, publishes the last question and
  answer's entries as an extension of that document (adapter/documents/matching.py,
  extensions.py), and reads its own question from that extension.
- `readme`: README.md's chat-over-an-upload example as written: the server a user starts
  (`--policy rkv`, every other sgl-kvc flag at its default; the model, dtype, pool and chunk size
  as every server's), each request asking `{"prompt_policy": "kvzip", "document": {"ratio": --ratio}}`.
`--history plain`: every server's conversation carries plain SGLang's answers as its earlier
turns (plain runs first), not its own, so that each turn compares servers on the same history
(with their own, one wrong answer changes what every later turn reads).
`--baseline COMMIT` runs every compressing config (or those of `--baseline-configs`) again on sgl-kvc at
another commit, right after its own (`NAME@COMMIT`): the same requests, before and after a change, in
one run.
With `--decode rkv`, the compressing servers' requests decode with R-KV at `--decode-budget`
entries beyond their document (their prompts still by KVzip; `--kv-buffer`: the servers' buffer
above it): a long answer is compacted while it is decoded, and on `conversations` the next turn starts from what it kept (a reply,
adapter/documents/turns.py), compressing it again.
Recorded per server and turn: prompt tokens prefilled per request (`/v1/kvc/stats`, before and
after the turn), TTFT p50, answers right (and kept, against `plain`'s; agreed: `plain`'s answer,
or one as right as it), the radix tree's tokens per
conversation after the turn, and the documents compressed, resident and evicted, and turns
published and resident. Writes
`<out>/conversations[-tag].{json,md,png}`.
`--segments`: the compressing servers write their compaction trace, and each turn's document is
split at its messages (`benchmarks/conversation_segments.py`): per server and turn, the share of
the document's, the questions', the answers' and the last turn's entries it kept; and, for each
conversation at the first turn where `conversations` and `documents` answer differently, what
each kept of every part and how many of those entries are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import conversation_segments as segs
from benchmarks.common import config_runs, machine, metadata_markdown, run_metadata
from benchmarks.quality_samples import code_question
from benchmarks.shared_documents import (
    BUDGET, KVZIP_CHUNK, STYLES, Question, ask, document_text, message_tokens, server_flags,
)
from loadtest.server import ServerProcess

ANSWER_TOKENS = 12  # a short answer: the code and a few words


@dataclass(frozen=True)
class Conversation:
    index: int
    document: str
    questions: tuple[str, ...]  # one per turn
    answers: tuple[str, ...]  # the code each turn asks for


@dataclass
class TurnResult:
    """One turn of every conversation on one server."""

    turn: int
    right: list[bool] = field(default_factory=list)  # per conversation
    answers: list[str] = field(default_factory=list)  # per conversation
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    prefilled_tokens: int = 0  # over the turn's requests
    prompt_tokens: int = 0
    tree_tokens: int = 0  # the radix tree's, after the turn
    documents: dict[str, Any] = field(default_factory=dict)  # the stats' documents, after the turn
    # --segments: per conversation, what its turn's document kept of each kind of segment
    # (`conversation_segments.grouped`), {} where the trace holds no document of that request
    kept: list[dict[str, float]] = field(default_factory=list)


def make_conversations(tok: Any, count: int, tokens: int, turns: int, seed: int,
                       explain: bool = False) -> tuple[list[Conversation], list[int]]:
    """The conversations, and each document's length in tokens (its message alone). `explain`:
    each question asks for the number and then where the document says so (a long answer)."""
    ask = explain_question if explain else code_question
    out, lengths = [], []
    for c in range(count):
        rng = random.Random(f"conversations-{seed}-{c}")
        text, names, codes = document_text(tok, rng, STYLES[c % len(STYLES)], tokens, turns)
        order = rng.sample(range(turns), turns)
        out.append(Conversation(c, text, tuple(ask(names[j]) for j in order),
                                tuple(str(codes[j]) for j in order)))
        lengths.append(message_tokens(tok, text))
    return out, lengths


def explain_question(name: str) -> str:
    return f"What is the code of the {name}? Give the number, then explain in a few sentences where the document says so."


def pool_tokens(lengths: list[int], turns: int, ratio: float, chunk: int, per_turn: int = 40) -> int:
    """A third of the conversations at their last turn, whole (the document and each turn's
    question and answer, `per_turn` tokens), plus what one request compressing its document
    between chunks holds at most: one chunk, the reconstruction forward, its budget and the
    document's entries, its question and answer."""
    whole = sum(n + turns * per_turn for n in lengths)
    return (math.ceil(whole / 3) + chunk + KVZIP_CHUNK + BUDGET + math.ceil(ratio * (max(lengths) + turns * per_turn))
            + per_turn + 88)


def run(config: str, flags: list[str], extra: dict[str, Any], conversations: list[Conversation], turns: int,
        clients: int, log: Path, answer_tokens: int = ANSWER_TOKENS,
        env: dict[str, str] | None = None,
        history_from: list[list[str]] | None = None,
        trace: Path | None = None) -> tuple[list[TurnResult], list[list[str]], list[list[tuple[dict[str, str], ...]]]]:
    """Every turn of every conversation on one server: the per-turn results, each
    conversation's answers in order, and the messages each turn sent (per turn, per
    conversation). `history_from`: each conversation's earlier answers are these (another
    server's, per conversation and turn) instead of this server's own. `trace`: the server writes
    its compaction trace there, and each request carries its id (`conversation_segments.rid`)."""
    history: list[list[dict[str, str]]] = [[{"role": "user", "content": c.document}] for c in conversations]
    texts: list[list[str]] = [[] for _ in conversations]
    sent: list[list[tuple[dict[str, str], ...]]] = []
    results = []
    if trace is not None:
        env = {**(env or {}), "SGLKVC_TRACE": str(trace)}
    with ServerProcess.launch(flags, env=env, log_path=log) as server:
        for t in range(turns):
            before = server.stats()
            questions = [Question(c.index, t, tuple(history[c.index] + [{"role": "user", "content": c.questions[t]}]),
                                  c.answers[t]) for c in conversations]
            sent.append([q.messages for q in questions])

            def asked(q: Question) -> Any:
                mine = extra if trace is None else {**extra, "rid": segs.rid(config, q.document, q.index + 1)}
                return ask(server.url, q, mine, answer_tokens)

            with ThreadPoolExecutor(clients) as pool:
                answers = list(pool.map(asked, questions))
            after = server.wait_idle()
            r = TurnResult(t + 1)
            for c, q, a in zip(conversations, questions, answers):
                r.right.append(a.correct and not a.error)
                r.answers.append(a.text)
                r.errors += bool(a.error)
                if not a.error:
                    r.ttfts.append(a.ttft)
                texts[c.index].append(a.text)
                # the client keeps the server's own answer, as a chat client does (or the one given)
                kept = a.text if history_from is None else history_from[c.index][t]
                history[c.index] = [*q.messages, {"role": "assistant", "content": kept}]
            r.prefilled_tokens = after["prefix_cache"]["prefilled_tokens"] - before["prefix_cache"]["prefilled_tokens"]
            r.prompt_tokens = after["prefix_cache"]["prompt_tokens"] - before["prefix_cache"]["prompt_tokens"]
            r.tree_tokens = after["pool"]["cached_tokens"]
            r.documents = after.get("documents", {})
            results.append(r)
            print(f"[conversations] {config} turn {t + 1}: {row(config, r, len(conversations), None)}", flush=True)
    return results, texts, sent


def read_segments(tok: Any, config: str, trace: Path, results: list[TurnResult],
                  sent: list[list[tuple[dict[str, str], ...]]]) -> dict[tuple[int, int], tuple[Any, list[Any]]]:
    """Fill each turn's `kept` from the server's trace; the documents' events and segments by
    (conversation, turn), for `first_differences`."""
    events = segs.document_events(trace)
    found = {}
    for r, messages in zip(results, sent):
        r.kept = []
        for c, m in enumerate(messages):
            event = events.get(segs.rid(config, c, r.turn))
            if event is None:
                r.kept.append({})
                continue
            parts = segs.segments(tok, list(m[:-1]))  # the declared document: every message but the last
            r.kept.append(segs.grouped(segs.kept_shares(event, parts), parts))
            found[c, r.turn] = (event, parts)
    return found


def first_differences(extended: str, anew: str, texts: dict[str, list[list[str]]],
                      found: dict[str, dict[tuple[int, int], tuple[Any, list[Any]]]]) -> list[dict[str, Any]]:
    """For each conversation, the first turn (from 2) where `extended` and `anew` answer
    differently: what each kept of every kind of segment, and how alike their kept entries are."""
    out = []
    for c, (mine, theirs) in enumerate(zip(texts[extended], texts[anew])):
        turn = next((t + 1 for t in range(1, len(mine)) if mine[t] != theirs[t]), None)
        if turn is None or (c, turn) not in found[extended] or (c, turn) not in found[anew]:
            continue
        (e, parts), (a, _) = found[extended][c, turn], found[anew][c, turn]
        shares = {extended: segs.kept_shares(e, parts), anew: segs.kept_shares(a, parts)}
        out.append({"conversation": c, "turn": turn, "answers": [mine[turn - 1], theirs[turn - 1]],
                    **{name: segs.grouped(kept, parts) for name, kept in shares.items()},
                    "same_entries": segs.grouped(segs.overlaps(e, a, parts), parts),
                    "per_segment": shares})
    return out


GROUPS = ("document", "questions", "answers", "last_turn")


def segment_table(results: dict[str, list[TurnResult]]) -> str:
    """Per server and turn, the mean over conversations of what its documents kept of each kind."""
    lines = ["| config | turn | " + " | ".join(GROUPS) + " |", "|" + "---|" * (2 + len(GROUPS))]
    for name, turns in results.items():
        for r in turns:
            if not any(r.kept):
                continue
            means = [statistics.mean(k[g] for k in r.kept if g in k) if any(g in k for k in r.kept) else None
                     for g in GROUPS]
            lines.append(f"| {name} | {r.turn} | " + " | ".join("–" if m is None else f"{m:.2f}" for m in means) + " |")
    return "\n".join(lines) + "\n"


def differences_table(extended: str, anew: str, rows: list[dict[str, Any]]) -> str:
    lines = ["| conversation | turn | answers (" + f"{extended} / {anew}) | " +
             " | ".join(f"{g}: kept / same" for g in GROUPS) + " |", "|" + "---|" * (3 + len(GROUPS))]
    for d in rows:
        cells = []
        for g in GROUPS:
            if g in d[extended]:
                cells.append(f"{d[extended][g]:.2f} / {d[anew][g]:.2f} / {d['same_entries'][g]:.2f}")
            else:
                cells.append("–")
        answers = " / ".join(json.dumps(a) for a in d["answers"]).replace("|", "\\|")
        lines.append(f"| {d['conversation']} | {d['turn']} | {answers} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def earlier_plain(path: Path, lengths: list[int], turns: int) -> tuple[list[TurnResult], list[list[str]]]:
    """plain SGLang's per-turn results and answers from an earlier run's file (`--plain-from`),
    refused unless it ran the same conversations (their documents' lengths) and turns."""
    earlier = json.loads(path.read_text())
    setup = earlier["setup"]
    if setup["document_tokens"] != lengths or setup["turns"] != turns or "plain" not in earlier["answers"]:
        raise SystemExit(f"{path}: not a run of plain SGLang on these conversations")
    texts = earlier["answers"]["plain"]
    plain = [TurnResult(**r) for r in earlier["turns"]["plain"]]
    for t, r in enumerate(plain):  # a file from before the turns recorded their answers
        r.answers = r.answers or [answers[t] for answers in texts]
    return plain, texts


def agrees(text: str, right: bool, plain_text: str, plain_right: bool) -> bool:
    """An answer agrees with plain SGLang's: it is plain's answer, or one as right as it (both
    right, or both wrong)."""
    return text == plain_text or right == plain_right


def row(config: str, r: TurnResult, count: int, plain: TurnResult | None) -> dict[str, Any]:
    served = count - r.errors
    out = {
        "config": config, "turn": r.turn, "right": sum(r.right), "errors": r.errors,
        "ttft_p50": round(statistics.median(r.ttfts), 3) if r.ttfts else None,
        "prefilled_per_request": round(r.prefilled_tokens / served) if served else None,
        "prompt_per_request": round(r.prompt_tokens / served) if served else None,
        "tree_tokens_per_conversation": round(r.tree_tokens / count),
        **{f"documents_{k}": r.documents.get(k)
           for k in ("compressions", "extensions", "rebuilds", "replies", "hits", "resident", "evictions", "turns",
                     "turns_resident", "history_rewritten")},
    }
    if plain is not None:
        both = sum(a and b for a, b in zip(r.right, plain.right))
        out["kept"] = f"{both}/{sum(plain.right)}"
        out["agreed"] = sum(map(agrees, r.answers, r.right, plain.answers, plain.right))
    return out


COLUMNS = ["config", "turn", "right", "kept", "agreed", "ttft_p50", "prefilled_per_request", "prompt_per_request",
           "tree_tokens_per_conversation", "documents_compressions", "documents_extensions", "documents_rebuilds",
           "documents_replies", "documents_hits",
           "documents_resident", "documents_evictions", "documents_turns", "documents_turns_resident",
           "documents_history_rewritten", "errors"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("–" if r.get(c) is None else str(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Per turn, one line per server: prompt tokens prefilled per request, TTFT p50, answers right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        turns = [r["turn"] for r in mine]
        for ax, key in zip(axes, ("prefilled_per_request", "ttft_p50", "right")):
            ax.plot(turns, [r[key] or 0 for r in mine], marker="o", label=config)
    labels = ("prompt tokens prefilled per request", "time to first token, p50 (s)", "answers right")
    for ax, label in zip(axes, labels):
        ax.set_xlabel("turn")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--document-tokens", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size of every server")
    p.add_argument("--kv-head-budget", default="layer", choices=["policy", "uniform", "variable", "layer"],
                   help="of the compressing servers (KVzip's server: docs/quality.md)")
    p.add_argument("--configs", nargs="+", default=["plain", "per-request", "documents", "conversations"])
    p.add_argument("--explain", action="store_true", help="questions that ask for an explanation: long answers")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS, help="max_tokens of every answer")
    p.add_argument("--decode", default="server", choices=["server", "rkv"],
                   help="rkv: the compressing servers' requests decode with R-KV at --decode-budget")
    p.add_argument("--decode-budget", type=int, default=32)
    p.add_argument("--kv-buffer", type=int, default=None,
                   help="--kv-buffer of the compressing servers (decode tokens above the budget before a pass)")
    p.add_argument("--history", default="own", choices=["own", "plain"],
                   help="plain: every server's conversations carry plain SGLang's answers (run first) as their "
                        "earlier turns, so that each turn is compared on the same history")
    p.add_argument("--plain-from", type=Path, default=None, metavar="JSON",
                   help="plain SGLang's turns and answers from an earlier run's file of the same conversations, "
                        "not run again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default="")
    p.add_argument("--baseline", default=None, metavar="COMMIT",
                   help="also run every compressing config on sgl-kvc at COMMIT, each right after its own (NAME@COMMIT)")
    p.add_argument("--baseline-configs", nargs="+", default=None, metavar="CONFIG",
                   help="with --baseline: only these configs run again at that commit (default: every compressing one)")
    p.add_argument("--segments", action="store_true",
                   help="what each turn's document kept of each message, from the compressing servers' trace")
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.conversations", argv)
    print(metadata_markdown(meta), flush=True)

    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    conversations, lengths = make_conversations(tok, args.conversations, args.document_tokens, args.turns, args.seed,
                                                args.explain)
    pool = pool_tokens(lengths, args.turns, args.ratio, args.chunk, per_turn=args.answer_tokens + 28)
    k = math.ceil(args.ratio * max(lengths))
    common, kvc = server_flags(model, args.dtype, pool, args.chunk, args.kv_head_budget)
    if args.kv_buffer is not None:
        kvc = [*kvc, "--kv-buffer", str(args.kv_buffer)]
    launch = [sys.executable, "-m", "sgl_kvc.launch"]
    # --decode rkv: decoded by R-KV at its own budget beyond the document, the prompt still by KVzip
    decode = {"policy": "rkv", "prompt_policy": "kvzip", "budget": args.decode_budget} if args.decode == "rkv" else {}
    document = {**decode, "document": {"ratio": args.ratio}}
    configs = {
        "plain": ([*launch, *common, "--policy", "none"], {}),
        "per-request": ([*launch, *kvc], {"kv_compression": {"budget": k}}),
        "documents": ([*launch, *kvc, "--kv-document-extend", "off"], {"kv_compression": document}),
        "conversations": ([*launch, *kvc], {"kv_compression": document}),
        "readme": ([*launch, *common, "--policy", "rkv"],
                   {"kv_compression": {"prompt_policy": "kvzip", "document": {"ratio": args.ratio}}}),
    }
    logs = Path(tempfile.mkdtemp(prefix="conversations-"))
    print(f"{args.conversations} conversations x {args.turns} turns over documents of {lengths} tokens; pool {pool}; "
          f"server logs {logs}", flush=True)
    t0 = time.perf_counter()
    results: dict[str, list[TurnResult]] = {}
    texts: dict[str, list[list[str]]] = {}
    if args.plain_from is not None:
        results["plain"], texts["plain"] = earlier_plain(args.plain_from, lengths, args.turns)
    elif args.history == "plain" and args.configs[0] != "plain":
        raise SystemExit("--history plain needs plain as the first of --configs (or --plain-from)")
    names = [n for n in args.configs if not (n == "plain" and args.plain_from is not None)]
    found: dict[str, dict[tuple[int, int], tuple[Any, list[Any]]]] = {}
    with config_runs(names, configs, launch, args.baseline, args.baseline_configs) as runs:
        for label, cmd, extra, env in runs:
            forced = texts["plain"] if args.history == "plain" and label != "plain" else None
            trace = logs / f"{label}.trace.jsonl" if args.segments and label != "plain" else None
            results[label], texts[label], sent = run(label, cmd, extra, conversations, args.turns, args.clients,
                                                     logs / f"{label}.log", args.answer_tokens, env, forced, trace)
            if trace is not None:
                found[label] = read_segments(tok, label, trace, results[label], sent)
    differences = (first_differences("conversations", "documents", texts, found)
                   if {"conversations", "documents"} <= found.keys() else [])
    plain = results.get("plain")
    rows = [row(name, r, args.conversations, plain[r.turn - 1] if plain else None)
            for name, turns in results.items() for r in turns]
    stem = "conversations" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    setup = {"conversations": args.conversations, "turns": args.turns, "document_tokens": lengths,
             "ratio": args.ratio, "entries": k, "pool": pool, "clients": args.clients, "max_tokens": args.answer_tokens,
             "explain": args.explain, "decode": decode or "server", "kv_buffer": args.kv_buffer,
             "history": args.history, "plain_from": None if args.plain_from is None else args.plain_from.name,
             "dtype": args.dtype, "kv_head_budget": args.kv_head_budget, "chunk": args.chunk, "kv_budget": BUDGET,
             "kvzip_chunk": KVZIP_CHUNK, "wall_seconds": round(time.perf_counter() - t0)}
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "setup": setup, "rows": rows, "turns": {n: [asdict(r) for r in rs] for n, rs in results.items()},
         "answers": texts, "first_differences": differences}, indent=2))
    plot(rows, args.out / f"{stem}.png",
         f"{args.conversations} conversations x {args.turns} turns, pool {pool}; {machine()}")
    body = table(rows)
    (args.out / f"{stem}.md").write_text(
        f"{metadata_markdown(meta)}\n## Conversations: {args.conversations} x {args.turns} turns over documents of "
        f"~{args.document_tokens} tokens, interleaved; pool {pool} tokens; {args.dtype}\n\n"
        f"Setup: `{json.dumps(setup)}`\n\n{body}" + (
            "\n## Kept per segment\n\nThe share of each part's entries (tokens x heads) the turn's document kept, "
            "mean over conversations:\n\n" + segment_table(results) if found else "") + (
            "\n## The first turn conversations and documents answer differently\n\nPer part: kept by "
            "conversations / kept by documents / the same entries (Jaccard per head):\n\n"
            + differences_table("conversations", "documents", differences) if differences else ""))
    print(body)


if __name__ == "__main__":
    main()
