"""Servers forked from a process that has already imported the launcher's SGLang (test suites).

A CPU server's start-up costs about 19 s of CPU on a 2-core machine, 10-11 of them importing SGLang
in the launcher (its workers are forked from the launcher after that,
`launcher.cpu_processes.fork_workers_on_cpu`).
A test run starts dozens of servers. A *prelauncher* imports what `python -m sgl_kvc.launch`
imports before it loads SGLang's plugins, once, then forks one child per server asked of it; the
child becomes the launcher (`runpy`, as `python -m` runs it) with the server's argv, environment,
working directory and log, in a session of its own, as `subprocess.Popen(start_new_session=True)`
would start it. Nothing it imported ran: the child's state is the fresh launcher's at that point.

It serves only `python -m sgl_kvc.launch` commands, and only environments equal to its own but for
variables sgl-kvc reads at run time (`RUNTIME_ENV`): an import-time setting (OMP threads, the CPU
capability, stand-ins, SGLang's thread binding) would otherwise be the prelauncher's. Any other
command is started as usual (`ServerProcess`). On a GPU it is never used: CUDA does not survive a fork.

Enabled by `SGLKVC_PRELAUNCHER` (the path of its Unix socket, set by `tests/conftest.py`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

SOCKET_ENV = "SGLKVC_PRELAUNCHER"
# What may differ between the prelauncher's environment and a server's: read when used, never at
# import (pytest names the running test in PYTEST_CURRENT_TEST and sets the terminal's size).
RUNTIME_ENV = frozenset({"SGLKVC_CHECK", "SGLKVC_TRACE", "SGLKVC_FAILPOINTS", SOCKET_ENV,
                         "PYTEST_CURRENT_TEST", "COLUMNS", "LINES"})
CONNECT_WAIT_S = 120.0  # the prelauncher's own imports, on a busy machine


@dataclass
class ForkedProcess:
    """The part of `subprocess.Popen` a `ServerProcess` uses, for a server the prelauncher forked
    (its child, not ours: the prelauncher reaps it and writes its exit status to `status_path`)."""

    pid: int
    status_path: Path
    prelauncher: Path  # its pid file
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self.status_path.read_text())
            except (OSError, ValueError):
                # Reaped but its status not yet written, or never to be: the prelauncher is gone.
                if not Path(f"/proc/{self.pid}").exists() and not _alive(self.prelauncher):
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def pid_file(socket_path: str) -> Path:
    """Where whoever starts the prelauncher serving `socket_path` writes its pid (`forked` reads
    it to tell a prelauncher still importing from one that is gone)."""
    return Path(socket_path + ".pid")


def forked(cmd: Sequence[str], env: dict[str, str], log_path: Path) -> ForkedProcess | None:
    """`cmd` started by the prelauncher named in `$SGLKVC_PRELAUNCHER`, its output appended to
    `log_path`, or None: none is set, it is not up within `CONNECT_WAIT_S`, or it does not serve
    this command or environment."""
    path = os.environ.get(SOCKET_ENV)
    if not path or list(cmd[:3]) != [sys.executable, "-m", "sgl_kvc.launch"]:
        return None
    request = {"argv": list(cmd[3:]), "env": env, "cwd": os.getcwd(), "log": str(log_path)}
    prelauncher = pid_file(path)
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        try:
            with socket.socket(socket.AF_UNIX) as conn:
                conn.connect(path)
                conn.sendall(json.dumps(request).encode() + b"\n")
                reply = json.loads(conn.makefile().readline() or "{}")
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() >= deadline or not _alive(prelauncher):
                return None  # still importing past the bound, or gone (a GPU machine: never up)
            time.sleep(0.2)
    if "pid" not in reply:
        return None
    return ForkedProcess(pid=int(reply["pid"]), status_path=Path(reply["status"]), prelauncher=prelauncher)


def _alive(pid_path: Path) -> bool:
    """Whether the prelauncher runs (an exited one is a zombie until the test run waits for it)."""
    try:
        stat = Path(f"/proc/{int(pid_path.read_text())}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _differs(mine: dict[str, str], theirs: dict[str, str], imported: dict[str, str] | None = None) -> list[str]:
    """The variables of a server's environment `theirs` that rule a fork out: those that differ from
    the prelauncher's own at its start (`mine`) but for what is read at run time, and but for what
    its imports set (`imported`: SGLang points third-party caches at its own folder when it is
    imported, `setdefault`), where `theirs` has it as they set it: a test process that imported
    SGLang itself has them, and a fresh launcher gets them so too."""
    imported = imported or {}
    return sorted(k for k in set(mine) | set(theirs)
                  if mine.get(k) != theirs.get(k) and k not in RUNTIME_ENV
                  and not (k not in mine and k in imported and theirs.get(k) == imported[k]))


def _preimport() -> None:
    """What `launcher.serve.main` has imported when it loads SGLang's plugins, and SGLang's model registry,
    which each scheduler otherwise imports (every model module: about 2 s of CPU a server). No
    more: a module that bound a hooked function by name before the hooks were applied would keep
    the original; the model modules hold none (every hook target is a class attribute, read
    through its class: `test_every_hook_target_is_a_class_attribute`)."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") is None:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # as the launcher sets it on CPU before its imports
    import sglang.launch_server  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.plugins  # noqa: F401
    import sglang.srt.server_args  # noqa: F401
    import sglang.srt.utils  # noqa: F401
    import sglang.srt.models.registry  # noqa: F401  (imports every model module)

    import sgl_kvc.config  # noqa: F401


def _child(request: dict[str, Any], listener: socket.socket, conn: socket.socket) -> None:
    """In the forked child: become `python -m sgl_kvc.launch ARGV` as Popen would have started it."""
    import runpy

    code: Any = 1  # SystemExit's: None or 0 a success, a message (printed) or another int a failure
    try:
        listener.close()
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["sgl_kvc.launch", *request["argv"]]
        runpy.run_module("sgl_kvc.launch", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - the child's own error, to its log
        import traceback

        traceback.print_exc()
    # Out through the prelauncher's frames to the interpreter's own exit, as the launcher's process
    # would end (atexit handlers run: multiprocessing's stops SGLang's workers).
    raise SystemExit(code)


def serve(path: str) -> None:
    """The prelauncher: import, then fork a server per request on the Unix socket `path`."""
    own_env = dict(os.environ)
    if _cuda():
        return  # CUDA does not survive a fork: every server starts as usual
    _preimport()
    imported = {k: v for k, v in os.environ.items() if own_env.get(k) != v}
    status_dir = Path(path + ".status")
    status_dir.mkdir(exist_ok=True)

    def reap(_signum: int, _frame: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            tmp = status_dir / f"{pid}.tmp"
            tmp.write_text(str(code))
            tmp.rename(status_dir / str(pid))

    signal.signal(signal.SIGCHLD, reap)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile().readline() or "{}")
            differs = _differs(own_env, request.get("env", {}), imported)
            if differs:
                print(f"sgl-kvc prelauncher: started as usual (its environment differs: {differs})", flush=True)
                conn.sendall(json.dumps({"refused": differs}).encode() + b"\n")
                continue
            pid = os.fork()
            if pid == 0:
                _child(request, listener, conn)
            print(f"sgl-kvc prelauncher: forked {pid}: {' '.join(request['argv'])}", flush=True)
            conn.sendall(json.dumps({"pid": pid, "status": str(status_dir / str(pid))}).encode() + b"\n")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return True  # not a machine this serves


if __name__ == "__main__":
    serve(sys.argv[1])
