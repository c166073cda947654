"""Start a server on a free loopback port, wait until it is healthy, and always stop it.

One implementation for the local cluster (`sgl_kvc.cluster`), the load-test runner, the
benchmarks and the test suite. Every server runs in its own session (process group), so stopping
it reaches every process it started (SGLang's scheduler and detokenizer children too).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import requests

from sgl_kvc.cluster_stats import kvc_stats  # noqa: F401  (one server's, or a gateway's workers')
from sgl_kvc.prelaunch import ForkedProcess, forked

START_TIMEOUT_S = 300.0
PORT_ATTEMPTS = 3
# uvicorn's message when the HTTP port was taken between `free_port()` and the bind (servers
# started together: one's internal ZMQ/NCCL ports may land on the port chosen for another).
BIND_ERROR = "error while attempting to bind on address"
LOOPBACK = "127.0.0.1"


def cpu_share_env(servers: int) -> dict[str, str]:
    """OMP_NUM_THREADS for one of `servers` CPU servers sharing this machine: an equal share of
    its cores. Several servers each running one OpenMP thread per core spin against each other
    when busy (measured: docs/scaling.md, "One command, one machine"). Empty where the
    user has set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // servers))}


# Flags given to every `python -m sgl_kvc.launch` this module starts, each only where the command
# does not set it: several test servers sharing one GPU each take a fixed KV budget
# (`--kv-cache-memory-gb`) instead of profiling the free memory the others also see (`.ci/gpu`).
DEFAULT_ARGS_ENV = "SGLKVC_SERVER_DEFAULT_ARGS"


def with_default_args(cmd: Sequence[str], defaults: str | None = None) -> tuple[str, ...]:
    """`cmd` plus the flags of `defaults` (`--flag value` or `--switch`, space-separated; default:
    `$SGLKVC_SERVER_DEFAULT_ARGS`) that it does not set, where `cmd` runs sgl-kvc's launcher."""
    defaults = os.environ.get(DEFAULT_ARGS_ENV, "") if defaults is None else defaults
    if "sgl_kvc.launch" not in cmd or not defaults.split():
        return tuple(cmd)
    out, words = list(cmd), defaults.split()
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        value = words[i + 1:i + 2]
        flag = word.split("=", 1)[0]
        if not any(a == flag or a.startswith(flag + "=") for a in cmd):
            out += [word, *(value if value and not value[0].startswith("--") and "=" not in word else [])]
    return tuple(out)


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port; a new port is tried."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_healthy(
    url: str,
    proc: subprocess.Popen | ForkedProcess | None,
    timeout_s: float,
    log: Path | None,
    path: str = "/health",
) -> None:
    """Poll GET `path` until 200; fail early if `proc` (the server, when we started it) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log is not None and BIND_ERROR in log.read_text(errors="replace"):
            # Its HTTP server gave up, but the process lingers: waiting would only time out.
            raise PortTaken(f"{url}: port taken before the server bound it (log: {log})")
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(url + path, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s (log: {log})")


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While inside, SIGTERM to this process raises SystemExit, so that `finally` blocks (the
    servers' stop) run: Python's default for SIGTERM is to die at once, and servers in their own
    sessions would outlive a benchmark or test run that was sent `kill`. Only where nothing else
    handles SIGTERM already, and only in the main thread (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def _exit(signum: int, _frame: Any) -> None:
        # Once: a second SIGTERM while the servers stop would cut their stop short (the
        # cluster CLI's handler ignores repeats for the same reason).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen | ForkedProcess
    log_path: Path
    # How it was started, so that `restart()` can start it again at the same address.
    cmd: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    host: str = LOOPBACK
    port: int = 0
    ready_path: str = "/health"
    temp_log: bool = field(default=False, repr=False)

    def log_tail(self, n: int = 60) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, json: object, **kw: Any) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=300, **kw)

    def stats(self) -> dict:
        r = self.get("/v1/kvc/stats")
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout_s: float = 60.0) -> dict:
        """Poll `/v1/kvc/stats` until no request runs (or the timeout); return the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats["requests"]["running"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.1)

    @classmethod
    @contextmanager
    def launch(
        cls,
        cmd: list[str],
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        timeout_s: float = START_TIMEOUT_S,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        ready_path: str = "/health",
    ) -> Iterator["ServerProcess"]:
        """Run `cmd --host HOST --port <free port, or PORT>`; stop it (and its children) on
        exit. A free port taken before the server bound it is retried on another port.
        `ready_path` is polled until it answers 200.

        Without `log_path` the output goes to a temporary file, removed once the server has
        stopped; a server that fails to start keeps it (the error names it)."""
        with cls.launch_all(
            [cmd], env=env, log_paths=[log_path], timeout_s=timeout_s, host=host,
            ports=[port], ready_path=ready_path,
        ) as (server,):  # fmt: skip
            yield server

    @classmethod
    @contextmanager
    def launch_all(
        cls,
        cmds: Sequence[Sequence[str]],
        env: dict[str, str] | None = None,
        log_paths: Sequence[Path | None] | None = None,
        timeout_s: float = START_TIMEOUT_S,
        *,
        host: str = LOOPBACK,
        ports: Sequence[int | None] | None = None,
        ready_path: str = "/health",
    ) -> Iterator[list["ServerProcess"]]:
        """Start every command at once, wait until all are healthy, stop all on exit.
        Start-up is mostly one busy core per server, so servers started together overlap."""
        logs = list(log_paths) if log_paths is not None else [None] * len(cmds)
        chosen = list(ports) if ports is not None else [None] * len(cmds)
        servers: list[ServerProcess] = []
        started = False  # a server that failed to start keeps its log (the error names it)
        with sigterm_unwinds():
            try:
                for cmd, log, port in zip(cmds, logs, chosen):
                    servers.append(cls._start(tuple(cmd), env, log, host, port, ready_path))
                for i in range(len(servers)):
                    servers[i] = servers[i]._wait_or_retry(timeout_s, retry=chosen[i] is None)
                started = True
                yield servers
            finally:
                stop_all(servers, remove_temp_logs=started)

    @classmethod
    def _start(
        cls,
        cmd: tuple[str, ...],
        env: dict[str, str] | None,
        log_path: Path | None,
        host: str = LOOPBACK,
        port: int | None = None,
        ready_path: str = "/health",
        log_mode: str = "w",
    ) -> "ServerProcess":
        port = free_port() if port is None else port
        temp_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"server-{port}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        argv = [*with_default_args(cmd), "--host", host, "--port", str(port)]
        full_env = {**os.environ, **(env or {})}
        with open(log_path, log_mode) as log:
            # a test run's prelauncher forks it, where it serves the command (`sgl_kvc/prelaunch.py`)
            proc = forked(argv, full_env, log_path) or subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        # A server bound to every interface still answers on loopback.
        reach = LOOPBACK if host in ("0.0.0.0", "::", "") else host
        return cls(
            url=f"http://{reach}:{port}", proc=proc, log_path=log_path, cmd=cmd, env=env,
            host=host, port=port, ready_path=ready_path, temp_log=temp_log,
        )  # fmt: skip

    def _wait_or_retry(self, timeout_s: float, retry: bool = True) -> "ServerProcess":
        """Wait until healthy; where the port was taken first, start again on a new port."""
        server = self
        for attempt in range(PORT_ATTEMPTS):
            try:
                wait_healthy(server.url, server.proc, timeout_s, server.log_path, server.ready_path)
                return server
            except PortTaken:
                server.stop()
                if not retry or attempt + 1 == PORT_ATTEMPTS:
                    raise
                if server.temp_log:
                    server.log_path.unlink(missing_ok=True)
                server = self._start(
                    server.cmd, server.env, None if server.temp_log else server.log_path,
                    server.host, None, server.ready_path,
                )  # fmt: skip
            except BaseException:
                server.stop()
                raise
        raise AssertionError("unreachable")

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Stop the server if it still runs and start it again with the same command at the
        same address (a restarted worker comes back where a router expects it)."""
        self.stop()
        again = self._start(
            self.cmd, self.env, self.log_path, self.host, self.port, self.ready_path, "a"
        )
        again.temp_log = self.temp_log
        self.proc = again.proc
        wait_healthy(self.url, self.proc, timeout_s, self.log_path, self.ready_path)

    def kill(self) -> None:
        """SIGKILL its whole process group at once (a crash, as far as clients can tell)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def stop(self) -> None:
        stop_all([self], remove_temp_logs=False)


def _signal_group(proc: subprocess.Popen | ForkedProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # SGLang's scheduler/detokenizer children too
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, from /proc (empty elsewhere)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.parent.name))
    return members


# Seconds a stopped server gets to exit by itself after SIGTERM (`stop_all`). SGLang notices a
# SIGTERM in a loop that polls every 5 s, so an idle server takes about 5 s to exit gracefully; a
# test suite that stops dozens of idle servers sets 0 (`tests/conftest.py`): SIGKILL at once.
STOP_GRACE_ENV = "SGLKVC_STOP_GRACE_S"


def stop_all(
    servers: Sequence[ServerProcess], term_wait_s: float | None = None, remove_temp_logs: bool = True
) -> None:
    """SIGTERM every server's leader at once, wait (`term_wait_s`, default `$SGLKVC_STOP_GRACE_S`,
    else 20 s), then SIGKILL each whole process group.
    Stopping them together bounds the whole stop by one server's grace time, not the sum. Only
    the leader gets SIGTERM: SGLang's own shutdown then drains its requests, asks its schedulers
    to exit and reaps them, where a SIGTERM to the whole group kills a scheduler first, which
    SGLang reports as a crash and follows with a 5 s diagnostic sleep. A group whose leader has
    already exited is still killed: its children may linger."""
    if term_wait_s is None:
        term_wait_s = float(os.environ.get(STOP_GRACE_ENV, "20"))
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + term_wait_s
    for s in servers:
        try:
            s.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    for s in servers:
        _signal_group(s.proc, signal.SIGKILL)
    deadline = time.monotonic() + 10
    for s in servers:
        try:
            s.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
        # SIGKILL is delivered asynchronously: return once the whole group is gone.
        while group_members(s.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = group_members(s.proc.pid)
        if left:
            print(f"sgl-kvc: process group {s.proc.pid} did not stop: {left}", file=sys.stderr)
        if remove_temp_logs and s.temp_log:
            s.log_path.unlink(missing_ok=True)
