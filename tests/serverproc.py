"""Start a server process on a free port, wait until it is healthy, and always stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import requests

START_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log_tail(self, n: int = 60) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, json: object, **kw) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=120, **kw)

    def stats(self) -> dict:
        r = self.get("/v1/kvc/stats")
        r.raise_for_status()
        return r.json()

    @classmethod
    @contextmanager
    def launch(cls, cmd: list[str], env: dict[str, str] | None = None) -> Iterator["ServerProcess"]:
        port = free_port()
        log = tempfile.NamedTemporaryFile("w", prefix=f"server-{port}-", suffix=".log", delete=False)
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(
            [*cmd, "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # its own process group: teardown kills every child
        )
        server = cls(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log.name)
        try:
            server._wait_healthy()
            yield server
        finally:
            server.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy after {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
