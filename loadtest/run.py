"""Run locust headless against one or more server configurations and compare them.

    python -m loadtest.run [--url URL [--name NAME]] [--config NAME[=FLAGS] ...]
                           [--users N] [--spawn-rate R] [--duration S] [--scenario SCENARIO]
                           [--ttft-limit-ms MS] [--tpot-limit-ms MS] [--out DIR] ...

Configurations:
  --config NAME=FLAGS   start `python -m sgl_kvc.launch FLAGS` on a free loopback port, run
                        the load, stop the server. FLAGS is one shell-quoted string of launcher
                        / SGLang flags (split with shlex), e.g.
                          --config "none=--policy none"
                          --config "small=--max-total-tokens 4096 --max-running-requests 8"
                        `--config NAME` (no `=`) starts the server with its default flags.
                        Repeat --config for several configurations; they run one after
                        another, each on a fresh server, in the order given.
  --config NAME=cluster:CLUSTER_FLAGS [-- FLAGS]
                        start a local cluster instead (`python -m sgl_kvc.cluster`): workers
                        with the launcher FLAGS behind the SGLang Model Gateway, loaded through
                        the gateway; CLUSTER_FLAGS are the cluster command's (--workers,
                        --router-policy, --router-args), e.g.
                          --config "cluster2=cluster:--workers 2 --router-policy cache_aware
                                    -- --model-path demo --policy rkv"
                        Its /v1/kvc/stats numbers are the sum over the workers.
  --url URL             also (or only) load a server that is already running; it is listed as
                        the configuration --name (default "server"), first.
  Neither given: one configuration "default" (a server on the demo model: --model-path demo).

Per configuration, under OUT/NAME/: locust_stats.csv, locust_stats_history.csv,
locust_failures.csv, locust_exceptions.csv (locust's CSV; Type = E2E/TTFT/TPOT/ITL),
requests.csv (one row per request), summary.json, locust.log and server.log (started servers).
In OUT/: results.md (one side-by-side table of all configurations), results.png (one plot),
summaries.json. OUT defaults to loadtest/results/. Every summary.json, summaries.json and
results.md records what produced the run: commit, date, machine, GPU, versions and the command
(`benchmarks.common.run_metadata`).

Each load runs `--duration` seconds (locust -t), then users get `--stop-timeout` seconds to
finish the request in flight (then locust stops them, which closes their streams); requests/s,
output tokens/s and goodput are measured over the window from the first request start to
the last request end. Every loop is bounded: locust by -t and --stop-timeout, the process by
a hard timeout on top, server start by --server-timeout.

Examples:
    python -m loadtest.run --url http://127.0.0.1:30000 --users 4 --duration 20
    python -m loadtest.run --scenario long_gen --users 12 --duration 60 \\
        --config "none=--policy none" --config "small=--policy none --max-total-tokens 2048"
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.common import metadata_markdown, run_metadata
from loadtest.metrics import Limits, Summary, summarize
from loadtest.prompts import SCENARIOS, PromptSettings
from loadtest.report import write_markdown, write_plot
from loadtest.server import free_port, kvc_stats, launched, wait_healthy
from sgl_kvc.cluster import ClusterConfig, LocalCluster

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
DEFAULT_OUT = Path(__file__).with_name("results")
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


CLUSTER_PREFIX = "cluster:"


@dataclass(frozen=True)
class ServerConfig:
    """One configuration: a name, and either launcher flags (start a server), a local cluster
    (start workers and the gateway) or a URL."""

    name: str
    flags: tuple[str, ...] = ()
    url: str | None = None
    cluster: ClusterConfig | None = None

    @classmethod
    def parse(cls, spec: str) -> "ServerConfig":
        """`NAME=FLAGS`, `NAME=cluster:CLUSTER_FLAGS [-- FLAGS]` or `NAME` (module docstring)."""
        name, _, flags = spec.partition("=")
        name = name.strip()
        if not _NAME.match(name):
            raise ValueError(f"bad configuration name {name!r} in {spec!r}; use [A-Za-z0-9_.-]")
        if flags.lstrip().startswith(CLUSTER_PREFIX):
            argv = shlex.split(flags.lstrip()[len(CLUSTER_PREFIX):])
            try:
                cluster = ClusterConfig.from_argv(argv)
            except ValueError as e:
                raise ValueError(f"configuration {name!r}: {e}") from e
            return cls(name, tuple(argv), cluster=cluster)
        return cls(name, tuple(shlex.split(flags)))

    def describe(self) -> str:
        if self.url is not None:
            return self.url
        text = shlex.join(self.flags)
        return CLUSTER_PREFIX + text if self.cluster is not None else text


@dataclass(frozen=True)
class LoadSettings:
    """How hard and how long to load each configuration."""

    users: int = 8
    spawn_rate: float = 2.0
    duration_s: int = 60
    scenario: str = "mix"
    seed: int = 0
    long_max_tokens: int = PromptSettings.long_max_tokens
    system_prompts: int = PromptSettings.system_prompts
    document_ratio: float = PromptSettings.document_ratio
    turns: int = PromptSettings.turns
    document_words: int = PromptSettings.document_words
    stop_timeout_s: int = 120
    request_timeout_s: float = 300.0


class RunningPeak:
    """Polls `/v1/kvc/stats` in a thread while the load runs; keeps the peak of `running`."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        self.url, self.interval_s = url, interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            stats = kvc_stats(self.url)
            if stats is not None:
                running = int(stats["requests"]["running"])
                self.peak = running if self.peak is None else max(self.peak, running)

    def __enter__(self) -> "RunningPeak":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=35)


def locust_command(url: str, load: LoadSettings, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
        "--users", str(load.users), "--spawn-rate", str(load.spawn_rate),
        "--run-time", f"{load.duration_s}s", "--stop-timeout", str(load.stop_timeout_s),
        "--csv", str(out / "locust"), "--only-summary", "--exit-code-on-error", "0",
        "--scenario", load.scenario, "--prompt-seed", str(load.seed),
        "--long-max-tokens", str(load.long_max_tokens), "--system-prompts", str(load.system_prompts),
        "--document-ratio", str(load.document_ratio), "--turns", str(load.turns),
        "--document-words", str(load.document_words),
        "--requests-csv", str(out / "requests.csv"),
        "--request-timeout", str(load.request_timeout_s),
    ]  # fmt: skip


def run_load(
    config: ServerConfig, url: str, load: LoadSettings, limits: Limits, out: Path,
    meta: dict | None = None,
) -> Summary:
    """Load one healthy server and summarize the run into OUT/summary.json."""
    out.mkdir(parents=True, exist_ok=True)
    before = kvc_stats(url)
    hard_timeout = load.duration_s + load.stop_timeout_s + 120
    with RunningPeak(url) as peak, open(out / "locust.log", "w") as log:
        proc = subprocess.run(
            locust_command(url, load, out), stdout=log, stderr=subprocess.STDOUT,
            timeout=hard_timeout, check=False,
        )
    if proc.returncode != 0 or not (out / "locust_stats.csv").exists():
        tail = (out / "locust.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"locust failed ({proc.returncode}) for {config.name}:\n{tail}")
    after = kvc_stats(url)
    summary = summarize(
        out / "locust_stats.csv", out / "requests.csv", limits,
        config=config.name, scenario=load.scenario, users=load.users,
        stats_before=before, stats_after=after, peak_running_sampled=peak.peak,
        flags=config.describe(),
    )  # fmt: skip
    (out / "summary.json").write_text(
        json.dumps({"meta": meta or {}, **asdict(summary), "load": asdict(load), "kvc_stats_before": before,
                    "kvc_stats_after": after}, indent=2) + "\n"
    )  # fmt: skip
    return summary


def run_config(
    config: ServerConfig, load: LoadSettings, limits: Limits, out: Path, server_timeout_s: float,
    meta: dict | None = None,
) -> Summary:
    (out / config.name).mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if config.url is not None:
            url = config.url.rstrip("/")
            wait_healthy(url, None, min(server_timeout_s, 30.0), None)
        elif config.cluster is not None:
            cluster = replace(
                config.cluster, port=free_port(), log_dir=out / config.name / "logs",
                start_timeout_s=server_timeout_s,
            )  # fmt: skip
            url = stack.enter_context(LocalCluster.start(cluster)).url
        else:
            log = out / config.name / "server.log"
            url = stack.enter_context(launched(list(config.flags), log, server_timeout_s))
        return run_load(config, url, load, limits, out / config.name, meta)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.run",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Configurations:" + __doc__.split("Configurations:", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d, lim = LoadSettings(), Limits()
    p.add_argument("--url", help="a running server to load (listed first, as --name)")
    p.add_argument("--name", default="server", help="configuration name of --url")
    p.add_argument("--config", action="append", default=[], metavar="NAME[=FLAGS]",
                   help="start a server with these launcher flags (repeatable)")
    p.add_argument("--users", type=int, default=d.users, help="concurrent users")
    p.add_argument("--spawn-rate", type=float, default=d.spawn_rate, help="users started per s")
    p.add_argument("--duration", type=int, default=d.duration_s, help="load seconds per config")
    p.add_argument("--scenario", choices=SCENARIOS, default=d.scenario)
    p.add_argument("--seed", type=int, default=d.seed, help="prompt generator seed")
    p.add_argument("--long-max-tokens", type=int, default=d.long_max_tokens,
                   help="max_tokens of long_gen requests (sent with ignore_eos)")
    p.add_argument("--system-prompts", type=int, default=d.system_prompts,
                   help="shared_prefix: how many different system prompts requests draw from; "
                        "shared_documents, conversations: how many documents")
    p.add_argument("--document-ratio", type=float, default=d.document_ratio,
                   help="shared_documents, conversations: kv_compression.document's ratio (0: none asked)")
    p.add_argument("--turns", type=int, default=d.turns, help="conversations: turns of each conversation")
    p.add_argument("--document-words", type=int, default=d.document_words,
                   help="shared_documents, conversations: words of each document")
    p.add_argument("--stop-timeout", type=int, default=d.stop_timeout_s,
                   help="seconds users get to finish their request after --duration")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="per-request read timeout, seconds")
    p.add_argument("--ttft-limit-ms", type=float, default=lim.ttft_ms, help="goodput TTFT limit")
    p.add_argument("--tpot-limit-ms", type=float, default=lim.tpot_ms, help="goodput TPOT limit")
    p.add_argument("--server-timeout", type=float, default=300.0, help="max wait for /health, s")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> list[Summary]:
    args = build_parser().parse_args(argv)
    meta = run_metadata("loadtest.run", argv)  # before the run writes anything
    try:
        configs = [ServerConfig.parse(spec) for spec in args.config]
    except ValueError as e:
        build_parser().error(str(e))
    if args.url:
        configs.insert(0, ServerConfig(args.name, url=args.url))
    # Default: the fast demo model (the built-in default, SmolLM2, is for quality, not load).
    configs = configs or [ServerConfig("default", ("--model-path", "demo"))]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        build_parser().error(f"configuration names must be unique: {names}")
    load = LoadSettings(
        users=args.users, spawn_rate=args.spawn_rate, duration_s=args.duration,
        scenario=args.scenario, seed=args.seed, long_max_tokens=args.long_max_tokens,
        system_prompts=args.system_prompts, document_ratio=args.document_ratio, turns=args.turns,
        document_words=args.document_words,
        stop_timeout_s=args.stop_timeout,
        request_timeout_s=args.request_timeout,
    )  # fmt: skip
    limits = Limits(args.ttft_limit_ms, args.tpot_limit_ms)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summaries: list[Summary] = []
    for config in configs:
        t0 = time.monotonic()
        print(f"[loadtest] {config.name}: {config.describe() or '(defaults)'}", flush=True)
        summaries.append(run_config(config, load, limits, out, args.server_timeout, meta))
        s = summaries[-1]
        took = time.monotonic() - t0
        print(f"[loadtest] {config.name}: {s.requests} ok, {s.failures} failed, "
              f"{s.output_tokens_per_s:.1f} tok/s ({took:.0f} s)", flush=True)  # fmt: skip
    write_markdown(summaries, out / "results.md", preamble=metadata_markdown(meta).rstrip())
    write_plot(summaries, out / "results.png")
    (out / "summaries.json").write_text(
        json.dumps({"meta": meta, "summaries": [asdict(s) for s in summaries]}, indent=2) + "\n"
    )
    print(f"[loadtest] wrote {out / 'results.md'} and {out / 'results.png'}", flush=True)
    return summaries


if __name__ == "__main__":
    main()
