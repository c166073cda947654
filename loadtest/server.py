"""Start a server on a free loopback port, wait until it is healthy, and always stop it.

The implementation lives in the package (`sgl_kvc.server_process`), where the local cluster
(`python -m sgl_kvc.cluster`) uses it too; the names stay importable from here for the
load-test runner, the benchmarks and the test suite.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sgl_kvc.server_process import (  # noqa: F401  (re-exported)
    BIND_ERROR,
    PORT_ATTEMPTS,
    START_TIMEOUT_S,
    PortTaken,
    ServerProcess,
    free_port,
    kvc_stats,
    stop_all,
    wait_healthy,
)


@contextmanager
def launched(flags: list[str], log_path: Path, timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Run the sgl-kvc launcher with `flags` on 127.0.0.1:<free port>; yield its base URL."""
    if any(f in ("--host", "--port") or f.startswith(("--host=", "--port=")) for f in flags):
        raise ValueError("--host/--port are chosen by the runner; leave them out of the flags")
    cmd = [sys.executable, "-m", "sgl_kvc.launch", *flags]
    with ServerProcess.launch(cmd, log_path=log_path, timeout_s=timeout_s) as server:
        yield server.url
