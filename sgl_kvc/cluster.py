"""`python -m sgl_kvc.cluster`: N sgl-kvc servers behind the SGLang Model Gateway, one command.

    python -m sgl_kvc.cluster --workers 2 --router-policy cache_aware -- --policy rkv
    python -m sgl_kvc.cluster --workers 2 --port 8000 --router-args "--cache-threshold 0.5" \\
        -- --model-path demo --policy snapkv --kv-budget 256

For one machine. Everything after `--` is given to every worker (`python -m sgl_kvc.launch`,
each on a free loopback port, all started at once); the gateway (`smg launch`, pip `smg`, the
`[cluster]` extra) starts once they are healthy and listens on --host/--port (default
127.0.0.1:30000, where a single server would be). The command is ready when the gateway reports
every worker healthy. Ctrl-C, SIGTERM or SIGHUP stop it: every child runs in a process group of
its own and each group is stopped (SIGTERM, then SIGKILL), so nothing is left behind.

A worker that exits is reported and the gateway routes around it (its health checks); the cluster
keeps serving while a worker is left, and `--restart-workers` starts an exited worker again at
its address, where the gateway finds it. Several machines: start `sgl_kvc.launch` on each and
`smg launch --worker-urls ...` in front by hand (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import signal
import socket
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NoReturn

import requests

from sgl_kvc.server_process import LOOPBACK, ServerProcess, cpu_share_env, free_port, stop_all

# The gateway's routing policies (smg 1.13 `--policy`) that need no extra set-up.
ROUTER_POLICIES: tuple[str, ...] = (
    "cache_aware", "prefix_hash", "power_of_two", "round_robin", "random", "least_load",
    "consistent_hashing",
)  # fmt: skip
GATEWAY_PACKAGE = "smg"
# Defaults given before the user's --router-args (the gateway's argparse keeps the last):
# - no worker overload protection: smg leaves a worker out of routing while its last load report
#   (polled every 10 s) shows KV usage >= 0.8 or 8 queued requests. A compressing worker fills
#   its pool by design (it admits by compressed footprint) and its scheduler queues the rest;
#   with one worker left after a crash, that rule answered 503 "no available workers" to every
#   request until the next poll (measured: docs/scaling.md, "Overload protection and compression");
# - probe workers every 2 s (smg's default is 60 s, too slow to notice a restarted worker);
# - warnings only in the log (it logs every request at info); metrics on loopback on a free port
#   (its default, 0.0.0.0:29000, would clash between two gateways on one machine); a 2 s grace
#   on stop instead of 180 s (the workers behind it are being stopped at the same time).
GATEWAY_DEFAULTS: tuple[str, ...] = (
    "--disable-worker-overload-protection", "--health-check-interval-secs", "2",
    "--log-level", "warn", "--prometheus-host", LOOPBACK, "--shutdown-grace-period-secs", "2",
)  # fmt: skip


class ClusterError(RuntimeError):
    """The cluster cannot start as asked."""


@dataclass(frozen=True)
class ClusterConfig:
    """One local cluster: how many workers with which flags, and the gateway in front."""

    workers: int = 2
    router_policy: str = "cache_aware"
    host: str = LOOPBACK
    port: int = 30000
    server_flags: tuple[str, ...] = ()  # for every worker (`python -m sgl_kvc.launch`)
    router_flags: tuple[str, ...] = ()  # extra `smg launch` flags
    log_dir: Path | None = None  # worker-<i>.log and gateway.log; temporary files without it
    restart_workers: bool = False
    start_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(
                f"--router-policy {self.router_policy!r}: choose one of {', '.join(ROUTER_POLICIES)}"
            )
        for what, flags in (("server flags", self.server_flags), ("--router-args", self.router_flags)):
            taken = [f for f in flags if f.split("=", 1)[0] in ("--host", "--port")]
            if taken:
                raise ValueError(
                    f"{taken[0]} in the {what}: the cluster chooses the workers' ports; "
                    "--host/--port of the cluster command are the gateway's"
                )
        if {f.split("=", 1)[0] for f in self.router_flags} & {"--worker-urls", "--policy"}:
            raise ValueError("--router-args: --worker-urls and --policy are set by the cluster")

    @classmethod
    def from_argv(cls, argv: list[str]) -> "ClusterConfig":
        """Parse `[cluster flags] [-- server flags]`; a bad value is a ValueError in one line."""
        own, server = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
        ns = build_parser(_RaisingParser).parse_args(own)
        return cls(
            workers=ns.workers, router_policy=ns.router_policy, host=ns.host, port=ns.port,
            server_flags=tuple(server), router_flags=tuple(shlex.split(ns.router_args)),
            log_dir=ns.log_dir, restart_workers=ns.restart_workers,
            start_timeout_s=ns.start_timeout,
        )  # fmt: skip


class _RaisingParser(argparse.ArgumentParser):
    """Reports a bad flag as a ValueError (the caller decides whether that ends the process)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def build_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = ClusterConfig()
    p = cls(
        prog="python -m sgl_kvc.cluster",
        usage="python -m sgl_kvc.cluster [options] -- [server flags]",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Server flags (after --) are `python -m sgl_kvc.launch` flags, given to every "
        "worker; leave out --host/--port.",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="sgl-kvc servers to start")
    p.add_argument("--router-policy", default=d.router_policy, choices=ROUTER_POLICIES,
                   help="the gateway's routing policy")
    p.add_argument("--host", default=d.host, help="the gateway's address")
    p.add_argument("--port", type=int, default=d.port, help="the gateway's port")
    p.add_argument("--router-args", default="", metavar="FLAGS",
                   help="more `smg launch` flags, one shell-quoted string "
                   '(--router-args="--upstream-http2" for a single flag)')
    p.add_argument("--log-dir", type=Path, default=None,
                   help="write worker-<i>.log and gateway.log here (default: temporary files)")
    p.add_argument("--restart-workers", action="store_true",
                   help="start a worker that exited again, at the same address")
    p.add_argument("--start-timeout", type=float, default=d.start_timeout_s,
                   help="seconds to wait for the workers and the gateway")
    return p  # fmt: skip


def worker_command(server_flags: tuple[str, ...] | list[str]) -> list[str]:
    return [sys.executable, "-m", "sgl_kvc.launch", *server_flags]


def worker_commands(config: ClusterConfig, gpus: int) -> list[list[str]]:
    """Every worker's command. On a GPU machine worker i gets GPUs of its own
    (`--base-gpu-id`), unless the flags place the workers already."""
    from sgl_kvc.launcher.cpu_processes import parallel_ranks

    flags = list(config.server_flags)
    if gpus == 0 or any(f.split("=", 1)[0] == "--base-gpu-id" for f in flags):
        return [worker_command(flags)] * config.workers
    per_worker = parallel_ranks(flags)
    if gpus < per_worker * config.workers:
        raise ClusterError(
            f"--workers {config.workers} x {per_worker} GPU(s) each needs "
            f"{per_worker * config.workers} GPUs, this machine has {gpus} (give --base-gpu-id in "
            "the server flags to place the workers yourself)"
        )
    return [worker_command([*flags, "--base-gpu-id", str(i * per_worker)]) for i in range(config.workers)]


def gateway_command(
    worker_urls: list[str], policy: str, router_flags: tuple[str, ...] | list[str] = ()
) -> list[str]:
    """`smg launch` in front of `worker_urls` (ServerProcess adds --host and --port)."""
    return [
        sys.executable, "-m", "smg", "launch", "--worker-urls", *worker_urls, "--policy", policy,
        *GATEWAY_DEFAULTS, "--prometheus-port", str(free_port()), *router_flags,
    ]  # fmt: skip


def healthy_workers(gateway_url: str) -> list[str]:
    """The worker URLs the gateway currently reports healthy."""
    r = requests.get(gateway_url + "/workers", timeout=10)
    r.raise_for_status()
    return [w["url"] for w in r.json().get("workers", []) if w.get("is_healthy")]


def wait_all_healthy(gateway_url: str, worker_urls: list[str], timeout_s: float) -> None:
    """Wait until the gateway reports every one of `worker_urls` healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = set(worker_urls) - set(healthy_workers(gateway_url))
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"gateway {gateway_url}: workers not healthy: {sorted(missing)}")
        time.sleep(0.2)


def _worker_env(config: ClusterConfig, gpus: int) -> dict[str, str]:
    """CPU workers share the machine: each gets an equal share of the cores as OpenMP threads."""
    return {} if gpus > 0 else cpu_share_env(config.workers)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ClusterError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from e


@dataclass
class LocalCluster:
    """A running cluster: the gateway (`url`) and its workers (`ServerProcess` each)."""

    config: ClusterConfig
    gateway: ServerProcess
    workers: list[ServerProcess]
    exited: set[int] = field(default_factory=set)  # workers seen exited (reported once)

    @property
    def url(self) -> str:
        return self.gateway.url

    @classmethod
    @contextmanager
    def start(cls, config: ClusterConfig) -> Iterator["LocalCluster"]:
        """Start the workers together, then the gateway; stop every process group on exit."""
        if importlib.util.find_spec(GATEWAY_PACKAGE) is None:
            raise ClusterError(
                "the SGLang Model Gateway is not installed: pip install -e '.[cluster]' "
                "(or `make install`)"
            )
        _check_port_free(config.host, config.port)
        logs: list[Path | None] = [None] * (config.workers + 1)
        if config.log_dir is not None:
            config.log_dir.mkdir(parents=True, exist_ok=True)
            logs = [config.log_dir / f"worker-{i}.log" for i in range(config.workers)]
            logs.append(config.log_dir / "gateway.log")
        gpus = _gpu_count()
        cmds = worker_commands(config, gpus)
        with ExitStack() as stack:
            workers = stack.enter_context(ServerProcess.launch_all(
                cmds, env=_worker_env(config, gpus), log_paths=logs[:-1],
                timeout_s=config.start_timeout_s,
            ))  # fmt: skip
            urls = [w.url for w in workers]
            gateway = stack.enter_context(ServerProcess.launch(
                gateway_command(urls, config.router_policy, config.router_flags),
                log_path=logs[-1], timeout_s=60, host=config.host, port=config.port,
                ready_path="/readiness",
            ))  # fmt: skip
            # Registered last, so run first: the gateway and the workers are stopped together,
            # in one grace period (the contexts above would stop them one after the other).
            stack.callback(stop_all, [gateway, *workers])
            wait_all_healthy(gateway.url, urls, 60)
            yield cls(config, gateway, list(workers))

    def check(self) -> str | None:
        """One look at the children: restart (or report) exited workers; a reason to stop the
        whole cluster, or None while it can serve."""
        if self.gateway.proc.poll() is not None:
            return f"the gateway exited with {self.gateway.proc.returncode} (log: {self.gateway.log_path})"
        for i, worker in enumerate(self.workers):
            code = worker.proc.poll()
            if code is None or i in self.exited:
                continue
            _say(f"worker {i} ({worker.url}) exited with {code} (log: {worker.log_path})")
            if self.config.restart_workers:
                try:
                    worker.restart(self.config.start_timeout_s)
                    _say(f"worker {i} restarted at {worker.url}")
                    continue
                except (RuntimeError, TimeoutError) as e:  # PortTaken is a RuntimeError
                    _say(f"worker {i} could not be restarted: {str(e).splitlines()[0]}")
            self.exited.add(i)
        if len(self.exited) == len(self.workers):
            return "every worker has exited"
        return None

    def serve_forever(self, poll_s: float = 1.0) -> str:
        """Watch the children until the cluster cannot serve; return why."""
        while True:
            reason = self.check()
            if reason is not None:
                return reason
            time.sleep(poll_s)


def _say(message: str) -> None:
    print(f"sgl-kvc cluster: {message}", file=sys.stderr, flush=True)


class _Shutdown(Exception):
    """A stop signal arrived."""


def _stop_on_signals() -> None:
    """SIGINT/SIGTERM/SIGHUP end the cluster through its normal exit path (which stops every
    child). Signals arriving while it stops are ignored, so that the stop completes."""
    stopping = False

    def handler(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Shutdown(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = ClusterConfig.from_argv(argv)
    except ValueError as e:
        build_parser().error(str(e))
    _stop_on_signals()
    try:
        with LocalCluster.start(config) as cluster:
            _say(
                f"gateway {cluster.url} ({config.router_policy}) -> "
                f"{', '.join(w.url for w in cluster.workers)}; ready"
            )
            reason = cluster.serve_forever()
            _say(f"stopping: {reason}")
            return 1
    except _Shutdown as e:
        _say(f"stopped ({e})")
        return 0
    except ClusterError as e:
        _say(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
