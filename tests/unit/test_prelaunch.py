"""The test run's prelauncher (`sgl_kvc/prelaunch.py`, started by `tests/conftest.py`): it forks
`python -m sgl_kvc.launch` with the server's argv, log and exit status as a fresh process would
have them, and starts nothing whose environment differs in what is read at import."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sgl_kvc.prelaunch import SOCKET_ENV, forked, pid_file

LAUNCH = [sys.executable, "-m", "sgl_kvc.launch"]


@pytest.fixture
def prelaunched() -> None:
    if not os.environ.get(SOCKET_ENV):
        pytest.skip("no prelauncher in this run (SGLKVC_PRELAUNCH=0)")


@pytest.mark.usefixtures("prelaunched")
def test_a_forked_launcher_exits_as_a_fresh_one(tmp_path: Path) -> None:
    log = tmp_path / "help.log"
    proc = forked([*LAUNCH, "--help"], dict(os.environ), log)
    assert proc is not None, "the prelauncher refused an environment equal to its own"
    assert proc.wait(120) == 0
    assert "--policy" in log.read_text() and "SGLang server flags" in log.read_text()
    bad = forked([*LAUNCH, "--policy", "no-such-policy"], dict(os.environ), tmp_path / "bad.log")
    assert bad is not None and bad.wait(120) == 2  # argparse's usage error, as `test_launch` gets it
    assert "no-such-policy" in (tmp_path / "bad.log").read_text()


@pytest.mark.usefixtures("prelaunched")
def test_only_the_launcher_with_an_equal_import_time_environment_is_forked(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    threads = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)  # read when torch loads OpenMP
    assert forked([*LAUNCH, "--help"], {**os.environ, "OMP_NUM_THREADS": threads}, log) is None
    assert forked([sys.executable, "-c", "pass"], dict(os.environ), log) is None
    runtime = forked([*LAUNCH, "--help"], {**os.environ, "SGLKVC_CHECK": "1"}, log)  # read at run time
    assert runtime is not None and runtime.wait(120) == 0


@pytest.mark.usefixtures("prelaunched")
def test_a_test_process_that_imported_sglang_still_forks(tmp_path: Path) -> None:
    """Importing SGLang points third-party caches at its folder (`setdefault`, in the test process
    too: a test that parses the launcher's flags imports it); the prelauncher's own imports set the
    same, as a fresh launcher's do, so such an environment is still its own. One that sets them
    otherwise is not."""
    import sglang  # noqa: F401
    from sglang.srt.environ import third_party_cache_defaults

    cache = next(iter(third_party_cache_defaults()))
    assert cache in os.environ
    proc = forked([*LAUNCH, "--help"], dict(os.environ), tmp_path / "x.log")
    assert proc is not None and proc.wait(120) == 0
    assert forked([*LAUNCH, "--help"], {**os.environ, cache: str(tmp_path)}, tmp_path / "y.log") is None


def test_what_the_prelaunchers_imports_set_is_no_difference() -> None:
    from sgl_kvc.prelaunch import _differs

    mine, imported = {"A": "1"}, {"CACHE": "/c"}
    assert _differs(mine, {"A": "1"}, imported) == [] and _differs(mine, {"A": "1", "CACHE": "/c"}, imported) == []
    assert _differs(mine, {"A": "1", "CACHE": "/other"}, imported) == ["CACHE"]
    assert _differs(mine, {"A": "2", "CACHE": "/c"}, imported) == ["A"]
    assert _differs({"A": "1", "CACHE": "/mine"}, {"A": "1", "CACHE": "/c"}, imported) == ["CACHE"]


def test_without_a_prelauncher_nothing_is_forked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    assert forked([*LAUNCH, "--help"], dict(os.environ), tmp_path / "x.log") is None


def test_an_exited_prelauncher_is_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One that found a GPU (or failed) exits at once: servers start as usual without waiting
    `CONNECT_WAIT_S` for its socket, though its process stays a zombie until the run waits for it."""
    import subprocess
    import time

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1)  # exited, not waited for: a zombie
    sock = tmp_path / "sock"
    pid_file(str(sock)).write_text(str(gone.pid))
    monkeypatch.setenv(SOCKET_ENV, str(sock))
    start = time.monotonic()
    assert forked([*LAUNCH, "--help"], dict(os.environ), tmp_path / "x.log") is None
    assert time.monotonic() - start < 5
    gone.wait()


def test_every_hook_target_is_a_class_attribute() -> None:
    """The prelauncher imports SGLang's model modules before the hooks are applied: safe only while
    each hook patches an attribute of a class (which those modules read through the class), not a
    module-level function they could have bound by name (`prelaunch._preimport`)."""
    import importlib
    import itertools

    from sgl_kvc.compat import standins

    standins.install()
    from sgl_kvc.adapter import hook_table
    from sgl_kvc.config import KvcConfig

    configs = [KvcConfig(policy="none", kv_cache_dtype="fp8_e4m3")] + [
        KvcConfig(policy="rkv", kv_head_budget=budget, kv_cache_dtype=dtype)
        for budget, dtype in itertools.product(("uniform", "variable", "layer"), ("auto", "fp8_e4m3"))
    ]
    targets = {hook.target for config in configs for hook in hook_table(config)}
    assert len(targets) > 10
    for target in sorted(targets):
        owner_path, attr = target.rsplit(".", 1)
        module_path, owner = owner_path.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_path), owner)
        assert isinstance(cls, type) and attr in vars(cls), target
