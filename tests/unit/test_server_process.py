"""`ServerProcess.launch` retries a port that was taken before the server bound it, and removes
the temporary log it made once the server has stopped.

Seen in CI: three servers started together, one SGLang's internal ports landed on the HTTP port
chosen for another; uvicorn logged the bind error and the process lingered, so the fixture
waited out its whole start timeout and the module's tests errored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests

from loadtest.server import BIND_ERROR, PortTaken, ServerProcess

# A stand-in server: the first `fail` starts log uvicorn's bind error and hang (as SGLang's
# process does); later ones answer GET /health on the port they are given.
FAKE = """
import http.server, sys, time
from pathlib import Path
count = Path(sys.argv[1]); fail = int(sys.argv[2]); port = int(sys.argv[sys.argv.index("--port") + 1])
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if n < fail:
    print(f"ERROR:    [Errno 98] BIND_ERROR ('127.0.0.1', {port}): address already in use", flush=True)
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _cmd(tmp_path: Path, fail: int) -> list[str]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE.replace("BIND_ERROR", BIND_ERROR))
    return [sys.executable, str(script), str(tmp_path / "starts"), str(fail)]


def test_a_taken_port_is_retried_on_another(tmp_path: Path) -> None:
    with ServerProcess.launch(_cmd(tmp_path, fail=1), timeout_s=30) as server:
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        log = server.log_path
        assert log.exists()
    assert (tmp_path / "starts").read_text() == "2"
    assert not log.exists()  # the temporary log goes with the server (one per e2e server leaked)


def test_a_log_path_given_is_kept(tmp_path: Path) -> None:
    with ServerProcess.launch(_cmd(tmp_path, fail=0), log_path=tmp_path / "s.log", timeout_s=30):
        pass
    assert (tmp_path / "s.log").exists()


def test_gives_up_after_the_last_attempt(tmp_path: Path) -> None:
    with pytest.raises(PortTaken):
        with ServerProcess.launch(_cmd(tmp_path, fail=10), timeout_s=30):
            pass
    assert (tmp_path / "starts").read_text() == "3"


# A benchmark in miniature: start the fake server, name its pid, then wait to be killed.
DRIVER = """
import sys, time
from pathlib import Path
from sgl_kvc.server_process import ServerProcess
with ServerProcess.launch(sys.argv[2:], timeout_s=30) as server:
    Path(sys.argv[1]).write_text(str(server.proc.pid))
    time.sleep(600)
"""


def test_a_run_sent_sigterm_stops_its_servers(tmp_path: Path) -> None:
    """`kill` on a benchmark or test run stops the servers it started (their own sessions would
    otherwise outlive it and take CPU from every later measurement)."""
    import os
    import signal
    import subprocess
    import time

    driver, pid_file = tmp_path / "driver.py", tmp_path / "server.pid"
    driver.write_text(DRIVER)
    run = subprocess.Popen([sys.executable, str(driver), str(pid_file), *_cmd(tmp_path, fail=0)])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert run.poll() is None and time.monotonic() < deadline, "the driver did not start it"
        time.sleep(0.1)
    server_pid = int(pid_file.read_text())
    run.send_signal(signal.SIGTERM)
    code = run.wait(timeout=30)
    try:
        os.killpg(server_pid, 0)  # the server's session: anything left in it?
    except ProcessLookupError:
        assert code == 128 + signal.SIGTERM  # and the run's own exit says why it stopped
        return
    os.killpg(server_pid, signal.SIGKILL)
    pytest.fail("the server outlived the run that was sent SIGTERM")


def test_default_args_fill_in_only_what_a_launcher_command_does_not_set() -> None:
    from sgl_kvc.server_process import with_default_args

    launcher = ("python", "-m", "sgl_kvc.launch", "--policy", "rkv", "--kv-cache-memory-gb=0.5")
    defaults = "--kv-cache-memory-gb 2 --cuda-graph-max-bs 8 --enable-metrics --policy none"
    assert with_default_args(launcher, defaults) == (*launcher, "--cuda-graph-max-bs", "8", "--enable-metrics")
    assert with_default_args(launcher, "") == launcher
    other = ("python", "-m", "http.server")
    assert with_default_args(other, defaults) == other
