"""Side-by-side serving benchmark: plain SGLang (`--policy none`) against each eviction policy,
at one fixed KV pool size, in one run.

    python -m benchmarks.eviction                      # docs/benchmarks.md has the commands of the results
    python -m benchmarks.eviction --configs none rkv --requests 16 --output-len 256

Every configuration gets a fresh server (`python -m sgl_kvc.launch`, the demo model unless
`--server-args` names a `--model-path`), the same `--max-total-tokens`, the same seeded
prompts (random token ids of a fixed length), and all requests at once, streamed, with
`ignore_eos` and a fixed `max_tokens`.
Recorded per configuration: the peak number of requests running at once (from
`/v1/kvc/stats`), output tokens/s over the whole run, TTFT and TPOT percentiles, and the share
of the run the scheduler spent compressing. Writes `<out>/eviction.json`, `<out>/eviction.md`
and `<out>/eviction.png`. A configuration is `NAME` (a policy at `--kv-budget`),
`NAME=FLAGS` (any launcher flags, e.g. `rkv-fp8=--policy rkv --kv-cache-dtype fp8_e4m3`) or
`NAME=cluster:CLUSTER_FLAGS -- FLAGS` (a local cluster, `python -m sgl_kvc.cluster`: workers with
the same pool and FLAGS behind the SGLang Model Gateway, e.g.
`two=cluster:--workers 2 --router-policy cache_aware -- --policy rkv --kv-budget 128`; its
numbers are the sum over the workers).

Requests go to `/v1/completions` with token-id prompts, or with `--api generate` to SGLang's
`/generate` with `input_ids`: the gateway (smg 1.13) refuses token-id prompts on
`/v1/completions`, so a run with a cluster configuration uses `/generate` for every
configuration (one API per run, so that its rows compare) unless `--api` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from benchmarks.common import machine, metadata_markdown, run_metadata
from loadtest.server import ServerProcess, free_port, kvc_stats
from sgl_kvc.cluster import ClusterConfig, LocalCluster
from sgl_kvc.launcher.flags import has_flag

CLUSTER_PREFIX = "cluster:"

DEFAULT_CONFIGS = ["none", "rkv", "h2o", "snapkv", "streamingllm", "batchmax", "kvcompress"]


@dataclass
class RequestResult:
    ttft_s: float
    tpot_s: float
    output_tokens: int


@dataclass
class ConfigResult:
    name: str
    flags: list[str]
    requests: int
    failures: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    max_running: int
    ttft_s: dict[str, float] = field(default_factory=dict)
    tpot_ms: dict[str, float] = field(default_factory=dict)
    compression_passes: int = 0
    compression_share: float = 0.0
    compression_s_per_pass: float = 0.0
    compression_max_step_s: float = 0.0  # the longest compression work in one step: the worst stall
    retractions: int = 0
    total_tokens: int = 0
    max_row_slots: int = 0  # the most slots one compressing request held (before a compaction)
    pool_bytes: int = 0  # the KV pool's K and V buffers (scales included), from /v1/kvc/stats
    errors: list[str] = field(default_factory=list)  # the distinct reasons requests failed
    round: int = 0  # with --rounds: which round of the interleaved repeats


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": q[49] * scale, "p90": q[89] * scale, "p99": q[98] * scale}


async def sse_lines(response: httpx.Response):
    """The stream's lines, split at "\n" only. `aiter_lines` also splits at the Unicode line
    breaks JSON leaves unescaped (U+2028, U+0085, ...), which a generated token may contain:
    the random-weight demo model produced one and the benchmark counted a served request as
    failed (a truncated JSON line)."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buffer:
        yield buffer


async def raise_for_status(r: httpx.Response) -> None:
    """A refused request's status and the server's own message (an OpenAI-style error body)."""
    if r.status_code < 400:
        return
    body = (await r.aread()).decode(errors="replace")
    try:
        message = json.loads(body).get("error", {}).get("message", body)
    except (ValueError, AttributeError):
        message = body
    raise RuntimeError(f"HTTP {r.status_code}: {message}")


async def _timed_stream(
    client: httpx.AsyncClient, path: str, body: dict, count: Callable[[dict, int], tuple[int, bool]]
) -> RequestResult:
    """Stream one request and time it. `count(chunk, tokens)` reads a chunk of the stream: the
    generated-token count after it, and whether it carried new output."""
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", path, json=body) as r:
        await raise_for_status(r)
        async for line in sse_lines(r):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # a request refused after its stream began: SGLang's error event
                raise RuntimeError(f"stream error: {chunk['error'].get('message', chunk['error'])}")
            tokens, new = count(chunk, tokens)
            if new:
                last = time.perf_counter()
                first = first or last
    if first is None or tokens == 0:
        raise RuntimeError("no tokens streamed")
    return RequestResult(first - start, (last - first) / max(tokens - 1, 1), tokens)


def _completion_tokens(chunk: dict, tokens: int) -> tuple[int, bool]:
    """An OpenAI completion chunk: text is new output; the final usage chunk has the count."""
    if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
    return tokens, bool(chunk.get("choices") and chunk["choices"][0].get("text"))


def _generate_tokens(chunk: dict, tokens: int) -> tuple[int, bool]:
    """A `/generate` chunk carries the running count of generated tokens. A refused request
    is a chunk that finishes with an abort (and counts one token), not an error event."""
    meta = chunk.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RuntimeError(f"aborted: {finish.get('message', finish)}")
    done = meta.get("completion_tokens", 0)
    return (done, True) if done > tokens else (tokens, False)


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestResult:
    body = {
        "model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    return await _timed_stream(client, "/v1/completions", body, _completion_tokens)


async def one_generate(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> RequestResult:
    """The same request through SGLang's native `/generate` (token ids, streamed)."""
    body = {
        "input_ids": prompt, "stream": True,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
    }
    return await _timed_stream(client, "/generate", body, _generate_tokens)


REQUESTS = {"completions": one_request, "generate": one_generate}


async def drive(
    url: str, prompts: list[list[int]], output_len: int, api: str = "completions"
) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    send = REQUESTS[api]
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(send(client, p, output_len) for p in prompts), return_exceptions=True
        )
        return results, time.perf_counter() - t0


def server_flags(flags: list[str], args: argparse.Namespace) -> list[str]:
    """Every server's flags: the run's pool and model, then the configuration's own."""
    # Every model in its own dtype on every CPU unless a flag says otherwise (the launcher would
    # serve it in float32 on one without native bfloat16): a pool of so many GB then holds the
    # same tokens everywhere, and a run compares with the results taken before that default.
    given = [*flags, *args.server_args]
    model = [] if has_flag(given, "--model-path") else ["--model-path", "demo"]
    dtype = [] if has_flag(given, "--dtype") else ["--dtype", "auto"]
    # A pool sized in bytes (`--kv-cache-memory-gb`: FP8 then holds more tokens) takes no token cap.
    pool = [] if has_flag(given, "--kv-cache-memory-gb") else ["--max-total-tokens", str(args.max_total_tokens)]
    return [*pool, *model, *dtype, *flags, *args.server_args]


def run_config(name: str, flags: list[str], args: argparse.Namespace, log: Path) -> ConfigResult:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(args.input_len)] for _ in range(args.requests)]
    cluster = cluster_of(flags)
    if cluster is not None:
        cluster = replace(
            cluster, server_flags=tuple(server_flags(list(cluster.server_flags), args)),
            port=free_port(), log_dir=log.with_suffix(""),  # a folder: one log per process
        )  # fmt: skip
        with LocalCluster.start(cluster) as running:
            results, wall = asyncio.run(drive(running.url, prompts, args.output_len, args.api))
            stats = kvc_stats(running.url)
    else:
        cmd = [sys.executable, "-m", "sgl_kvc.launch", *server_flags(flags, args)]
        with ServerProcess.launch(cmd, log_path=log) as server:
            results, wall = asyncio.run(drive(server.url, prompts, args.output_len, args.api))
            stats = server.stats()
    if stats is None:
        raise RuntimeError(f"{name}: no /v1/kvc/stats answer")
    ok = [r for r in results if isinstance(r, RequestResult)]
    tokens = sum(r.output_tokens for r in ok)
    comp = stats["compression"]
    return ConfigResult(
        name=name, flags=flags, requests=len(prompts), failures=len(prompts) - len(ok),
        wall_s=wall, output_tokens=tokens, output_tokens_per_s=tokens / wall,
        max_running=stats["requests"]["max_running"],
        ttft_s=percentiles([r.ttft_s for r in ok]),
        tpot_ms=percentiles([r.tpot_s for r in ok], scale=1000.0),
        compression_passes=comp["passes"], compression_share=comp["seconds"] / wall,
        compression_s_per_pass=comp["seconds"] / max(comp["passes"], 1),
        compression_max_step_s=comp.get("max_step_seconds", 0.0),
        retractions=comp.get("retractions", 0), total_tokens=stats["pool"]["total_tokens"],
        max_row_slots=comp.get("max_row_slots", 0), pool_bytes=stats["pool"].get("bytes", 0),
        errors=sorted({str(r)[:300] for r in results if not isinstance(r, RequestResult)})[:3],
    )


def by_config(results: list[ConfigResult]) -> dict[str, list[ConfigResult]]:
    """Results grouped by configuration, in first-seen order (one per round)."""
    groups: dict[str, list[ConfigResult]] = {}
    for r in results:
        groups.setdefault(r.name, []).append(r)
    return groups


def ratios(results: list[ConfigResult]) -> dict[str, list[float]]:
    """Per configuration: its output tok/s over the baseline's (`none`, else the first) of the
    same round, one ratio per round, so each ratio compares runs made minutes apart."""
    groups = by_config(results)
    base_name = "none" if "none" in groups else next(iter(groups))
    base = {r.round: r.output_tokens_per_s for r in groups[base_name]}
    return {
        name: [r.output_tokens_per_s / base[r.round] for r in rs if base.get(r.round)]
        for name, rs in groups.items()
    }


def representative(rs: list[ConfigResult]) -> ConfigResult:
    """The round with the median output tok/s (the lower middle one for an even count)."""
    ordered = sorted(rs, key=lambda r: r.output_tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def markdown(results: list[ConfigResult]) -> str:
    groups = by_config(results)
    per_round = ratios(results)
    rounds = max(len(rs) for rs in groups.values())
    shown = {name: representative(rs) for name, rs in groups.items()}
    base = shown.get("none", next(iter(shown.values())))
    vs = "vs none" if rounds == 1 else f"vs none, median (min-max) of {rounds} rounds"
    rows = [
        f"| config | max running | output tok/s | {vs} | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
        "| compressing | passes | s/pass mean / max step | held at most | failures |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in shown.items():
        rs = per_round[name]
        ratio = f"{statistics.median(rs):.2f}x" if rs else "-"
        if len(rs) > 1:
            ratio += f" ({min(rs):.2f}-{max(rs):.2f})"
        rows.append(
            f"| {name} | {r.max_running} ({r.max_running / max(base.max_running, 1):.1f}x) "
            f"| {r.output_tokens_per_s:.0f} | {ratio} "
            f"| {r.ttft_s.get('p50', 0):.2f} / {r.ttft_s.get('p99', 0):.2f} "
            f"| {r.tpot_ms.get('p50', 0):.1f} / {r.tpot_ms.get('p99', 0):.1f} "
            f"| {100 * r.compression_share:.1f}% | {r.compression_passes} "
            f"| {r.compression_s_per_pass:.3f} / {r.compression_max_step_s:.3f} "
            f"| {r.max_row_slots or '-'} | {sum(x.failures for x in groups[name])} |"
        )
    reasons = [f"- {name}: {e}" for name, rs in groups.items()
               for e in sorted({e for r in rs for e in r.errors})]  # fmt: skip
    if reasons:
        rows += ["", "Why requests failed:", "", *reasons]
    return "\n".join(rows) + "\n"


def plot(results: list[ConfigResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [representative(rs) for rs in by_config(results).values()]  # median round
    names = [r.name for r in shown]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [
        ("max running requests", [r.max_running for r in shown]),
        ("output tokens/s (median round)", [r.output_tokens_per_s for r in shown]),
        ("TPOT p50 (ms)", [r.tpot_ms.get("p50", 0) for r in shown]),
    ]
    for ax, (label, values) in zip(axes, panels):
        ax.bar(names, values, color=["#888"] + ["#2a7"] * (len(names) - 1))
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_config(text: str, budget: int) -> tuple[str, list[str]]:
    if "=" in text:
        name, flags = text.split("=", 1)
        if flags.lstrip().startswith(CLUSTER_PREFIX):  # kept as one marked list: cluster_of()
            return name, [CLUSTER_PREFIX, *shlex.split(flags.lstrip()[len(CLUSTER_PREFIX):])]
        return name, shlex.split(flags)
    return text, ["--policy", text] + ([] if text == "none" else ["--kv-budget", str(budget)])


def cluster_of(flags: list[str]) -> ClusterConfig | None:
    """The cluster a configuration's flags describe, or None for a single server."""
    if not flags or flags[0] != CLUSTER_PREFIX:
        return None
    return ClusterConfig.from_argv(flags[1:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--kv-budget", type=int, default=128)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--tag", default="", help="result files are eviction-<tag>.* (default eviction.*)")
    p.add_argument(
        "--api", choices=("auto", *REQUESTS), default="auto",
        help="completions: /v1/completions with token ids; generate: SGLang's /generate; auto: "
        "generate where a cluster configuration is in the run (the gateway refuses token-id "
        "prompts on /v1/completions), else completions",
    )
    p.add_argument(
        "--rounds", type=int, default=1,
        help="run every configuration this many times, interleaved (round 1 of all, then round 2, "
        "...); each ratio is taken within its round, the table shows the median and the range",
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    meta = run_metadata("benchmarks.eviction", argv)  # before the run writes anything
    print(metadata_markdown(meta), flush=True)
    args.server_args = shlex.split(args.server_args)
    parsed = [parse_config(text, args.kv_budget) for text in args.configs]
    try:
        clusters = [cluster_of(flags) for _, flags in parsed]
    except ValueError as e:
        p.error(str(e))
    if args.api == "auto":
        args.api = "generate" if any(clusters) else "completions"
    elif args.api == "completions" and any(clusters):
        p.error("--api completions: the gateway refuses token-id prompts on /v1/completions; "
                "use --api generate (or auto) with a cluster configuration")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="eviction-logs-"))
    print(f"== server logs: {logs}", flush=True)
    results = []
    for round_ in range(args.rounds):
        for text in args.configs:
            name, flags = parse_config(text, args.kv_budget)
            print(f"== round {round_ + 1}/{args.rounds} {name}: {' '.join(flags)}", flush=True)
            result = run_config(name, flags, args, logs / f"{name}-round{round_ + 1}.log")
            result.round = round_
            results.append(result)
            print(markdown([result]), flush=True)
    setup = {
        "rounds": args.rounds,
        "machine": machine(), "requests": args.requests, "input_len": args.input_len,
        "output_len": args.output_len, "max_total_tokens": args.max_total_tokens,
        "kv_budget": args.kv_budget, "server_args": args.server_args,
        "model": "see server_args" if "--model-path" in args.server_args else "built-in demo model",
        "date": time.strftime("%Y-%m-%d"), "api": args.api,
    }
    print(report(results, setup, args.out, "eviction" + (f"-{args.tag}" if args.tag else ""), meta))


def report(
    results: list[ConfigResult], setup: dict, out: Path, stem: str = "eviction", meta: dict | None = None
) -> str:
    """Write <stem>.json, <stem>.md and <stem>.png; return the markdown table. `meta`: what
    produced the run (`benchmarks.common.run_metadata`), at the top of the JSON and the .md."""
    meta = meta or {}
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "setup": setup, "results": [asdict(r) for r in results]}, indent=2)
    )
    pool = " ".join(["--max-total-tokens", str(setup["max_total_tokens"]), *setup["server_args"]])
    title = (
        f"{setup['requests']} requests, {setup['input_len']}-token prompts, "
        f"{setup['output_len']} output tokens (ignore_eos), all at once; every server: {pool}; "
        f"policies at --kv-budget {setup['kv_budget']}; {setup['model']}; {setup['machine']}"
    )
    if setup.get("rounds", 1) > 1:
        title += f"; {setup['rounds']} rounds, interleaved (the median round's row is shown)"
    table = markdown(results)
    (out / f"{stem}.md").write_text(f"{metadata_markdown(meta)}\n{title}\n\n{table}")
    plot(results, out / f"{stem}.png", title)
    return table


def load(path: Path) -> tuple[list[ConfigResult], dict]:
    data = json.loads(path.read_text())
    return [ConfigResult(**r) for r in data["results"]], data["setup"]


if __name__ == "__main__":
    main()
