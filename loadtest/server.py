"""Start `python -m sgl_kvc.launch <flags>` on a free loopback port; always stop it afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import requests


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


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout_s: float, log: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
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


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # the whole group: SGLang's scheduler/detokenizer children too
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def launched(flags: list[str], log_path: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """Run the sgl-kvc launcher with `flags` on 127.0.0.1:<free port>; yield its base URL."""
    if any(f in ("--host", "--port") or f.startswith(("--host=", "--port=")) for f in flags):
        raise ValueError("--host/--port are chosen by the runner; leave them out of the flags")
    port = free_port()
    cmd = [sys.executable, "-m", "sgl_kvc.launch", *flags, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, timeout_s, log_path)
        yield url
    finally:
        _stop(proc)
