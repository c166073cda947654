"""Scaling out on one machine: one server, `--dp-size 2`, and two servers behind the SGLang Model
Gateway (cache_aware, round_robin, and cache_aware with a worker killed halfway), same load.

    python -m benchmarks.cluster                      # benchmarks/results/cluster.{json,md,png}
    python -m benchmarks.cluster --duration 30 --users 8 --configs one two-cache_aware

The load is the locust runner's `shared_prefix` scenario (`loadtest/`): closed-loop streaming
chat users, each request one of `--system-prompts` long system prompts plus a short question
(several applications behind one endpoint: what prefix-aware routing is for). Every
configuration gets fresh servers with the same flags (`--server-args`, every worker the same).
Recorded per configuration: locust's summary (requests, failures, TTFT/TPOT, output tokens/s),
the prefix hit rate and the peak of requests in flight from `/v1/kvc/stats` (for a gateway, the
sum over its workers), and per worker the share of requests and its own hit rate. The `-kill`
configuration SIGKILLs worker 1 at half the load and records how many requests it held then:
only those may fail.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import textwrap
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import describe_machine, metadata_markdown, run_metadata
from loadtest.metrics import Limits, RequestRecord, read_requests
from loadtest.run import LoadSettings, ServerConfig, run_load
from loadtest.server import ServerProcess, free_port
from sgl_kvc.cluster import ClusterConfig, LocalCluster

CONFIGS = ("one", "dp2", "two-cache_aware", "two-round_robin", "two-cache_aware-kill")


@dataclass
class WorkerShare:
    name: str  # the worker's URL, or "dp rank N"
    requests: int  # finished during the load
    prefix_hit_rate: float | None


@dataclass
class ConfigResult:
    name: str
    description: str
    summary: dict[str, Any]  # loadtest.metrics.Summary
    workers: list[WorkerShare] = field(default_factory=list)
    kill: dict[str, Any] | None = None  # the -kill configuration: see kill_outcome()


def _describe(name: str, flags: list[str]) -> str:
    if name == "one":
        return f"one server: {shlex.join(flags)}"
    if name == "dp2":
        return f"one server, two data-parallel ranks: {shlex.join([*flags, '--dp-size', '2'])}"
    policy = name.split("-")[1]
    return f"2 workers behind smg ({policy}); each: {shlex.join(flags)}"


def _parts(stats: dict) -> list[tuple[str, dict | None]]:
    """(name, snapshot) of each worker behind a gateway, or each rank of a data-parallel server."""
    if "per_worker" in stats:
        return [(w["url"], w.get("stats")) for w in stats["per_worker"]]
    if stats.get("dp_size", 1) > 1:
        return [(f"dp rank {r['dp_rank']}", r) for r in stats["per_rank"]]
    return []


def _shares(before: dict | None, after: dict | None) -> list[WorkerShare]:
    """Per worker (or data-parallel rank): requests finished and prefix hit rate in the run."""
    if not before or not after:
        return []
    start = dict(_parts(before))
    out = []
    for name, a in _parts(after):
        b = start.get(name)
        if not a or not b:
            out.append(WorkerShare(name, 0, None))
            continue
        pa, pb = a["prefix_cache"], b["prefix_cache"]
        prompt = pa["prompt_tokens"] - pb["prompt_tokens"]
        out.append(WorkerShare(
            name, pa["requests"] - pb["requests"],
            (pa["hit_tokens"] - pb["hit_tokens"]) / prompt if prompt > 0 else None,
        ))  # fmt: skip
    return out


def run_config(name: str, flags: list[str], load: LoadSettings, work: Path) -> ConfigResult:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    limits = Limits()
    killed: dict[str, Any] = {}
    with ExitStack() as stack:
        if name in ("one", "dp2"):
            cmd = [sys.executable, "-m", "sgl_kvc.launch", *flags,
                   *(["--dp-size", "2"] if name == "dp2" else [])]  # fmt: skip
            url = stack.enter_context(ServerProcess.launch(cmd, log_path=out / "server.log")).url
        else:
            policy = name.split("-")[1]
            cluster = stack.enter_context(LocalCluster.start(ClusterConfig(
                workers=2, router_policy=policy, port=free_port(), server_flags=tuple(flags),
                log_dir=out / "logs",
            )))  # fmt: skip
            url = cluster.url
            if name.endswith("-kill"):
                victim = cluster.workers[1]

                def kill() -> None:
                    killed["victim_running"] = victim.stats()["requests"]["running"]
                    killed["at"] = time.time()
                    victim.kill()

                timer = threading.Timer(load.duration_s / 2, kill)
                timer.start()
                stack.callback(timer.cancel)
        summary = run_load(ServerConfig(name, tuple(flags)), url, load, limits, out)
    saved = json.loads((out / "summary.json").read_text())
    return ConfigResult(
        name=name, description=_describe(name, flags), summary=asdict(summary),
        workers=_shares(saved.get("kvc_stats_before"), saved.get("kvc_stats_after")),
        kill=kill_outcome(read_requests(out / "requests.csv"), killed) if killed else None,
    )  # fmt: skip


def kill_outcome(records: list[RequestRecord], killed: dict[str, Any]) -> dict[str, Any]:
    """What the kill cost, from the per-request CSV: requests in flight at the kill (started
    before, ended after), which of them failed, and failures of requests sent after it (none,
    if the gateway routes around the dead worker)."""
    at = killed["at"]
    in_flight = [r for r in records if r.t_start < at < r.t_end]
    after = [r for r in records if r.t_start >= at]
    return {
        "at_s": round(at - min(r.t_start for r in records), 1),
        "victim_running": killed["victim_running"],  # its running batch, sampled just before
        "in_flight_all_workers": len(in_flight),
        "failed_in_flight": sum(not r.ok for r in in_flight),
        "sent_after": len(after),
        "failed_after": sum(not r.ok for r in after),
        "errors": sorted({r.error[:120] for r in records if not r.ok})[:5],
    }


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(results: list[ConfigResult]) -> str:
    rows = [
        "| config | requests | failures | output tok/s | prefix hit rate | peak in flight (sampled) "
        "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | requests per worker (rank) "
        "| hit rate per worker (rank) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        s = r.summary
        per = " / ".join(str(w.requests) for w in r.workers) or "-"
        hits = " / ".join(_f(w.prefix_hit_rate, ".0%") for w in r.workers) or "-"
        failures = str(s["failures"])
        if r.kill is not None:
            k = r.kill
            failures += (f" ({k['failed_in_flight']} of {k['in_flight_all_workers']} in flight at the "
                         f"kill, {k['failed_after']} of {k['sent_after']} sent after)")
        rows.append(
            f"| {r.name} | {s['requests']} | {failures} | {s['output_tokens_per_s']:.0f} "
            f"| {_f(s['prefix_hit_rate'], '.1%')} | {_f(s['peak_running_sampled'], 'd')} "
            f"| {_f(s['ttft_p50_ms'], '.0f')} / {_f(s['ttft_p99_ms'], '.0f')} "
            f"| {_f(s['tpot_p50_ms'], '.0f')} / {_f(s['tpot_p99_ms'], '.0f')} | {per} | {hits} |"
        )
    return "\n".join(rows) + "\n"


def plot(results: list[ConfigResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    s = [r.summary for r in results]
    panels = [
        ("prefix hit rate", [x["prefix_hit_rate"] or 0 for x in s]),
        ("peak requests in flight (sampled)", [x["peak_running_sampled"] or 0 for x in s]),
        ("TTFT p50 (ms)", [x["ttft_p50_ms"] or 0 for x in s]),
        ("output tokens/s", [x["output_tokens_per_s"] for x in s]),
        ("failed requests", [x["failures"] for x in s]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(17, 4.2))
    for ax, (label, values) in zip(axes, panels):
        ax.bar(names, values, color=["#888", "#aaa"] + ["#2a7"] * (len(names) - 2))
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.suptitle(textwrap.fill(title, 190), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    # A pool of 8192 tokens holds about 7 of the 16 system prompts (~710 tokens each on the demo
    # model) next to the running requests: one server cannot keep them all cached, two can if
    # each keeps its own half, which is what prefix-aware routing is for.
    p.add_argument("--server-args", default="--model-path demo --policy rkv --max-total-tokens 8192",
                   help="flags of every server / worker (python -m sgl_kvc.launch)")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--spawn-rate", type=float, default=8.0)
    p.add_argument("--duration", type=int, default=60, help="load seconds per configuration")
    p.add_argument("--system-prompts", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default="", help="result files are cluster-<tag>.* (default cluster.*)")
    args = p.parse_args(argv)
    meta = run_metadata("benchmarks.cluster", argv)  # before the run writes anything
    print(metadata_markdown(meta), flush=True)
    flags = shlex.split(args.server_args)
    load = LoadSettings(users=args.users, spawn_rate=args.spawn_rate, duration_s=args.duration,
                        scenario="shared_prefix", system_prompts=args.system_prompts,
                        stop_timeout_s=60)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    print(f"== locust output and server logs: {work}", flush=True)
    results = []
    for name in args.configs:
        print(f"== {name}: {_describe(name, flags)}", flush=True)
        results.append(run_config(name, flags, load, work))
        print(markdown(results[-1:]), flush=True)
    setup = {
        "server_args": flags, "load": asdict(load),
        "gateway": "smg 1.13.0 with python -m sgl_kvc.cluster's defaults",
    }  # fmt: skip
    stem = "cluster" + (f"-{args.tag}" if args.tag else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"meta": meta, "setup": setup, "results": [asdict(r) for r in results]}, indent=2
    ) + "\n")  # fmt: skip
    title = (
        f"{args.users} streaming chat users, shared_prefix with {args.system_prompts} system "
        f"prompts, {args.duration} s per configuration; every server: {shlex.join(flags)}; "
        f"{describe_machine(meta['machine'])}; commit {meta['commit']}"
    )
    table = markdown(results)
    (args.out / f"{stem}.md").write_text(f"{metadata_markdown(meta)}\n{title}\n\n{table}")
    plot(results, args.out / f"{stem}.png", title)
    print(table)


if __name__ == "__main__":
    main()
