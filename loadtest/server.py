"""Start a server on a free loopback port, wait until it is healthy, and always stop it.

One implementation for the load-test runner, the benchmarks and the test suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import requests

START_TIMEOUT_S = 300.0
PORT_ATTEMPTS = 3
# uvicorn's message when the HTTP port was taken between `free_port()` and the bind (servers
# started together: one's internal ZMQ/NCCL ports may land on the port chosen for another).
BIND_ERROR = "error while attempting to bind on address"


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port; a new port is tried."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvc_stats(url: str) -> dict[str, Any] | None:
    """`GET /v1/kvc/stats`, or None where the server has no such route (plain SGLang)."""
    try:
        r = requests.get(url + "/v1/kvc/stats", timeout=30)
    except requests.RequestException:
        return None
    return r.json() if r.status_code == 200 else None


def wait_healthy(
    url: str, proc: subprocess.Popen | None, timeout_s: float, log: Path | None
) -> None:
    """Poll GET /health until 200; fail early if `proc` (the server, when we started it) exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log is not None and BIND_ERROR in log.read_text(errors="replace"):
            # Its HTTP server gave up, but the process lingers: waiting would only time out.
            raise PortTaken(f"{url}: port taken before the server bound it (log: {log})")
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s (log: {log})")


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path

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
    ) -> Iterator["ServerProcess"]:
        """Run `cmd --host 127.0.0.1 --port <free port>`; stop it (and its children) on exit.
        A port taken before the server bound it is retried on another port.

        Without `log_path` the output goes to a temporary file, removed once the server has
        stopped; a server that fails to start keeps it (the error names it)."""
        for attempt in range(PORT_ATTEMPTS):
            server = cls._start(cmd, env, log_path)
            try:
                wait_healthy(server.url, server.proc, timeout_s, server.log_path)
            except PortTaken:
                server.stop()
                if attempt + 1 == PORT_ATTEMPTS:
                    raise
                if log_path is None:
                    server.log_path.unlink(missing_ok=True)
                continue
            except BaseException:
                server.stop()
                raise
            break
        try:
            yield server
        finally:
            server.stop()
            if log_path is None:
                server.log_path.unlink(missing_ok=True)

    @classmethod
    def _start(cls, cmd: list[str], env: dict[str, str] | None, log_path: Path | None) -> "ServerProcess":
        port = free_port()
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"server-{port}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [*cmd, "--host", "127.0.0.1", "--port", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own process group: stop() reaches every child
            )
        return cls(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, sig)  # SGLang's scheduler/detokenizer children too
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue


@contextmanager
def launched(flags: list[str], log_path: Path, timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Run the sgl-kvc launcher with `flags` on 127.0.0.1:<free port>; yield its base URL."""
    if any(f in ("--host", "--port") or f.startswith(("--host=", "--port=")) for f in flags):
        raise ValueError("--host/--port are chosen by the runner; leave them out of the flags")
    cmd = [sys.executable, "-m", "sgl_kvc.launch", *flags]
    with ServerProcess.launch(cmd, log_path=log_path, timeout_s=timeout_s) as server:
        yield server.url
