"""How close long compressed generations stay to the full cache's, on the real default model.

    python -m benchmarks.long_generation                        # 9 prompts x 1024 tokens
    python -m benchmarks.long_generation --tokens 2048 --per-kind 2 --configs rkv@256 snapkv@256

R-KV's regime: a short prompt and a long output (a retelling, a long list, a step-by-step
explanation; `benchmarks.quality_samples.long_output_samples`), greedy with `ignore_eos`, so every
configuration writes `--tokens` tokens. One compressing server (`--policy rkv`) serves every
configuration through the per-request `kv_compression` setting; `full` is the same server with a
budget above any length. Each configuration sends all prompts at once, so every run decodes in
batches of the same shape; `full` runs first and again last (`full (again)`: the noise floor of
greedy decoding on this machine, a row any policy is compared against).

With kvpress's venv (`--kvpress-python`, as for `benchmarks.quality`), NVIDIA kvpress compresses
the same prompts under transformers (`research/kvpress_decoding_runner.py`: its
`DecodingPress` every `--kv-buffer` steps down to the budget, its press on the prompt too), scored
against its own full-cache run: `kvpress:<press>@<budget>`.

Scores against `full`, per prompt, averaged: the share of the output identical to the full
cache's before the first differing token, ROUGE-L F1 on words, and the share of outputs in a
repetition loop (`is_looping`) against the full cache's own loop rate, and the share that loop
where the full cache's output on the same prompt does not (an output identical to a looping
reference loops too; this column counts only the loops compression added). Each
request's compactions are read from the server's compaction trace (`SGLKVC_TRACE`): a
configuration whose requests were never compacted is reported as such, not as a quality result.
Writes `<out>/long-generation.{json,md,png}` (`long-generation-<tag>.*` with `--tag`).
The report ends with a table per prompt: the tokens each configuration keeps identical, and
which outputs loop.
`--reference FILE.json` takes `full` from a result file of the same prompts, tokens and dtype
instead of running it (a third less time for one configuration); `full (again)` still runs, so
the report shows whether the stored outputs still come out of this code on this machine.
`--rescore FILE.json` scores a result file's stored outputs again (after a change to the scores)
and rewrites its .md and .png; nothing is run, and the compaction counts are the stored ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from benchmarks.common import git_commit, machine, metadata_markdown, run_metadata
from benchmarks.quality import DEFAULT_KVPRESS_PYTHON, REPO, UNCOMPRESSED, ManagedServer, Outcome
from benchmarks.quality_samples import (
    LONG_OUTPUT_KINDS, MAX_LONG_OUTPUT_PER_KIND, Sample, check_per_kind, long_output_samples,
)

CONFIGS = ["rkv@128", "rkv@256", "rkv@512", "snapkv@256", "streamingllm@256", "h2o@256", "batchmax@256",
           "kvcompress@256"]
FULL, FULL_AGAIN = "full", "full (again)"


@dataclass
class LongOutputScore:
    config: str
    samples: int
    failures: int
    compacted: int  # requests with at least one compaction in the trace
    compactions: float  # per request, mean
    identical_share: float  # tokens before the first difference / tokens written, mean
    identical_tokens: float
    within_budget: int  # requests whose prompt fits the budget: compressed only while decoding
    identical_share_within_budget: float  # identical_share over those requests
    rouge_l: float
    loop_rate: float
    new_loop_rate: float  # in a loop where the reference's output on the same prompt is not
    by_kind: dict[str, list[float]]  # kind -> [identical share, ROUGE-L]
    per_prompt: dict[str, list]  # sample id -> [identical tokens, in a loop]


class _PromptScore(NamedTuple):
    identical: float  # share of the reference's tokens before the first difference
    rouge_l: float
    same_tokens: int
    loops: bool
    kind: str
    new_loop: bool  # loops where the reference's output does not


# --- text scores ------------------------------------------------------------------------------


def lcs_len(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    c, r = candidate.split(), reference.split()
    if not c or not r:
        return float(c == r)
    lcs = lcs_len(c, r)
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def is_looping(ids: list[int], n: int = 8, threshold: float = 0.5) -> bool:
    """Stuck in a loop: over half of the second half's n-grams already occurred in it."""
    half = ids[len(ids) // 2 :]
    grams = [tuple(half[i : i + n]) for i in range(len(half) - n + 1)]
    return bool(grams) and 1 - len(set(grams)) / len(grams) > threshold


def settings(config: str) -> dict:
    """'rkv@256' -> R-KV at 256 (its default prompt policy); 'snapkv>rkv@256' -> the prompt
    compressed by SnapKV, the output by R-KV; 'full' -> nothing evicted."""
    if config in (FULL, FULL_AGAIN):
        return {"budget": UNCOMPRESSED}
    name, _, budget = config.partition("@")
    prompt, _, policy = name.rpartition(">")
    return {"policy": policy, "budget": int(budget), **({"prompt_policy": prompt} if prompt else {})}


def config_budget(config: str) -> int:
    """The KV budget a configuration compresses to ('kvpress:snapkv@256' -> 256; full: none)."""
    _, at, budget = config.rpartition("@")
    return int(budget) if at else UNCOMPRESSED


def run_config(server: ManagedServer, samples: list[Sample], config: str, timeout_s: float) -> list[Outcome]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(samples)) as pool:
        out = list(pool.map(lambda s: server.complete(s, config, settings(config), timeout_s), samples))
    bad = sum(o.text is None for o in out)
    print(f"[long-generation] {config}: {time.perf_counter() - t0:.0f} s, {bad} failed", flush=True)
    return out


def run_kvpress(
    samples: list[Sample], args: argparse.Namespace, model: Path, workdir: Path
) -> tuple[dict[str, list[Outcome]], Counter, str]:
    """kvpress's rows ({config: outcomes}), the compactions of each (by the outcome's `rid`), and
    a note for the report."""
    py = Path(args.kvpress_python)
    if not args.kvpress_presses or not py.exists():
        return {}, Counter(), f"kvpress: not run (no venv at {py})." if args.kvpress_presses else ""
    inp, outp = workdir / "kvpress_in.json", workdir / "kvpress_out.json"
    inp.write_text(json.dumps({
        "model": str(model), "dtype": args.dtype, "tokens": args.tokens, "buffer": args.kv_buffer,
        "budgets": args.kvpress_budgets, "presses": args.kvpress_presses,
        "samples": [s.to_json() for s in samples],
    }))  # fmt: skip
    cmd = [str(py), str(REPO / "research" / "kvpress_decoding_runner.py"), str(inp), str(outp)]
    print(f"[long-generation] kvpress: {' '.join(cmd)}", flush=True)
    try:
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
        subprocess.run(cmd, check=True, timeout=args.request_timeout * len(samples), env=env)
        data = json.loads(outp.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        return {}, Counter(), f"kvpress: failed ({e!s:.300})."
    rows: dict[str, list[Outcome]] = {}
    counts: Counter = Counter()
    for r in data["results"]:
        rid = f"{r['config']}/{r['sample']}"
        rows.setdefault(r["config"], []).append(Outcome(r["sample"], r["config"], r["text"], r.get("error"), 0.0, rid))
        counts[rid] = r.get("compactions", 0)
    return rows, counts, (f"kvpress {data['version']} rows: its DecodingPress (and the press on the prompt) "
                          "under transformers, scored against its own full-cache run.")


def compactions_by_rid(trace: Path) -> Counter:
    """Compactions per request id (rank 0's: with tensor parallelism every rank writes one)."""
    lines = trace.read_text().splitlines() if trace.exists() else []
    events = (json.loads(line) for line in lines)
    return Counter(e["rid"] for e in events if e.get("tp_rank", 0) == 0)


def score(config: str, samples: list[Sample], outcomes: dict[str, Outcome], reference: dict[str, Outcome],
          events: Counter, tok) -> LongOutputScore:
    mine = [s for s in samples if reference[s.id].text is not None]
    done = [s for s in mine if outcomes[s.id].text is not None]
    per: dict[str, _PromptScore] = {}
    for s in done:
        a = tok.encode(outcomes[s.id].text, add_special_tokens=False)
        b = tok.encode(reference[s.id].text, add_special_tokens=False)
        same = common_prefix(a, b)
        loops = is_looping(a)
        per[s.id] = _PromptScore(same / max(len(b), 1), rouge_l(outcomes[s.id].text, reference[s.id].text),
                                 same, loops, s.meta["kind"], loops and not is_looping(b))
    mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
    counts = [events.get(outcomes[s.id].rid, 0) for s in done]
    budget = config_budget(config)
    fits = [per[s.id].identical for s in done if s.prompt_len <= budget]
    by_kind = {k: [mean([v.identical for v in per.values() if v.kind == k]),
                   mean([v.rouge_l for v in per.values() if v.kind == k])] for k in LONG_OUTPUT_KINDS}  # fmt: skip
    return LongOutputScore(
        config=config, samples=len(mine), failures=len(mine) - len(done),
        compacted=sum(c > 0 for c in counts), compactions=mean(counts),
        identical_share=mean([v.identical for v in per.values()]),
        identical_tokens=mean([v.same_tokens for v in per.values()]),
        within_budget=len(fits), identical_share_within_budget=mean(fits),
        rouge_l=mean([v.rouge_l for v in per.values()]), loop_rate=mean([float(v.loops) for v in per.values()]),
        new_loop_rate=mean([float(v.new_loop) for v in per.values()]), by_kind=by_kind,
        per_prompt={k: [v.same_tokens, v.loops] for k, v in per.items()},
    )  # fmt: skip


def markdown(data: dict) -> str:
    s = data["setup"]
    rows = data["scores"]
    full = next((r for r in rows if r["config"] == FULL), None)
    out = [
        f"{len(s['samples'])} prompts ({s['per_kind']} of each kind: {', '.join(LONG_OUTPUT_KINDS)}), "
        f"{s['tokens']} greedy tokens each (ignore_eos), all prompts of a configuration at once; "
        f"server: `{' '.join(s['server'])}`. Against `full` (the same server, nothing evicted): "
        f"identical = the share of the output before its first token that differs from the full "
        f"cache's; prompt within budget = the identical share over the prompts no longer than the "
        f"budget (R-KV's regime: only the output is compressed; a longer prompt is compressed before "
        f"the first token); loops = outputs in a repetition loop (full cache: "
        f"{_pct(full['loop_rate']) if full else '-'}); new loops = outputs in a loop where the full "
        f"cache's on the same prompt is not; compacted = requests the trace shows compacted.\n",
        "| config | identical | identical tokens | identical, prompt within budget | ROUGE-L | loops | new loops "
        "| compacted | compactions / request | "
        + " | ".join(f"{k}: identical / ROUGE-L" for k in LONG_OUTPUT_KINDS) + " |",
        "| --- |" + " ---: |" * (8 + len(LONG_OUTPUT_KINDS)),
    ]
    for r in rows:
        if r["config"] == FULL:
            continue
        kinds = " | ".join(f"{_pct(r['by_kind'][k][0])} / {r['by_kind'][k][1]:.2f}" for k in LONG_OUTPUT_KINDS)
        out.append(
            f"| {r['config']} | {_pct(r['identical_share'])} | {r['identical_tokens']:.0f} | "
            f"{_pct(r['identical_share_within_budget'])} ({r['within_budget']}) | {r['rouge_l']:.2f} | "
            f"{_pct(r['loop_rate'])} | {_pct(r['new_loop_rate'])} | {r['compacted']}/{r['samples'] - r['failures']} | {r['compactions']:.1f} | {kinds} |"
        )
    out.append(f"\nFailed requests: {data['failures']}. {data.get('kvpress_note', '')}".rstrip())
    if "reference" in s:
        out.append(f"\n`full`: the stored outputs of {s['reference']}; `full (again)` ran here.")
    out.append(per_prompt_markdown(data))
    return "\n".join(out) + "\n"


def per_prompt_markdown(data: dict) -> str:
    """Rows: prompts; columns: configurations; a cell: the tokens identical to the full cache's
    output before the first difference, with "loop" where that output is in a repetition loop."""
    rows = [r for r in data["scores"] if r["config"] != FULL and "per_prompt" in r]
    full = next((r for r in data["scores"] if r["config"] == FULL and "per_prompt" in r), None)
    if not rows:
        return ""
    out = ["\nPer prompt: tokens identical to the full cache's output (\"loop\": the output is in a "
           "repetition loop).\n",
           "| prompt | prompt tokens | full | " + " | ".join(r["config"] for r in rows) + " |",
           "| --- |" + " ---: |" * (2 + len(rows))]  # fmt: skip
    for sample in data["setup"]["samples"]:
        sid = sample["id"]
        cells = []
        for r in [full, *rows]:
            got = r["per_prompt"].get(sid) if r else None
            cells.append("-" if got is None else f"{got[0]}{' loop' if got[1] else ''}")
        out.append(f"| {sid} | {sample['prompt_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["scores"] if r["config"] != FULL]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["identical_share"] for r in rows], 0.4, label="identical share")
    ax.bar([i + 0.2 for i in x], [r["rouge_l"] for r in rows], 0.4, label="ROUGE-L")
    ax.set_xticks(list(x), [r["config"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    s = data["setup"]
    ax.set_title(f"{s['model']}: {s['tokens']}-token greedy outputs against the full cache; {s['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def per_kind_arg(value: str) -> int:
    """--per-kind: as many prompts of each kind as there are distinct ones (a usage error past it)."""
    try:
        return check_per_kind(int(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=CONFIGS,
                   help="POLICY@BUDGET, or PROMPT_POLICY>POLICY@BUDGET (e.g. rkv>rkv@256: R-KV for the prompt too)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens every output is long")
    p.add_argument("--per-kind", type=per_kind_arg, default=3,
                   help=f"prompts of each kind (retell, list, steps), 1 to {MAX_LONG_OUTPUT_PER_KIND}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the model's dtype (float32: greedy decoding far from rounding ties)")
    p.add_argument("--kv-buffer", type=int, default=128)
    p.add_argument("--server-args", default="", help="more flags for the server")
    p.add_argument("--request-timeout", type=float, default=3600)
    p.add_argument("--server-timeout", type=float, default=600)
    p.add_argument("--kvpress-python", default=os.environ.get("KVPRESS_PYTHON", str(DEFAULT_KVPRESS_PYTHON)))
    p.add_argument("--kvpress-presses", nargs="*", default=["snapkv", "streamingllm"],
                   help="kvpress presses run as DecodingPress (none: no kvpress rows)")
    p.add_argument("--kvpress-budgets", nargs="+", type=int, default=[256])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default="")
    p.add_argument("--reference", type=Path, metavar="FILE.json",
                   help="take `full` from this result file (same prompts, tokens and dtype) instead of running it")
    p.add_argument("--rescore", type=Path, metavar="FILE.json",
                   help="score a result file's stored outputs again and rewrite its .md and .png (runs nothing)")
    return p


def score_all(outcomes: dict[str, list[Outcome]], samples: list[Sample], events: Counter, tok) -> list[LongOutputScore]:
    """Every configuration against its engine's full cache: kvpress rows against kvpress's own
    (its row: identical by definition; its loop rate), the others against `full`."""
    by_id = {c: {o.sample: o for o in outs} for c, outs in outcomes.items()}
    kv_full = by_id.get("kvpress:full")
    return [score(c, samples, by_id[c], kv_full if c.startswith("kvpress:") else by_id[FULL], events, tok)
            for c in outcomes if kv_full is not None or not c.startswith("kvpress:")]  # fmt: skip


def write_report(data: dict, out: Path, stem: str) -> str:
    table = markdown(data)
    s = data["setup"]
    title = (f"{metadata_markdown(data['meta'])}\n{s['model']} on `python -m sgl_kvc.launch` (CPU); "
             f"{s['machine']}; {s['date']}; total {s['total_seconds'] / 60:.0f} min.\n\n")
    if "rescored" in data:
        title += f"Scores recomputed from the stored outputs: {data['rescored']}.\n\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(title + table)
    plot(data, out / f"{stem}.png")
    return title + table


def stored_outcomes(data: dict) -> dict[str, list[Outcome]]:
    """A result file's outcomes by configuration, in the order they were run."""
    outcomes: dict[str, list[Outcome]] = {}
    for o in data["outcomes"]:
        outcomes.setdefault(o["config"], []).append(Outcome(**o))
    return outcomes


def rescore(path: Path, tok=None) -> dict:
    """Score `path`'s stored outputs with this version of `score` (same samples: they are
    rebuilt from the stored seed, sizes and tokenizer); compaction counts come from the stored
    scores, since the trace is not kept."""
    from transformers import AutoTokenizer

    from sgl_kvc.model import ensure_smollm2

    data = json.loads(path.read_text())
    s = data["setup"]
    tok = tok or AutoTokenizer.from_pretrained(ensure_smollm2())
    samples = long_output_samples(tok, s["per_kind"], s["tokens"], s["seed"])
    if [x.id for x in samples] != [x["id"] for x in s["samples"]]:
        raise SystemExit(f"{path}: its samples are not the ones this version builds from seed {s['seed']}")
    stored = {r["config"]: r for r in data["scores"]}
    scores = []
    for r in score_all(stored_outcomes(data), samples, Counter(), tok):
        r.compacted, r.compactions = stored[r.config]["compacted"], stored[r.config]["compactions"]
        scores.append(asdict(r))
    data["scores"] = scores
    data["rescored"] = f"`python -m benchmarks.long_generation --rescore` at {git_commit()}"
    return data


def stored_reference(path: Path, samples: list[Sample], tokens: int, dtype: str) -> tuple[list[Outcome], str]:
    """`full`'s outcomes from a result file, and how the report names them; a file of other
    prompts, lengths or dtype is refused (its outputs would not be this run's reference)."""
    data = json.loads(path.read_text())
    s = data["setup"]
    flags = s["server"]
    stored_dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else None
    if s["tokens"] != tokens or stored_dtype != dtype:
        raise SystemExit(f"{path}: {s['tokens']} tokens in {stored_dtype}, not {tokens} in {dtype}")
    if [x["id"] for x in s["samples"]] != [x.id for x in samples] or [
        x["prompt_tokens"] for x in s["samples"]
    ] != [x.prompt_len for x in samples]:
        raise SystemExit(f"{path}: its prompts are not this run's (--per-kind, --seed)")
    full = stored_outcomes(data).get(FULL, [])
    if len(full) != len(samples) or any(o.text is None for o in full):
        raise SystemExit(f"{path}: no complete `{FULL}` row")
    return full, f"`{path.name}` (commit {data['meta']['commit']})"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.rescore is not None:
        data = rescore(args.rescore)
        print(write_report(data, args.rescore.parent, args.rescore.name.removesuffix(".json")), flush=True)
        return data
    meta = run_metadata("benchmarks.long_generation", argv)
    print(metadata_markdown(meta), flush=True)
    from transformers import AutoTokenizer

    from sgl_kvc.model import SMOLLM2_MODEL_NAME, ensure_smollm2

    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    samples = long_output_samples(tok, args.per_kind, args.tokens, args.seed)
    outcomes: dict[str, list[Outcome]] = {}
    reference = None
    if args.reference is not None:
        outcomes[FULL], reference = stored_reference(args.reference, samples, args.tokens, args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="long-generation-"))
    trace = logs / "trace.jsonl"
    pool = len(samples) * (max(s.prompt_len for s in samples) + args.tokens + 8)
    flags = ["--policy", "rkv", "--dtype", args.dtype, "--kv-buffer", str(args.kv_buffer),
             "--max-total-tokens", str(pool), "--max-running-requests", str(len(samples)),
             *shlex.split(args.server_args)]  # fmt: skip
    server = ManagedServer("long-generation", flags, logs, args.server_timeout, env={"SGLKVC_TRACE": str(trace)})
    try:
        for config in [*([] if reference else [FULL]), *args.configs, FULL_AGAIN]:
            outcomes[config] = run_config(server, samples, config, args.request_timeout)
    finally:
        server.close()
    events = compactions_by_rid(trace)
    kvpress, kvpress_counts, note = run_kvpress(samples, args, ensure_smollm2(), logs)
    outcomes.update(kvpress)
    events.update(kvpress_counts)
    scores = score_all(outcomes, samples, events, tok)
    data = {
        "meta": meta,
        "setup": {
            "model": SMOLLM2_MODEL_NAME, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "tokens": args.tokens, "per_kind": args.per_kind, "seed": args.seed, "server": flags,
            "samples": [{"id": s.id, "prompt_tokens": s.prompt_len, **s.meta} for s in samples],
            "total_seconds": time.perf_counter() - t_start,
            **({"reference": reference} if reference else {}),
        },
        "scores": [asdict(r) for r in scores],
        "failures": sum(o.text is None for outs in outcomes.values() for o in outs),
        "kvpress_note": note,
        "outcomes": [asdict(o) for outs in outcomes.values() for o in outs],
    }  # fmt: skip
    stem = "long-generation" + (f"-{args.tag}" if args.tag else "")
    print(write_report(data, args.out, stem), flush=True)
    return data


if __name__ == "__main__":
    main()
