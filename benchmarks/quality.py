"""What compression costs in answer quality, on the real default model (SmolLM2-135M-Instruct).

    python -m benchmarks.quality                      # every policy, budget and task
    python -m benchmarks.quality --quick              # a few samples, to check the set-up
    python -m benchmarks.quality --policies snapkv rkv --budgets 128 512 --passkey 1024:2

Two servers, one after the other, both `python -m sgl_kvc.launch` on the built-in model:
- the full cache (`--policy none`): the reference;
- one compressing server (`--policy rkv`) that serves every policy x budget through the
  per-request `kv_compression` setting, so one start-up covers all combinations. Each prompt is
  first sent uncompressed (budget above its length: the `uncompressed` row, a noise floor against
  the reference), which also puts it in the radix cache: the policy x budget requests then reuse
  its KV and recompute only the last `--kv-window` tokens, whose queries score the prompt.

Scores, all greedy (temperature 0): pass-key retrieval (5-digit key at 10/50/90% depth of
~1K/2K/4K-token prompts) and multi-key fact lookup (one of several codes), each reported
as the share of the samples the full cache answers correctly that a configuration still answers.
Beside every score, what the compactions kept (the compressing server's compaction trace,
`benchmarks/quality_trace.py`): how many requests were compacted before they answered, the share
of the answer's tokens an average (layer, KV head) kept, and the share of kept entries in the
first quarter of the prompt.
Then compression seconds per pass at 1K/4K/8K-token prompts (from `/v1/kvc/stats` deltas around
single requests). Then, when its venv exists (`--kvpress-python`), NVIDIA kvpress's presses on the
same samples (`research/kvpress_runner.py`). A failed request, or a server that dies, is
recorded as a failure and the benchmark goes on (a dead server is started again).
Long outputs are `benchmarks.long_generation`'s.
Writes `<out>/quality.json`, `<out>/quality.md` and `<out>/quality.png` (`quality-<tag>.*` with `--tag`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from benchmarks.common import NOT_RECORDED, machine, metadata_markdown, run_metadata
from benchmarks.quality_fillers import STYLES
from benchmarks.quality_trace import answer_positions, evidence, prompt_compactions
from benchmarks.quality_samples import (
    Sample,
    document_samples,
    is_correct,
    multikey_samples,
    passkey_samples,
    sentence,
)
from loadtest.server import ServerProcess
from sgl_kvc.policies import BUDGET_MODES, policy_class

POLICIES = ["rkv", "h2o", "snapkv", "streamingllm", "batchmax", "kvcompress", "rkv/shared", "snapkv/shared"]
BUDGETS = [128, 256, 512, 1024]
UNCOMPRESSED = 1 << 20  # a per-request budget above any prompt: nothing is evicted
REPO = Path(__file__).resolve().parents[1]
DEFAULT_KVPRESS_PYTHON = REPO.parent / "kvpress-venv" / "bin" / "python"
RETRIEVAL = ("passkey", "multikey", "multidoc")
TASK_TITLES = {"passkey": "pass key", "multikey": "multi-key", "multidoc": "document facts"}


@dataclass
class Outcome:
    """One request: a sample under one configuration."""

    sample: str
    config: str  # "full" (reference server), "uncompressed", "<policy>@<budget>", "kvpress:<press>@<budget>"
    text: str | None
    error: str | None = None
    seconds: float = 0.0
    rid: str | None = None  # the server's request id (its compactions in the trace)


@dataclass
class RetrievalScore:
    task: str
    config: str
    samples: int
    failures: int
    correct: int
    reference_correct: int  # samples the full cache answers
    kept: int  # of those, answered correctly here
    relative: float | None  # kept / reference_correct
    by_length: dict[str, float | None] = field(default_factory=dict)
    by_style: dict[str, list[int]] = field(default_factory=dict)  # style -> [kept, reference_correct]


@dataclass
class KeptSummary:
    """What the prompt compactions of one configuration's retrieval requests kept (trace)."""

    config: str
    requests: int  # answered retrieval requests
    compacted: int  # of those, compacted before the answer (the others scored on the full cache)
    answer_kept: float | None  # mean share of the answer's tokens an average (layer, KV head) kept
    early_share: float | None  # mean share of kept entries in the first quarter of the prompt
    answer_kept_by_style: dict[str, float] = field(default_factory=dict)


@dataclass
class TimingResult:
    policy: str
    prompt_tokens: int
    budget: int
    seconds_per_pass: float | None
    passes: int
    error: str | None = None
    # a prompt policy with a reconstruction pass (KVzip): its seconds, and the prompt's prefill's
    # (the first request for the prompt, uncompressed, which reads it whole)
    reconstruction_seconds: float | None = None
    prefill_seconds: float | None = None


# --- servers ------------------------------------------------------------------------------------


class ManagedServer:
    """A launcher server that is started again when it dies; requests never raise."""

    def __init__(self, name: str, flags: list[str], log_dir: Path, timeout_s: float,
                 max_restarts: int = 3, env: dict[str, str] | None = None) -> None:
        self.name, self.flags, self.log_dir, self.env = name, flags, log_dir, env
        self.timeout_s, self.max_restarts = timeout_s, max_restarts
        self.starts = 0
        self._stack: ExitStack | None = None
        self.server: ServerProcess | None = None
        self._lock = threading.Lock()

    def _alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def ensure(self) -> bool:
        """Start (or restart) the server unless it runs; False when it cannot be started."""
        with self._lock:
            if self._alive():
                return True
            self.close_unlocked()
            if self.starts > self.max_restarts:
                return False
            self.starts += 1
            cmd = [sys.executable, "-m", "sgl_kvc.launch", *self.flags]
            log = self.log_dir / f"{self.name}-{self.starts}.log"
            print(f"[quality] start {self.name} ({self.starts}): {' '.join(self.flags)}", flush=True)
            self._stack = ExitStack()
            try:
                self.server = self._stack.enter_context(ServerProcess.launch(cmd, env=self.env, log_path=log))
            except Exception as e:  # noqa: BLE001 - a server that cannot start is a recorded failure
                print(f"[quality] {self.name} did not start: {e!s:.500}", flush=True)
                self.close_unlocked()
                return False
            return True

    def complete(self, sample: Sample, config: str, kvc: dict | None, timeout_s: float) -> Outcome:
        if not self.ensure():
            return Outcome(sample.id, config, None, "server could not be started")
        assert self.server is not None
        body: dict[str, Any] = {
            "model": "m", "prompt": sample.prompt_ids, "max_tokens": sample.max_tokens,
            "temperature": 0.0, "ignore_eos": sample.ignore_eos,
        }
        if kvc:
            body["kv_compression"] = kvc
        t0 = time.perf_counter()
        try:
            r = requests.post(self.server.url + "/v1/completions", json=body, timeout=timeout_s)
            if r.status_code != 200:
                return Outcome(sample.id, config, None, f"HTTP {r.status_code}: {r.text[:300]}",
                               time.perf_counter() - t0)
            answer = r.json()
            text = answer["choices"][0]["text"]
            return Outcome(sample.id, config, text, None, time.perf_counter() - t0, answer.get("id"))
        except Exception as e:  # noqa: BLE001 - record and go on; ensure() restarts a dead server
            return Outcome(sample.id, config, None, f"{type(e).__name__}: {e!s:.300}",
                           time.perf_counter() - t0)

    def flush(self, attempts: int = 20) -> bool:
        """Empty the radix cache (SGLang's `/flush_cache`, done only when nothing runs: a request
        whose answer just came back may still be finishing, so it is asked again)."""
        for _ in range(attempts):
            if not self.ensure():
                return False
            try:
                if requests.post(self.server.url + "/flush_cache", timeout=60).status_code == 200:
                    return True
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.5)
        return False

    def stats(self) -> dict | None:
        try:
            return self.server.stats() if self._alive() and self.server else None
        except Exception:  # noqa: BLE001
            return None

    def close_unlocked(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._stack, self.server = None, None

    def close(self) -> None:
        with self._lock:
            self.close_unlocked()


# --- runs ---------------------------------------------------------------------------------------


def policy_settings(name: str) -> dict:
    """`kv_compression` of a policy row: "snapkv" selects per head (the server's default),
    "snapkv/shared" keeps one set per request (`selection: shared`), "snapkv/variable" per head
    with variable budgets (a run with `--kv-head-budget variable`: its server's setting; "/layer"
    likewise). "rkv>rkv": the prompt compressed by the policy before ">" (`prompt_policy`; a
    name alone gets its policy's own prompt policy, SnapKV for R-KV). A prompt policy alone
    ("kvzip") compresses the prompt, and the server's policy what is generated."""
    name, _, selection = name.partition("/")
    prompt, _, policy = name.rpartition(">")
    chosen = {"selection": selection} if selection not in ("", *BUDGET_MODES) else {}
    if not prompt and policy_class(policy).prompt_only:  # "kvzip": the prompt's policy, the server's decodes
        return {"prompt_policy": policy, **chosen}
    return {"policy": policy, **({"prompt_policy": prompt} if prompt else {}), **chosen}


def combos(policies: list[str], budgets: list[int | float]) -> list[tuple[str, dict]]:
    return [(f"{p}@{b}", {**policy_settings(p), "budget": b}) for p in policies for b in budgets]


def parse_budget(text: str) -> int | float:
    """A budget: entries per (layer, KV head) ("256"), or a fraction of the prompt's context ("0.3":
    the prompt up to its question, `request_budget`)."""
    value = float(text)
    if value >= 1:
        if value != int(value):
            raise argparse.ArgumentTypeError(f"a budget of 1 or more is a number of entries, got {text}")
        return int(value)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a budget must be > 0, got {text}")
    return value


def context_len(sample: Sample) -> int:
    """The prompt's context: up to its question (`meta.question_at`), or the whole prompt."""
    at = (sample.meta or {}).get("question_at")
    return at if at else sample.prompt_len


def request_budget(budget: int | float, sample: Sample) -> int:
    """The per-request budget of a configuration for one sample: a fraction of its context is that
    many entries (kvpress keeps int(context x (1 - compression_ratio)) the same way)."""
    return budget if isinstance(budget, int) else max(1, round(budget * context_len(sample)))


def for_sample(kvc: dict, sample: Sample) -> dict:
    return {**kvc, "budget": request_budget(kvc["budget"], sample)}


def run_reference(server: ManagedServer, samples: list[Sample], args: argparse.Namespace) -> list[Outcome]:
    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(lambda s: server.complete(s, "full", None, args.request_timeout), samples))


def run_compressed(server: ManagedServer, samples: list[Sample], args: argparse.Namespace) -> list[Outcome]:
    out: list[Outcome] = []
    todo = combos(args.policies, args.budgets)
    with ThreadPoolExecutor(max(args.concurrency, len(todo))) as pool:
        for i, s in enumerate(samples):
            t0 = time.perf_counter()
            if args.no_uncompressed:  # the merged run's uncompressed row; every combination runs
                warm, live, same = None, list(todo), []
            else:
                # Alone first: the prompt's prefill, once; the combinations below hit the radix cache.
                warm = server.complete(s, "uncompressed", {"budget": UNCOMPRESSED}, args.request_timeout)
                # A budget that holds prompt and output never compresses: it is the uncompressed run.
                live = [c for c in todo if request_budget(c[1]["budget"], s) < s.prompt_len + s.max_tokens]
                same = [Outcome(s.id, c[0], warm.text, warm.error, warm.seconds)
                        for c in todo if c not in live]  # fmt: skip
            width = args.concurrency
            chunks = [live[j : j + width] for j in range(0, len(live), max(width, 1))]
            rest = []
            for chunk in chunks:
                rest += list(pool.map(
                    lambda c, s=s: server.complete(s, c[0], for_sample(c[1], s), args.request_timeout), chunk
                ))  # fmt: skip
            rest += same
            done = [o for o in (warm, *rest) if o is not None]
            out += done
            bad = sum(o.text is None for o in done)
            print(f"[quality] {i + 1}/{len(samples)} {s.id} ({s.prompt_len} tokens): "
                  f"{time.perf_counter() - t0:.0f} s, {bad} failed", flush=True)  # fmt: skip
    return out


def run_query_agnostic(server: ManagedServer, samples: list[Sample], args: argparse.Namespace) -> list[Outcome]:
    """Each prompt's context compressed before its question is read, as kvpress's query-agnostic
    runs do: the server reads prompts in chunks of C (`--query-agnostic C`) and compresses between
    chunks only (no pass after the last one). Per sample and configuration, one at a time: the
    radix cache is emptied, a first request caches the context but its last C tokens, and the
    request itself then reads those C tokens as one chunk, is compressed once (its whole context,
    with nothing of the question read), reads its question on the compressed cache and answers."""
    out: list[Outcome] = []
    chunk = args.query_agnostic
    todo = combos(args.policies, args.budgets)
    failed_before = set()
    if args.retry_failed and args.merge:
        failed_before = {(o["sample"], o["config"]) for o in json.loads(args.merge.read_text())["outcomes"]
                         if o["text"] is None}
    for i, s in enumerate(samples):
        t0 = time.perf_counter()
        q = context_len(s)
        for name, kvc in todo:
            if args.retry_failed and (s.id, name) not in failed_before:
                continue  # the merged run's outcome stands
            if q <= chunk or not server.flush():
                out.append(Outcome(s.id, name, None, f"context of {q} tokens not above the chunk {chunk}"
                                   if q <= chunk else "the radix cache could not be emptied"))
                continue
            head = Sample(f"{s.id}-head", s.task, s.prompt_ids[: q - chunk], max_tokens=1)
            warm = server.complete(head, "warm", {"budget": UNCOMPRESSED}, args.request_timeout)
            o = server.complete(s, name, for_sample(kvc, s), args.request_timeout)
            out.append(o if warm.error is None else Outcome(s.id, name, None, f"warm-up: {warm.error}"))
        bad = sum(o.text is None for o in out if o.sample == s.id)
        print(f"[quality] {i + 1}/{len(samples)} {s.id} ({s.prompt_len} tokens, context {q}): "
              f"{time.perf_counter() - t0:.0f} s, {bad} failed", flush=True)  # fmt: skip
    return out


def run_timing(server: ManagedServer, tok: Any, args: argparse.Namespace) -> list[TimingResult]:
    """Compression seconds per pass: one request per policy and prompt length, nothing else
    running, `/v1/kvc/stats` read before and after. The prompt is cached first, so the request
    costs its last `--kv-window` tokens, one compression and one decode step."""
    import random

    results = []
    for length in args.timing_lengths:
        rng = random.Random(f"timing-{length}")
        words: list[int] = []
        while len(words) < length:
            words += tok.encode(" " + sentence(rng), add_special_tokens=False)
        # Two tokens: a request that ends at its prefill is not compressed.
        s = Sample(f"timing-{length}", "timing", words[:length], max_tokens=2)
        warm = server.complete(s, "uncompressed", {"budget": UNCOMPRESSED}, args.request_timeout)
        for policy in args.policies:
            before = server.stats()
            o = server.complete(s, policy, {**policy_settings(policy), "budget": args.timing_budget},
                                args.request_timeout)  # fmt: skip
            after = server.stats()
            err = warm.error or o.error or (None if before and after else "no stats")
            passes = (after["compression"]["passes"] - before["compression"]["passes"]) if not err else 0
            secs = (after["compression"]["seconds"] - before["compression"]["seconds"]) if not err else 0.0
            recon = None
            if not err and "reconstruction" in after["compression"]:
                recon = after["compression"]["reconstruction"]["seconds"] - before["compression"]["reconstruction"]["seconds"]
            results.append(TimingResult(
                policy, length, args.timing_budget, secs / passes if passes else None, passes, err,
                reconstruction_seconds=recon or None, prefill_seconds=warm.seconds if recon else None,
            ))  # fmt: skip
            print(f"[quality] timing {policy} @ {length}: {results[-1]}", flush=True)
    return results


def run_kvpress(samples: list[Sample], args: argparse.Namespace, workdir: Path) -> dict | None:
    """The kvpress runner in its own venv; None (and a note) when the venv is absent or fails."""
    py = Path(args.kvpress_python)
    if not py.exists():
        print(f"[quality] kvpress venv not found ({py}); kvpress rows omitted", flush=True)
        return None
    inp, outp = workdir / "kvpress_in.json", workdir / "kvpress_out.json"
    retrieval = [s for s in samples if s.task in RETRIEVAL]
    if not retrieval:
        return None
    inp.write_text(json.dumps({
        "model": str(args.model_dir), "dtype": args.dtype, "budgets": args.budgets, "presses": args.kvpress_presses,
        "samples": [s.to_json() for s in retrieval], "query_agnostic": args.kvpress_query_agnostic,
    }))  # fmt: skip
    cmd = [str(py), str(REPO / "research" / "kvpress_runner.py"), str(inp), str(outp)]
    print(f"[quality] kvpress: {' '.join(cmd)}", flush=True)
    try:
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        subprocess.run(cmd, check=True, timeout=args.kvpress_timeout, env=env)
        return json.loads(outp.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as e:
        print(f"[quality] kvpress run failed: {e}", flush=True)
        return {"error": str(e)[:500]}


# --- scores -------------------------------------------------------------------------------------


def score_retrieval(
    task: str, config: str, samples: list[Sample], texts: dict[str, str | None],
    reference: dict[str, str | None],
) -> RetrievalScore:
    mine = [s for s in samples if s.task == task]
    ok_ref = {s.id for s in mine if reference.get(s.id) is not None and is_correct(s, reference[s.id])}
    correct = {s.id for s in mine if texts.get(s.id) is not None and is_correct(s, texts[s.id])}
    by_length: dict[str, float | None] = {}
    for length in sorted({s.meta["length"] for s in mine}):
        ref_l = {s.id for s in mine if s.meta["length"] == length} & ok_ref
        by_length[str(length)] = len(ref_l & correct) / len(ref_l) if ref_l else None
    by_style = {}
    for style in dict.fromkeys(s.meta.get("style", "templated") for s in mine):
        ref_s = {s.id for s in mine if s.meta.get("style", "templated") == style} & ok_ref
        by_style[style] = [len(ref_s & correct), len(ref_s)]
    return RetrievalScore(
        task=task, config=config, samples=len(mine),
        failures=sum(texts.get(s.id) is None for s in mine), correct=len(correct),
        reference_correct=len(ok_ref), kept=len(ok_ref & correct),
        relative=len(ok_ref & correct) / len(ok_ref) if ok_ref else None, by_length=by_length,
        by_style=by_style,
    )  # fmt: skip


def kept_summaries(samples: list[Sample], outcomes: list[Outcome], trace: Path, tok: Any) -> list[KeptSummary]:
    """Per compressing configuration, what its retrieval requests' prompt compactions kept."""
    events = prompt_compactions(trace)
    by_id = {s.id: s for s in samples if s.task in RETRIEVAL}
    answers = {s.id: answer_positions(s.prompt_ids, tok.encode(s.answer, add_special_tokens=False))
               for s in by_id.values()}  # fmt: skip
    rows: dict[str, list[tuple[Sample, Any]]] = {}
    for o in outcomes:
        s = by_id.get(o.sample)
        if s is None or o.text is None or o.config in ("full", "uncompressed") or o.config.startswith("kvpress"):
            continue
        rows.setdefault(o.config, []).append((s, evidence(events.get(str(o.rid)), s.prompt_len, answers[s.id])))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    out = []
    for config, pairs in rows.items():
        kept = [(s, e.answer_kept) for s, e in pairs if e.answer_kept is not None]
        styles = dict.fromkeys(s.meta.get("style", "templated") for s, _ in pairs)
        out.append(KeptSummary(
            config=config, requests=len(pairs), compacted=sum(e.landed for _, e in pairs),
            answer_kept=mean([k for _, k in kept]),
            early_share=mean([e.early_share for _, e in pairs if e.early_share is not None]),
            answer_kept_by_style={st: mean([k for s, k in kept if s.meta.get("style", "templated") == st])
                                  for st in styles},
        ))  # fmt: skip
    return out


# --- report -------------------------------------------------------------------------------------


def _cell(x: float | None, pct: bool = True) -> str:
    if x is None or math.isnan(x):
        return "–"
    return f"{100 * x:.0f}%" if pct else f"{x:.2f}"


def markdown(data: dict) -> str:
    budgets = data["setup"]["budgets"]
    rows_by = {(r["task"], r["config"]): r for r in data["retrieval"]}
    names = [p for p in data["setup"]["policies"]] + [
        f"kvpress:{p}" for p in (data.get("kvpress") or {}).get("presses", [])
    ]
    tasks = [t for t in RETRIEVAL if any(r["task"] == t for r in data["retrieval"])] or list(RETRIEVAL[:2])
    ref = {t: rows_by.get((t, "full")) for t in tasks}
    out = []
    head = " | ".join(f"{TASK_TITLES[t]} @{b}" for t in tasks for b in budgets)
    out.append(
        "Retrieval: share of the full cache's correct answers kept (full cache: "
        + ", ".join(f"{TASK_TITLES[t]} {_ref_txt(ref[t])}" for t in tasks) + ").\n"
    )
    out.append(f"| policy | {head} |")
    out.append("| --- |" + " ---: |" * (len(tasks) * len(budgets)))
    for name in ["uncompressed", *names]:
        cells = []
        for task in tasks:
            for b in budgets:
                key = name if name == "uncompressed" else f"{name}@{b}"
                r = rows_by.get((task, key))
                cells.append(_cell(r["relative"]) if r else "–")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out += _by_style(data, names, rows_by)
    out += _kept_table(data)
    if data["timing"]:
        lengths = sorted({t["prompt_tokens"] for t in data["timing"]})
        tb = {(t["policy"], t["prompt_tokens"]): t for t in data["timing"]}
        out.append(
            f"\nCompression seconds per pass (one request, prompt of N tokens compressed to "
            f"{data['setup']['timing_budget']}):\n"
        )
        out.append("| policy | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
        out.append("| --- |" + " ---: |" * len(lengths))
        for p in data["setup"]["policies"]:
            cells = []
            for n in lengths:
                t = tb.get((p, n))
                cells.append(f"{t['seconds_per_pass']:.2f}" if t and t["seconds_per_pass"] is not None
                             else "failed" if t else "–")  # fmt: skip
            out.append(f"| {p} | " + " | ".join(cells) + " |")
        recon = [t for t in data["timing"] if t.get("reconstruction_seconds")]
        if recon:
            out.append("\nReconstruction passes against the prefill they score (seconds of the pass; of the "
                       "prompt's uncompressed prefill, the first request that read it; their ratio):\n")
            out.append("| policy | prompt tokens | reconstruction s | prefill s | ratio |")
            out.append("| --- | ---: | ---: | ---: | ---: |")
            for t in recon:
                out.append(f"| {t['policy']} | {t['prompt_tokens']} | {t['reconstruction_seconds']:.2f} | "
                           f"{t['prefill_seconds']:.2f} | {t['reconstruction_seconds'] / t['prefill_seconds']:.2f}x |")
    fails = data.get("failures", 0)
    out.append(f"\nFailed requests: {fails}. {data.get('kvpress_note', '')}".rstrip())
    return "\n".join(out) + "\n"


def _by_style(data: dict, names: list[str], rows_by: dict) -> list[str]:
    """Pass key and multi-key together, per filler style: kept / the full cache's correct answers
    (kvpress rows against kvpress's own full cache)."""
    styles = data["setup"].get("styles", ["templated"])
    if len(styles) < 2:
        return []
    budgets = data["setup"]["budgets"]

    def counts(config: str, style: str) -> tuple[int, int]:
        rows = [rows_by.get((t, config)) for t in RETRIEVAL]
        pairs = [r.get("by_style", {}).get(style, [0, 0]) for r in rows if r]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    per_style = {st: sum(1 for x in data["setup"]["samples"] if x.get("style", "templated") == st
                         and x["task"] in RETRIEVAL) for st in styles}  # fmt: skip
    ref = ", ".join(f"{st} {counts('full', st)[0]}/{per_style[st]}" for st in styles)
    out = [f"\nBy filler style (pass key and multi-key together): answers kept / the full cache's "
           f"correct answers (full cache correct: {ref}).\n",
           "| policy | " + " | ".join(f"{st} @{b}" for b in budgets for st in styles) + " |",
           "| --- |" + " ---: |" * (len(budgets) * len(styles))]  # fmt: skip
    for name in ["uncompressed", *names]:
        cells = []
        for b in budgets:
            for st in styles:
                kept, ref_n = counts(name if name == "uncompressed" else f"{name}@{b}", st)
                cells.append(f"{kept}/{ref_n}" if ref_n else "–")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _kept_table(data: dict) -> list[str]:
    """What the prompt compactions kept, per policy and budget (from the compaction trace)."""
    kept = {k["config"]: k for k in data.get("kept", [])}
    if not kept:
        return []
    styles = data["setup"].get("styles", ["templated"])
    out = ["\nWhat the prompt compactions kept (compaction trace): requests compacted before they "
           "answered; the share of the answer's tokens (the key or code, every occurrence) an average "
           "(layer, KV head) kept, overall and per style; the share of kept entries in the first "
           "quarter of the prompt.\n",
           "| config | compacted | answer tokens kept | " + " | ".join(styles) + " | in first quarter |",
           "| --- | ---: | ---: |" + " ---: |" * len(styles) + " ---: |"]  # fmt: skip
    for name in data["setup"]["policies"]:
        for b in data["setup"]["budgets"]:
            k = kept.get(f"{name}@{b}")
            if k is None:
                continue
            per = " | ".join(_cell(k["answer_kept_by_style"].get(st)) for st in styles)
            out.append(f"| {name}@{b} | {k['compacted']}/{k['requests']} | {_cell(k['answer_kept'])} | {per} | "
                       f"{_cell(k['early_share'])} |")
    return out


def _ref_txt(r: dict | None) -> str:
    return f"{r['kept']}/{r['samples']} correct" if r else "not run"


MARKERS = "os^DvP*X<>ph"


def retrieval_series(data: dict) -> dict[str, list[float]]:
    """Per policy (then kvpress press), the share of the full cache's correct answers it keeps at
    each budget, pass key and multi-key pooled (NaN where nothing was measured); a row with
    nothing measured at any budget is left out."""
    budgets = data["setup"]["budgets"]
    rows = {(r["task"], r["config"]): r for r in data["retrieval"]}
    presses = (data.get("kvpress") or {}).get("presses", [])
    series = {}
    for name in [*data["setup"]["policies"], *(f"kvpress:{p}" for p in presses)]:
        ys = []
        for b in budgets:
            kept = sum((rows.get((t, f"{name}@{b}")) or {}).get("kept", 0) for t in RETRIEVAL)
            ref = sum((rows.get((t, f"{name}@{b}")) or {}).get("reference_correct", 0) for t in RETRIEVAL)
            ys.append(kept / ref if ref else float("nan"))
        if any(not math.isnan(y) for y in ys):
            series[name] = ys
    return series


def coinciding(series: dict[str, list[float]]) -> dict[str, tuple[str, int]]:
    """Lines that would hide one another: for each series equal to an earlier one at every
    budget, that earlier series' name and its place among the copies (1, 2, ...)."""
    def key(ys: list[float]) -> tuple:
        return tuple("nan" if math.isnan(y) else round(y, 9) for y in ys)

    first: dict[tuple, str] = {}
    seen: dict[tuple, int] = {}
    out = {}
    for name, ys in series.items():
        k = key(ys)
        if k in first:
            seen[k] += 1
            out[name] = (first[k], seen[k])
        else:
            first[k], seen[k] = name, 0
    return out


def plot(data: dict, path: Path) -> bool:
    """Draws the panels that have data into `path`; with none (no retrieval task was run), writes
    no figure and removes an older one at `path`. Lines that coincide get distinct markers, are
    shifted sideways a little and say so in the legend."""
    series = retrieval_series(data)
    panels = [("retrieval (pass key + multi-key): share of full-cache answers kept", series)] if series else []
    if not panels:
        path.unlink(missing_ok=True)
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = data["setup"]["budgets"]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        same = coinciding(lines)
        for i, (name, ys) in enumerate(lines.items()):
            label, xs, hollow = name, budgets, False
            if name in same:  # drawn beside the line it equals, hollow, named in the legend
                of, place = same[name]
                label, xs, hollow = f"{name} (= {of}, shifted right)", [b * 2 ** (0.03 * place) for b in budgets], True
            ax.plot(xs, ys, "--" if name.startswith("kvpress") else "-", marker=MARKERS[i % len(MARKERS)],
                    markersize=7, markerfacecolor="none" if hollow else None, label=label)  # fmt: skip
        ax.set_title(title, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['setup']['model']}; {data['setup']['machine']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- main ---------------------------------------------------------------------------------------


def parse_lengths(text: str) -> dict[int, int]:
    """'1024:3,2048:3,4096:1' -> {1024: 3, 2048: 3, 4096: 1} (prompt tokens: samples per depth)."""
    out = {}
    for part in text.split(","):
        length, _, n = part.partition(":")
        out[int(length)] = int(n or 1)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=POLICIES,
                   help="policy rows; NAME selects per head (default), NAME/shared one set per request, "
                        "PROMPT>NAME compresses prompts with PROMPT (rkv>rkv: R-KV's own prompt selection)")
    p.add_argument("--budgets", nargs="+", type=parse_budget, default=BUDGETS,
                   help="entries per (layer, KV head), or below 1 a fraction of each prompt's context (the "
                        "prompt up to its question), as kvpress's compression ratios")
    p.add_argument("--passkey", type=parse_lengths, default=parse_lengths("1024:2,2048:1,4096:1"),
                   help="prompt length:samples per depth, comma separated")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9])
    p.add_argument("--styles", nargs="+", choices=STYLES, default=list(STYLES),
                   help="filler styles of the retrieval prompts (benchmarks/quality_fillers.py)")
    p.add_argument("--multikey", type=int, default=3, help="multi-key samples")
    p.add_argument("--multikey-len", type=int, default=1536)
    p.add_argument("--multikey-facts", type=int, default=5)
    p.add_argument("--multidoc", type=int, default=0,
                   help="documents whose facts are asked one at a time (task multidoc: one sample per fact)")
    p.add_argument("--multidoc-len", type=int, default=2048)
    p.add_argument("--multidoc-facts", type=int, default=4)
    p.add_argument("--timing-lengths", nargs="*", type=int, default=[1024, 4096, 8000],
                   help="prompt tokens for compression timing (8000: the 8192 context less room)")
    p.add_argument("--timing-budget", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=12, help="retrieval requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="both servers' model dtype (float32: greedy answers far from rounding ties, "
                        "and several times faster than bfloat16 on a CPU without native bfloat16)")
    p.add_argument("--kv-buffer", type=int, default=128)
    p.add_argument("--kv-head-budget", choices=list(BUDGET_MODES), default="uniform",
                   help="the compressing server's per-head budgets; rows of variable / layer runs are named NAME/MODE")
    p.add_argument("--request-timeout", type=float, default=900)
    p.add_argument("--server-timeout", type=float, default=600)
    p.add_argument("--kvpress-python", default=os.environ.get("KVPRESS_PYTHON", str(DEFAULT_KVPRESS_PYTHON)))
    p.add_argument("--kvpress-presses", nargs="+", default=["snapkv", "streamingllm", "tova"])
    p.add_argument("--kvpress-timeout", type=float, default=1800)
    p.add_argument("--no-kvpress", action="store_true")
    p.add_argument("--reuse-full", action="store_true",
                   help="keep the full cache's answers from --merge instead of running its server again "
                        "(greedy: the same prompts give the same answers)")
    p.add_argument("--no-uncompressed", action="store_true",
                   help="skip the uncompressed request per prompt (with --merge: its row is the merged run's)")
    p.add_argument("--only-kvpress", action="store_true",
                   help="run kvpress alone, keeping every other row (the full cache's too) from --merge")
    p.add_argument("--kvpress-query-agnostic", action="store_true",
                   help="kvpress compresses each prompt's context without its question, then reads the question "
                        "(kvpress's own benchmark setting; research/kvpress_runner.py)")
    p.add_argument("--query-agnostic", type=int, default=0, metavar="C",
                   help="sgl-kvc's rows compress each prompt's context before its question is read (kvpress's "
                        "query-agnostic setting): the context is read in chunks of C tokens, its last chunk "
                        "alone after a warm-up request cached the rest, and compressed once, between it and the "
                        "question (`run_query_agnostic`); 0: compressed as the server's moments do")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --merge and --query-agnostic: run only the sample x configuration pairs that "
                        "failed in the merged run (the others keep its outcomes)")
    p.add_argument("--tasks", nargs="+", default=list(RETRIEVAL),
                   help="tasks to run (the others' samples are still built, for --merge)")
    p.add_argument("--merge", type=Path, default=None,
                   help="a previous quality.json: keep its outcomes (and timing) for what is not run now")
    p.add_argument("--quick", action="store_true", help="a handful of samples (checks the set-up)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default="", help="result files are quality-<tag>.* (default quality.*)")
    p.add_argument("--server-args", default="",
                   help="extra flags for the compressing server, e.g. \"--disable-radix-cache "
                        "--chunked-prefill-size 512\" (without the radix cache no request reuses the "
                        "uncompressed one's prefill, so a long prompt is compressed between its chunks)")
    return p  # fmt: skip


def run_servers(
    args: argparse.Namespace, samples: list[Sample], tok: Any, logs: Path, common: list[str], phases: dict[str, float],
    servers: dict[str, Any],
) -> tuple[list[Outcome], list[TimingResult], list[KeptSummary]]:
    """The full cache's server, then the compressing one: every outcome, the pass timings and what
    the compactions kept; `servers` gets each server's flags and start count."""
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    if not args.reuse_full:  # else the merged run's full-cache answers
        ref_server = ManagedServer("full", ["--policy", "none", *common], logs, args.server_timeout)
        try:
            outcomes = run_reference(ref_server, samples, args)
        finally:
            ref_server.close()
        phases["full cache"] = time.perf_counter() - t0
        servers["full"] = (ref_server.flags, ref_server.starts)

    t0 = time.perf_counter()
    # Every pass in the step it is due (no staging over later steps): a short answer must be
    # generated from the compressed cache, not from the full one while a pass is under way.
    comp_flags = ["--policy", "rkv", "--kv-buffer", str(args.kv_buffer), "--kv-pass-work", "0",
                  "--kv-head-budget", args.kv_head_budget, *common, *shlex.split(args.server_args)]
    if args.query_agnostic:  # compressed between chunks only: once, right before the question's chunk
        comp_flags += ["--chunked-prefill-size", str(args.query_agnostic), "--compress-on", "chunk-always,decode,preempt"]
    if args.kv_head_budget != "uniform":
        args.policies = [p if p.endswith("/shared") else f"{p}/{args.kv_head_budget}" for p in args.policies]
    trace = logs / "trace.jsonl"
    comp_server = ManagedServer("compressing", comp_flags, logs, args.server_timeout,
                                env={"SGLKVC_TRACE": str(trace)})
    try:
        run = run_query_agnostic if args.query_agnostic else run_compressed
        outcomes += run(comp_server, samples, args)
        phases["compressing"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        timing = run_timing(comp_server, tok, args) if args.timing_lengths else []
        phases["timing"] = time.perf_counter() - t0
    finally:
        comp_server.close()
    servers["compressing"] = (comp_flags, comp_server.starts)
    return outcomes, timing, kept_summaries(samples, outcomes, trace, tok)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.only_kvpress and (args.merge is None or args.no_kvpress):
        raise SystemExit("--only-kvpress needs --merge (the run whose other rows it keeps) and kvpress")
    if args.reuse_full and args.merge is None:
        raise SystemExit("--reuse-full needs --merge (the run whose full-cache answers it keeps)")
    meta = run_metadata("benchmarks.quality", argv)  # before the run writes anything
    print(metadata_markdown(meta), flush=True)
    if args.quick:
        args.passkey, args.multikey = {1024: 1}, 1
        args.depths, args.timing_lengths, args.styles = [0.5], [1024], args.styles[:1]
    from transformers import AutoTokenizer

    from sgl_kvc.model import SMOLLM2_MODEL_NAME, ensure_smollm2

    t_start = time.perf_counter()
    args.model_dir = ensure_smollm2()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    samples = [
        *(s for style in args.styles for s in passkey_samples(tok, args.passkey, args.depths, args.seed, style)),
        *(s for style in args.styles
          for s in multikey_samples(tok, args.multikey, args.multikey_len, args.multikey_facts, args.seed, style)),
        *(s for style in args.styles
          for s in document_samples(tok, args.multidoc, args.multidoc_len, args.multidoc_facts, args.seed, style)),
    ]  # fmt: skip
    all_samples, samples = samples, [s for s in samples if s.task in args.tasks]
    print(f"[quality] {len(samples)} samples; {len(args.policies)} policies x {len(args.budgets)} "
          f"budgets", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="quality-logs-"))
    common = ["--max-total-tokens", str(args.max_total_tokens), "--dtype", args.dtype]
    phases: dict[str, float] = {}

    servers: dict[str, Any] = {}  # name -> (flags, starts) of the servers run now
    if args.only_kvpress:
        # The sgl-kvc rows (and the full cache) are the merged run's; only kvpress runs now.
        outcomes, timing, kept = [], [], []
    else:
        outcomes, timing, kept = run_servers(args, samples, tok, logs, common, phases, servers)

    kvpress, t0 = None, time.perf_counter()
    if not args.no_kvpress:
        kvpress = run_kvpress(samples, args, logs)
    phases["kvpress"] = time.perf_counter() - t0
    if kvpress and "results" in kvpress:
        outcomes += [Outcome(**o) for o in kvpress["results"]]
    prev = json.loads(args.merge.read_text()) if args.merge else None
    if prev:
        run_now = {(o.sample, o.config) for o in outcomes}
        outcomes += [Outcome(**o) for o in prev["outcomes"]
                     if (o["sample"], o["config"]) not in run_now]  # fmt: skip
        timing = timing or [TimingResult(**t) for t in prev["timing"]]
        if kvpress and "results" in kvpress and prev.get("kvpress"):
            # As with the policies, the report lists the presses of either run.
            kvpress["presses"] = list(dict.fromkeys([*prev["kvpress"].get("presses", []), *kvpress["presses"]]))
            kvpress["press_params"] = {**prev["kvpress"].get("press_params", {}), **kvpress.get("press_params", {})}
        kvpress = kvpress or ({**prev["kvpress"], "results": []} if prev.get("kvpress") else None)
        kept += [KeptSummary(**k) for k in prev.get("kept", []) if k["config"] not in {x.config for x in kept}]
        phases = {**{f"{k} (merged run)": v for k, v in prev["setup"]["phase_seconds"].items()}, **phases}
        # The report lists every policy and budget of either run (a merge may rerun only some); a
        # kvpress-only run ran no policy of its own.
        ran = [] if args.only_kvpress else args.policies
        args.policies = list(dict.fromkeys([*prev["setup"]["policies"], *ran]))
        args.budgets = sorted(set(prev["setup"]["budgets"]) | set(args.budgets))
    samples = all_samples

    texts: dict[str, dict[str, str | None]] = {}
    for o in outcomes:
        texts.setdefault(o.config, {})[o.sample] = o.text
    kv_ref = texts.get("kvpress:full", {})
    retrieval = []
    for config, by_sample in texts.items():
        # kvpress rows against kvpress's own full cache (same model under transformers).
        ref = kv_ref if config.startswith("kvpress") else texts["full"]
        for task in RETRIEVAL:
            if any(s.task == task and s.id in by_sample for s in samples):
                retrieval.append(score_retrieval(task, config, samples, by_sample, ref))
    note = ("kvpress: not run (--no-kvpress, or no venv at --kvpress-python)." if kvpress is None else
            f"kvpress: failed ({kvpress['error']})." if "error" in kvpress else
            f"kvpress {kvpress.get('version')} rows: its presses on the same token ids, scored against "
            "its own full-cache run under transformers"
            + (" (query-agnostic: the context compressed without its question, which is read after)."
               if kvpress.get("query_agnostic") else "."))  # fmt: skip
    if prev:
        meta["merged_from"] = prev.get("meta", NOT_RECORDED)  # the run whose outcomes were kept
    data = {
        "meta": meta,
        "setup": {
            "model": SMOLLM2_MODEL_NAME, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
            "policies": args.policies, "budgets": args.budgets,
            "passkey": {str(k): v for k, v in args.passkey.items()}, "depths": args.depths,
            "styles": args.styles,
            "multikey": args.multikey, "multikey_len": args.multikey_len,
            "multikey_facts": args.multikey_facts,
            "multidoc": args.multidoc, "multidoc_len": args.multidoc_len, "multidoc_facts": args.multidoc_facts,
            "timing_budget": args.timing_budget, "seed": args.seed,
            # the servers run now; the others' as the merged run recorded them
            "servers": {**(prev["setup"].get("servers", {}) if prev else {}),
                        **{k: flags for k, (flags, _) in servers.items()}},
            "server_starts": {**(prev["setup"].get("server_starts", {}) if prev else {}),
                              **{k: starts for k, (_, starts) in servers.items()}},
            "samples": [{"id": s.id, "task": s.task, "prompt_tokens": s.prompt_len,
                         "answer": s.answer, **s.meta} for s in samples],
            "phase_seconds": phases,
            "total_seconds": time.perf_counter() - t_start + (prev["setup"]["total_seconds"] if prev else 0),
            "merged_from_previous_run": bool(prev), "tasks_run_last": args.tasks,
        },
        "retrieval": [asdict(r) for r in retrieval],
        "kept": [asdict(k) for k in kept],
        "timing": [asdict(t) for t in timing],
        "kvpress": {k: v for k, v in (kvpress or {}).items() if k != "results"} or None,
        "kvpress_note": note,
        "failures": sum(o.text is None for o in outcomes),
        "outcomes": [asdict(o) for o in outcomes],
    }  # fmt: skip
    write(data, args.out, "quality" + (f"-{args.tag}" if args.tag else ""))
    return data


def write(data: dict, out: Path, stem: str = "quality") -> None:
    table = markdown(data)
    s = data["setup"]
    title = (f"{metadata_markdown(data.get('meta', {}))}\n"
             f"{s['model']} on `python -m sgl_kvc.launch` (CPU), greedy; {s['machine']}; "
             f"{s['date']}; total {s['total_seconds'] / 60:.0f} min.\n\n")  # fmt: skip
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(title + table)
    plot(data, out / f"{stem}.png")
    print(title + table, flush=True)


if __name__ == "__main__":
    main()
