"""What every results file records about its run (benchmarks/common.py), without a benchmark."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.common import (
    NOT_RECORDED,
    SPEED_FLAGS,
    command,
    describe_machine,
    git_commit,
    metadata_markdown,
    run_metadata,
)

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma
"""


def test_cpu_model_flags_and_memory_from_proc() -> None:
    model, flags = common._cpuinfo(CPUINFO)
    assert model == "AMD EPYC 7B13" and {"avx2", "fma"} <= flags and "avx512f" not in flags
    assert common._memory_gib("MemTotal:       24608768 kB\nMemFree: 1 kB\n") == 23.5
    assert common._memory_gib("") is None


def test_run_metadata_describes_this_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "_read", lambda path: CPUINFO if path == "/proc/cpuinfo" else "MemTotal: 1048576 kB")
    meta = run_metadata("benchmarks.eviction", ["--configs", "rkv=--policy rkv", "none"])
    assert set(meta) == {"commit", "date", "machine", "gpu", "torch", "sglang", "command"}
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", meta["commit"]), meta["commit"]  # this checkout
    date = datetime.fromisoformat(meta["date"])
    assert date.utcoffset().total_seconds() == 0 and abs(datetime.now(timezone.utc) - date).total_seconds() < 60
    assert meta["machine"]["cpu"] == "AMD EPYC 7B13" and meta["machine"]["memory_gib"] == 1.0
    assert meta["machine"]["speed_flags"] == {f: f == "avx2" for f in SPEED_FLAGS}
    assert meta["command"] == "python -m benchmarks.eviction --configs 'rkv=--policy rkv' none"
    assert meta["gpu"] == "none" or meta["gpu"]  # a device name where CUDA is available
    assert meta["torch"] not in ("", None) and meta["sglang"] not in ("", None)


def test_command_defaults_to_this_process_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["/x/benchmarks/quality.py", "--quick"])
    assert command("benchmarks.quality") == "python -m benchmarks.quality --quick"
    assert command("benchmarks.quality", []) == "python -m benchmarks.quality"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_commit_is_dirty_only_when_tracked_files_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLKVC_COMMIT", raising=False)
    assert git_commit(tmp_path).startswith(NOT_RECORDED)  # not a git checkout
    monkeypatch.setenv("SGLKVC_COMMIT", "abc123")  # a copy of the tree run elsewhere names its commit
    assert git_commit(tmp_path) == "abc123 (SGLKVC_COMMIT)"
    monkeypatch.delenv("SGLKVC_COMMIT")
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked")  # e.g. a results file the run wrote
    assert git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert git_commit(tmp_path) == head + "-dirty"
    # a copy whose git folder is older than its files (the GPU machine's): the caller's word wins
    monkeypatch.setenv("SGLKVC_COMMIT", "abc123")
    assert git_commit(tmp_path) == "abc123 (SGLKVC_COMMIT)"


def test_markdown_header_names_every_field() -> None:
    meta = {
        "commit": "abc", "date": "2026-01-01T00:00:00+00:00", "gpu": "none", "torch": "2.13.0",
        "sglang": "0.5.23", "command": "python -m benchmarks.eviction",
        "machine": {"cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.5,
                    "speed_flags": {"avx2": True, "avx512f": False, "amx_tile": False}},
    }
    text = metadata_markdown(meta)
    for part in ("`abc`", "2026-01-01", "AMD EPYC, 2 cores, 23.5 GiB, CPU flags: avx2 (no avx512f, amx_tile)",
                 "GPU: none", "torch 2.13.0, sglang 0.5.23", "`python -m benchmarks.eviction`"):
        assert part in text, (part, text)
    # An old run whose metadata was recovered: what is missing says so.
    old = metadata_markdown({"machine": "AMD EPYC, 2 cores", "notes": "committed in 1234567"})
    assert old.count(NOT_RECORDED) == 6 and "Machine: AMD EPYC, 2 cores" in old and "1234567" in old
    assert describe_machine({"cpu": "x", "cores": 2, "memory_gib": NOT_RECORDED, "speed_flags": NOT_RECORDED}) == (
        f"x, 2 cores, memory {NOT_RECORDED}, CPU flags: {NOT_RECORDED}"
    )


def test_subpackages_from_another_checkout_are_named() -> None:
    """A clone served from PYTHONPATH still imports the installed checkout's kernels and server
    unless it links them: the metadata says where they came from."""
    from benchmarks.common import REPO, package_checkout, subpackage_checkouts

    if package_checkout() != REPO:
        pytest.skip("this checkout's tests run on another checkout's sgl_kvc (a shared venv)")
    assert subpackage_checkouts(REPO) == {}
    elsewhere = subpackage_checkouts(Path("/a/clone"))
    assert elsewhere == {"sgl_kvc.kernels": str(REPO), "sgl_kvc.server": str(REPO)}
    text = metadata_markdown({"commit": "abc", "sgl_kvc_from": "/a/clone", "subpackages_from": elsewhere})
    assert f"sgl_kvc.kernels from {REPO}" in text
