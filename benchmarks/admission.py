"""What admission does under loads that stress it: retractions, skipped compactions, refusals.

    python -m benchmarks.admission                     # every scenario, docs/safety.md has the results
    python -m benchmarks.admission --only prefill-only storm

Each scenario gets a fresh server (`python -m sgl_kvc.launch`, the demo model, `SGLKVC_CHECK=1`,
so a broken pool or tree stops it) and sends all its requests at once (`/v1/completions`, seeded
token-id prompts, `ignore_eos`, a fixed `max_tokens`). Recorded per scenario: requests served
whole (200 with every token asked), refused with a 4xx, and anything else (a 5xx, a cut answer,
a broken connection); SGLang's retractions, sgl-kvc's compression passes by moment, passes put off
(or failed between chunks) for lack of free slots (`skipped`), requests sgl-kvc failed, the most
requests in flight, whether the pool adds up once idle, and the wall time. Writes
`<out>/admission.json` and `<out>/admission.md`.

Scenarios (`SCENARIOS`):
- `prefill-only`, `default`: 32 requests of 60-token prompts and 400-token outputs in a
  4096-token pool, R-KV, with the prefill moment alone and with the default moments;
- `cold-burst`: 12 prompts of 2000 tokens (one chunk each) at once in a 4096-token pool: each
  pass after prefill copies what it keeps out of the tree's slots;
- `storm`, `storm-always`: 8 prompts of 3.7x the pool (chunks of 512) with 8 short requests, the
  default moments and `chunk-always`;
- `storm-crowd`: 4 prompts of 3.7x the pool with 48 short requests, admitted in the rounds that
  read the long prompts' chunks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from benchmarks.common import metadata_markdown, run_metadata
from loadtest.server import ServerProcess

VOCAB = 2000  # token ids below the demo model's vocabulary


@dataclass(frozen=True)
class Load:
    """`count` requests of `prompt` tokens writing `output` tokens each."""

    count: int
    prompt: int
    output: int


@dataclass(frozen=True)
class Scenario:
    name: str
    flags: tuple[str, ...]
    loads: tuple[Load, ...]


POOL = 4096
SCENARIOS: tuple[Scenario, ...] = (
    Scenario("prefill-only", ("--policy", "rkv", "--compress-on", "prefill"), (Load(32, 60, 400),)),
    Scenario("default", ("--policy", "rkv"), (Load(32, 60, 400),)),
    Scenario("cold-burst", ("--policy", "rkv"), (Load(12, 2000, 64),)),
    Scenario("storm", ("--policy", "rkv", "--chunked-prefill-size", "512"),
             (Load(8, int(3.7 * POOL), 16), Load(8, 60, 64))),
    Scenario("storm-always", ("--policy", "rkv", "--chunked-prefill-size", "512",
                              "--compress-on", "prefill,chunk-always,decode,preempt"),
             (Load(8, int(3.7 * POOL), 16), Load(8, 60, 64))),
    Scenario("storm-crowd", ("--policy", "rkv", "--chunked-prefill-size", "512"),
             (Load(4, int(3.7 * POOL), 16), Load(48, 60, 32))),
)


@dataclass
class Result:
    scenario: str
    flags: str
    load: str
    served: int
    refused: int
    other: int
    retractions: int
    passes: dict
    skipped: int
    failed_requests: int
    max_running: int
    pool_whole: bool
    seconds: float
    refusals: list


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def run(scenario: Scenario, log_dir: Path) -> Result:
    cmd = [sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--max-total-tokens", str(POOL),
           *scenario.flags]
    jobs = [(load, i) for load in scenario.loads for i in range(load.count)]
    with ServerProcess.launch(cmd, env={"SGLKVC_CHECK": "1"}, log_path=log_dir / f"{scenario.name}.log") as server:
        def one(job: tuple[Load, int]) -> tuple[str, str]:
            load, i = job
            try:
                r = server.post("/v1/completions", json={
                    "model": "m", "prompt": _prompt(load.prompt, 1000 * load.prompt + i),
                    "max_tokens": load.output, "ignore_eos": True, "temperature": 0.0,
                })
            except requests.RequestException as e:
                return "other", type(e).__name__
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == load.output:
                return "served", ""
            if 400 <= r.status_code < 500:
                return "refused", r.text[:200]
            return "other", f"{r.status_code} {r.text[:200]}"

        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            outcomes = list(pool.map(one, jobs))
        seconds = time.perf_counter() - t0
        stats = server.wait_idle()
    c, p = stats["compression"], stats["pool"]
    kinds = [k for k, _ in outcomes]
    return Result(
        scenario=scenario.name, flags=" ".join(scenario.flags),
        load=" + ".join(f"{l.count} x {l.prompt} -> {l.output}" for l in scenario.loads),
        served=kinds.count("served"), refused=kinds.count("refused"), other=kinds.count("other"),
        retractions=c["retractions"],
        passes={m: c[f"{m}_passes"] for m in ("prefill", "chunk", "decode", "preempt")},
        skipped=c["skipped"], failed_requests=c["failed_requests"], max_running=stats["requests"]["max_running"],
        pool_whole=p["free_tokens"] + p["cached_tokens"] == p["total_tokens"] and p["request_state_bytes"] == 0,
        seconds=round(seconds, 1), refusals=sorted({why for k, why in outcomes if k != "served"})[:3],
    )


def table(results: list[Result]) -> str:
    head = ("| scenario | load (requests x prompt -> output) | served | refused | other | retractions "
            "| passes (prefill / chunk / decode / preempt) | skipped | failed | max running | pool whole | s |")
    lines = [head, "| " + " | ".join(["---"] * 13) + " |"]
    for r in results:
        passes = " / ".join(str(r.passes[m]) for m in ("prefill", "chunk", "decode", "preempt"))
        lines.append(f"| `{r.scenario}` | {r.load} | {r.served} | {r.refused} | {r.other} | {r.retractions} | "
                     f"{passes} | {r.skipped} | {r.failed_requests} | {r.max_running} | {r.pool_whole} | {r.seconds} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=[s.name for s in SCENARIOS], help="these scenarios only")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default="", help="result files are admission-<tag>.* (default admission.*)")
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.admission", argv)  # before the run writes anything
    print(metadata_markdown(meta), flush=True)
    log_dir = Path(tempfile.mkdtemp(prefix="admission-"))
    print(f"server logs: {log_dir}", flush=True)
    results = []
    for scenario in SCENARIOS:
        if args.only and scenario.name not in args.only:
            continue
        results.append(run(scenario, log_dir))
        print(table(results[-1:]), flush=True)
    stem = "admission" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "pool": POOL, "results": [asdict(r) for r in results]}, indent=2))
    body = table(results)
    (args.out / f"{stem}.md").write_text(f"{metadata_markdown(meta)}\n## Admission under stress ({POOL}-token pool, "
                                         f"demo model, SGLKVC_CHECK=1)\n\n{body}")
    print(body)


if __name__ == "__main__":
    main()
