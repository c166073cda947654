"""A shared-context workload (SCBench-like): a few long documents, many questions about each.

    python -m benchmarks.shared_documents                   # docs/benchmarks.md has the results
    python -m benchmarks.shared_documents --documents 6 --document-tokens 2048 --questions 4

Each document is a chat message of about `--document-tokens` tokens of filler (the quality
benchmark's styles, one per document in turn) with `--facts` facts ("The code of the red door
is 4821."); each question asks one of them ("What is the code of the red door? Answer with the
number only."), as the conversation's second message. The questions arrive interleaved (the first
question of every document, then the second of every document, ...) and `--clients` clients send
them as streaming `/v1/chat/completions`, each taking the next when its answer is done.

Three servers, one after the other on the same machine, with the same model, dtype, chunk size
(`--chunk`) and pool (`--max-total-tokens`: a third of the documents' tokens, plus the room one
request compressing its document between chunks needs, see `pool_tokens`):
- `plain`: SGLang itself (`--policy none`, its radix cache on);
- `per-request`: every request compresses its own prompt, document and question, after prefill,
  by KVzip to the documents' entries (`kv_compression: {"budget": k}` with k = ratio x document),
  variable head budgets (`--kv-head-budget`);
- `own-copy`: every request compresses its own copy of its document exactly as `documents` does,
  nothing shared (each request its own `cache_salt`): the answers sharing must keep;
- `documents`: each document compressed once by KVzip to `--ratio` of its tokens, without any
  question, and shared (`kv_compression: {"document": {"ratio": r}}`: every message but the last);
  compressed after every chunk (`chunk-always`), so the request that compresses a document holds
  at most its budget, the document's entries and one chunk, never the document whole;
- `documents-on-pressure`: the same with the default moments (between chunks only when the next
  would not fit): the first request of a document reads it whole where memory allows and cuts it
  once, at its end.
`--baseline COMMIT` runs every compressing config again on sgl-kvc at another commit, right after
its own (`NAME@COMMIT`): the same requests, before and after a change, in one run.
Recorded per server: answers right (and kept, against `plain`'s, the full cache's), TTFT p50 /
p99, output tokens per second over the run, prompt tokens prefilled (`/v1/kvc/stats`), documents
compressed, hit, evicted and resident at the end, and the wall time. Writes
`<out>/shared-documents[-tag].{json,md,png}`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import config_runs, metadata_markdown, run_metadata
from benchmarks.quality_fillers import FILLERS
from benchmarks.quality_samples import CODES_HEAD, code_fact, code_objects, code_question
from loadtest.server import ServerProcess

STYLES = ("templated", "docs", "code", "table")
KVZIP_CHUNK = 512  # tokens of a reconstruction forward: bounds what a request reads at once
BUDGET = 128  # the compressing servers' --kv-budget: a document request's own, beyond its document


@dataclass(frozen=True)
class Question:
    document: int
    index: int
    messages: tuple[dict[str, str], ...]
    answer: str


@dataclass
class Answer:
    document: int
    index: int
    correct: bool
    text: str
    ttft: float
    seconds: float
    completion_tokens: int
    error: str = ""


@dataclass
class Result:
    config: str
    answers: list[Answer] = field(default_factory=list)
    wall_seconds: float = 0.0
    prefilled_tokens: int = 0
    prompt_tokens: int = 0
    documents: dict[str, Any] = field(default_factory=dict)
    pool_whole: bool = False

    def summary(self, full: "Result | None") -> dict[str, Any]:
        ok = [a for a in self.answers if not a.error]
        ttfts = sorted(a.ttft for a in ok)
        right = {(a.document, a.index) for a in ok if a.correct}
        out = {
            "config": self.config, "served": len(ok), "errors": len(self.answers) - len(ok),
            "right": len(right),
            "ttft_p50": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99": round(_percentile(ttfts, 0.99), 3) if ttfts else None,
            "output_tok_s": round(sum(a.completion_tokens for a in ok) / self.wall_seconds, 2),
            "prefilled_tokens": self.prefilled_tokens, "prompt_tokens": self.prompt_tokens,
            "wall_seconds": round(self.wall_seconds, 1), "pool_whole": self.pool_whole,
            **{f"documents_{k}": self.documents.get(k) for k in ("compressions", "hits", "evictions", "resident")},
        }
        if full is not None:
            full_right = {(a.document, a.index) for a in full.answers if a.correct and not a.error}
            out["kept"] = f"{len(right & full_right)}/{len(full_right)}"
        return out


def _percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def document_text(tok: Any, rng: random.Random, style: str, tokens: int, facts: int) -> tuple[str, list[str], list[int]]:
    """A document of about `tokens` tokens of `style` filler with `facts` facts, one in each
    equal part ("The code of the red door is 4821."): (its text, the facts' objects, their codes)."""
    filler = FILLERS[style]
    names, codes = code_objects(rng, facts)
    pieces, used, text = filler.pieces(rng), 0, []
    target = tokens - len(tok.encode(CODES_HEAD, add_special_tokens=False)) - 12 * facts
    while used < target:
        piece = next(pieces)
        used += len(tok.encode(filler.sep + piece, add_special_tokens=False))
        text.append(piece)
    for j, (name, code) in enumerate(zip(names, codes)):
        text.insert(round((j + 0.5) / facts * len(text)), code_fact(name, code))
    return CODES_HEAD + filler.sep.join(text), names, codes


def rendered(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """The token ids of `messages` as the chat template renders them (no generation prompt)."""
    ids = tok.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def message_tokens(tok: Any, text: str) -> int:
    """Tokens of `text` as a chat's only user message, rendered by the chat template."""
    return len(rendered(tok, [{"role": "user", "content": text}]))


def make_questions(tok: Any, documents: int, tokens: int, facts: int, per_document: int,
                   seed: int) -> tuple[list[Question], list[int]]:
    """The interleaved questions, and each document's length in tokens (its message rendered
    alone with the chat template)."""
    by_doc, lengths = [], []
    for d in range(documents):
        rng = random.Random(f"shared-documents-{seed}-{d}")
        document, names, codes = document_text(tok, rng, STYLES[d % len(STYLES)], tokens, facts)
        lengths.append(message_tokens(tok, document))
        asked = rng.sample(range(facts), per_document)
        by_doc.append([Question(d, q, ({"role": "user", "content": document},
                                       {"role": "user", "content": code_question(names[a])}), str(codes[a]))
                       for q, a in enumerate(asked)])
    return [by_doc[d][q] for q in range(per_document) for d in range(documents)], lengths


def pool_tokens(lengths: list[int], ratio: float, chunk: int) -> int:
    """A third of the documents' tokens, plus what one request compressing its document between
    chunks holds at most: one chunk, the reconstruction forward, its budget and the document's
    entries, its question and answer."""
    return math.ceil(sum(lengths) / 3) + chunk + KVZIP_CHUNK + BUDGET + math.ceil(ratio * max(lengths)) + 128


def server_flags(model: str, dtype: str, pool: int, chunk: int, kv_head_budget: str) -> tuple[list[str], list[str]]:
    """(every server's flags, the compressing servers': SnapKV for decoding, KVzip for prompts)."""
    common = ["--model-path", model, "--dtype", dtype, "--max-total-tokens", str(pool),
              "--chunked-prefill-size", str(chunk)]
    kvc = [*common, "--policy", "snapkv", "--prompt-policy", "kvzip", "--kvzip-chunk", str(KVZIP_CHUNK),
           "--kv-head-budget", kv_head_budget, "--kv-budget", str(BUDGET)]
    return common, kvc


def ask(url: str, q: Question, extra: dict[str, Any], max_tokens: int) -> Answer:
    if extra.get("cache_salt") is True:  # a namespace of its own: nothing it caches is shared
        extra = {**extra, "cache_salt": f"question-{q.document}-{q.index}"}
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="-", timeout=3600)
    t0 = time.perf_counter()
    ttft, text, tokens = None, "", 0
    try:
        stream = client.chat.completions.create(
            model="m", messages=list(q.messages), max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        return Answer(q.document, q.index, False, text, 0.0, time.perf_counter() - t0, 0, f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    return Answer(q.document, q.index, q.answer in text, text, ttft or seconds, seconds, tokens)


def run(config: str, flags: list[str], extra: dict[str, Any], questions: list[Question], clients: int,
        max_tokens: int, log: Path, env: dict[str, str] | None = None) -> Result:
    with ServerProcess.launch(flags, env=env, log_path=log) as server:
        result = Result(config)
        t0 = time.perf_counter()
        lock, queue = threading.Lock(), list(questions)

        def client() -> list[Answer]:
            out = []
            while True:
                with lock:
                    if not queue:
                        return out
                    q = queue.pop(0)
                out.append(ask(server.url, q, extra, max_tokens))

        with ThreadPoolExecutor(clients) as pool:
            for answers in pool.map(lambda _: client(), range(clients)):
                result.answers += answers
        result.wall_seconds = time.perf_counter() - t0
        stats = server.wait_idle()
        result.prefilled_tokens = stats["prefix_cache"]["prefilled_tokens"]
        result.prompt_tokens = stats["prefix_cache"]["prompt_tokens"]
        result.documents = stats.get("documents", {})
        p = stats["pool"]
        result.pool_whole = p["free_tokens"] + p["cached_tokens"] == p["total_tokens"]
    result.answers.sort(key=lambda a: (a.index, a.document))
    return result


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["config", "right", "kept", "ttft_p50", "ttft_p99", "output_tok_s", "prefilled_tokens", "prompt_tokens",
            "documents_compressions", "documents_hits", "documents_evictions", "documents_resident", "errors",
            "wall_seconds", "pool_whole"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("–" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Side by side per config: TTFT p50 and p99, prompt tokens prefilled, answers right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["ttft_p50"] or 0 for r in rows], 0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["ttft_p99"] or 0 for r in rows], 0.4, label="p99")
    axes[0].set_ylabel("time to first token (s)")
    axes[0].legend()
    axes[1].bar(list(x), [r["prefilled_tokens"] for r in rows])
    axes[1].set_ylabel("prompt tokens prefilled")
    axes[2].bar(list(x), [r["right"] for r in rows])
    axes[2].set_ylabel("answers right")
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=20, ha="right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=6)
    p.add_argument("--document-tokens", type=int, default=2048)
    p.add_argument("--facts", type=int, default=8)
    p.add_argument("--questions", type=int, default=4, help="per document")
    p.add_argument("--ratio", type=float, default=0.3)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--chunk", type=int, default=512, help="--chunked-prefill-size of every server")
    p.add_argument("--kv-head-budget", default="variable", choices=["policy", "uniform", "variable", "layer"],
                   help="of the compressing servers (KVzip's gain comes from variable budgets)")
    p.add_argument("--configs", nargs="+",
                   default=["plain", "per-request", "own-copy", "documents", "documents-on-pressure"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default="")
    p.add_argument("--baseline", default=None, metavar="COMMIT",
                   help="also run every compressing config on sgl-kvc at COMMIT, each right after its own (NAME@COMMIT)")
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.shared_documents", argv)
    print(metadata_markdown(meta), flush=True)

    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    model = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    questions, lengths = make_questions(tok, args.documents, args.document_tokens, args.facts, args.questions, args.seed)
    pool = pool_tokens(lengths, args.ratio, args.chunk)
    k = math.ceil(args.ratio * max(lengths))
    common, kvc = server_flags(model, args.dtype, pool, args.chunk, args.kv_head_budget)
    import sys

    launch = [sys.executable, "-m", "sgl_kvc.launch"]
    configs = {
        "plain": ([*launch, *common, "--policy", "none"], {}),
        "per-request": ([*launch, *kvc], {"kv_compression": {"budget": k}}),
        "own-copy": ([*launch, *kvc, "--compress-on", "chunk-always,prefill,decode,preempt"],
                     {"kv_compression": {"document": {"ratio": args.ratio}}, "cache_salt": True}),
        "documents": ([*launch, *kvc, "--compress-on", "chunk-always,prefill,decode,preempt"],
                      {"kv_compression": {"document": {"ratio": args.ratio}}}),
        "documents-on-pressure": ([*launch, *kvc], {"kv_compression": {"document": {"ratio": args.ratio}}}),
    }
    logs = Path(tempfile.mkdtemp(prefix="shared-documents-"))
    print(f"{len(questions)} questions on {args.documents} documents of {lengths} tokens; pool {pool}; "
          f"server logs {logs}", flush=True)
    results: dict[str, Result] = {}
    with config_runs(args.configs, configs, launch, args.baseline) as runs:
        for label, cmd, extra, env in runs:
            results[label] = run(label, cmd, extra, questions, args.clients, args.max_tokens, logs / f"{label}.log", env)
            print(table([results[label].summary(results.get("plain"))]), flush=True)
    rows = [r.summary(results.get("plain")) for r in results.values()]
    stem = "shared-documents" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    setup = {"documents": args.documents, "document_tokens": lengths, "facts": args.facts,
             "questions_per_document": args.questions, "ratio": args.ratio, "entries": k, "pool": pool,
             "clients": args.clients, "max_tokens": args.max_tokens, "dtype": args.dtype,
             "kv_head_budget": args.kv_head_budget, "chunk": args.chunk, "kv_budget": BUDGET,
             "kvzip_chunk": KVZIP_CHUNK}
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "setup": setup, "summary": rows,
         "answers": {n: [asdict(a) for a in r.answers] for n, r in results.items()}}, indent=2))
    body = table(rows)
    from benchmarks.common import machine

    plot(rows, args.out / f"{stem}.png", f"{args.documents} documents x {args.questions} questions, pool {pool}; {machine()}")
    (args.out / f"{stem}.md").write_text(
        f"{metadata_markdown(meta)}\n## Shared documents: {args.documents} documents of ~{args.document_tokens} tokens, "
        f"{args.questions} questions each, interleaved; pool {pool} tokens; {args.dtype}\n\n"
        f"Setup: `{json.dumps(setup)}`\n\n{body}")
    print(body)


if __name__ == "__main__":
    main()
