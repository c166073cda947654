"""Shared by the benchmark scripts: what produced a result, written into every results file.

`run_metadata(module)` returns, for the run in progress: the commit (`git rev-parse HEAD`, with
"-dirty" when tracked files differ from it), the date (UTC, ISO 8601), the machine (CPU model,
the CPU flags that decide CPU speed here, cores, memory), the GPU (or "none"), the torch and
sglang versions and the command. Each benchmark stores it under the key "meta" of its JSON and
prints `metadata_markdown(meta)` at the top of its .md. Call it when the run starts, before the
run writes into the repository, so its own output does not count as a change of the tree.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import contextlib
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Collection, Iterator

REPO = Path(__file__).resolve().parents[1]
# CPU flags that change how fast a CPU runs this project: AVX2 / AVX-512 for float32 matrix
# products; bfloat16 is emulated (several times slower) without AVX512-BF16 or AMX.
SPEED_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
NOT_RECORDED = "not recorded"


def git_commit(repo: Path = REPO) -> str:
    """`$SGLKVC_COMMIT` if set (a copy of the tree run elsewhere, e.g. by `.ci/gpu`, whose git
    folder, if any, may be older than the files); else HEAD's commit id, plus "-dirty" if tracked
    files differ from it (untracked files do not count, as with `git describe --dirty`); else
    "not recorded (...)"."""
    given = os.environ.get("SGLKVC_COMMIT")
    if given:
        return f"{given} (SGLKVC_COMMIT)"
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{NOT_RECORDED} (no git checkout)"
    return head + ("-dirty" if changes else "")


def _cpuinfo(text: str) -> tuple[str, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo's text."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _memory_gib(text: str) -> float | None:
    """MemTotal of /proc/meminfo's text, in GiB."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20), 1)  # kB
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_info() -> dict[str, Any]:
    """CPU model, which of `SPEED_FLAGS` it has, logical cores and memory (Linux /proc; the
    flags are "not recorded" where /proc/cpuinfo has none, e.g. on macOS)."""
    model, flags = _cpuinfo(_read("/proc/cpuinfo"))
    return {
        "cpu": model or platform.processor() or platform.machine() or NOT_RECORDED,
        "speed_flags": {f: f in flags for f in SPEED_FLAGS} if flags else NOT_RECORDED,
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(_read("/proc/meminfo")) or NOT_RECORDED,
        "os": platform.system(),
    }


def gpu_name() -> str:
    try:
        import torch
    except ImportError:
        return "none"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line as a user would type it: `python -m MODULE ARGS` (ARGS: `argv`, or this
    process's own arguments)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *([shlex.join(args)] if args else [])])


def package_checkout() -> Path:
    """The checkout whose `sgl_kvc` this process (and the servers it starts) imports: with the
    project's editable install that is the installed checkout, not necessarily this script's
    (a clone run with the same venv serves the installed code unless PYTHONPATH names the clone)."""
    return _checkout_of("sgl_kvc") or REPO


def _checkout_of(package: str) -> Path | None:
    """The folder above the package's own (None where it cannot be found)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    return Path(spec.origin).resolve().parents[1] if spec and spec.origin else None


def subpackage_checkouts(code: Path) -> dict[str, str]:
    """`sgl_kvc.kernels` and `sgl_kvc.server` (the repository's `kernels/` and `server/`,
    mapped by the install) that do not come from `code`: a clone on PYTHONPATH still imports
    the installed checkout's, unless the clone links `sgl_kvc/kernels` and `sgl_kvc/server` to
    its own folders."""
    out = {}
    for name in ("sgl_kvc.kernels", "sgl_kvc.server"):
        where = _checkout_of(name)
        if where is not None and where != code and where.parent != code:
            out[name] = str(where)
    return out


def run_metadata(module: str, argv: list[str] | None = None) -> dict[str, Any]:
    """What produced this run's results (see the module doc): the commit is that of the code
    that serves, and `sgl_kvc_from` says where it was when that is not this checkout
    (`subpackages_from`: where its kernels or server came from, when from elsewhere still)."""
    code = package_checkout()
    mixed = subpackage_checkouts(code)
    return {
        "commit": git_commit(code),
        **({"sgl_kvc_from": str(code)} if code != REPO else {}),
        **({"subpackages_from": mixed} if mixed else {}),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "gpu": gpu_name(),
        "torch": _version("torch"),
        "sglang": _version("sglang"),
        "command": command(module, argv),
    }


def describe_machine(m: dict[str, Any] | str) -> str:
    """One line for `machine_info()`'s dict (a string is returned as it is)."""
    if isinstance(m, str):
        return m
    parts = [str(m.get("cpu", NOT_RECORDED))]
    cores, mem = m.get("cores"), m.get("memory_gib")
    parts.append(f"{cores} cores" if isinstance(cores, int) else f"cores {cores or NOT_RECORDED}")
    parts.append(f"{mem} GiB" if isinstance(mem, (int, float)) else f"memory {mem or NOT_RECORDED}")
    flags = m.get("speed_flags", NOT_RECORDED)
    if isinstance(flags, dict):
        have = [f for f, on in flags.items() if on]
        lack = [f for f, on in flags.items() if not on]
        text = "CPU flags: " + (", ".join(have) if have else "none of " + ", ".join(flags))
        if have and lack:
            text += " (no " + ", ".join(lack) + ")"
        parts.append(text)
    else:
        parts.append(f"CPU flags: {flags}")
    return ", ".join(parts)


def metadata_markdown(meta: dict[str, Any]) -> str:
    """The lines every results .md starts with."""
    lines = [
        f"- Commit: `{meta.get('commit', NOT_RECORDED)}`"
        + (f" (sgl_kvc from {meta['sgl_kvc_from']})" if meta.get("sgl_kvc_from") else "")
        + "".join(f"; {k} from {v}" for k, v in (meta.get("subpackages_from") or {}).items()),
        f"- Date: {meta.get('date', NOT_RECORDED)}",
        f"- Machine: {describe_machine(meta.get('machine', NOT_RECORDED))}",
        f"- GPU: {meta.get('gpu', NOT_RECORDED)}",
        f"- Versions: torch {meta.get('torch', NOT_RECORDED)}, sglang {meta.get('sglang', NOT_RECORDED)}",
        f"- Command: `{meta.get('command', NOT_RECORDED)}`",
    ]
    if meta.get("notes"):
        lines.append(f"- Notes: {meta['notes']}")
    return "\n".join(lines) + "\n"


def median_ms(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """The median milliseconds of each of `fns`, timed interleaved (one call of each per round,
    the order turned every round), so that the machine's drift meets them alike."""
    for _ in range(max(3, reps // 10)):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for r in range(reps):
        order = list(range(len(fns)))
        for i in order[r % len(fns):] + order[: r % len(fns)]:
            t = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t)
    return [1e3 * statistics.median(ts) for ts in times]


def module_at(commit: str, path: str, repo: Path = REPO) -> ModuleType:
    """The source file `path` as it was at `commit`, run as a module of its own beside this
    checkout's packages (what a micro-benchmark times against)."""
    source = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"],
                            check=True, capture_output=True, text=True).stdout
    module = ModuleType(f"{Path(path).stem}_{commit}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def write_table(out: Path, name: str, meta: dict[str, Any], setup: dict[str, Any], rows: list[dict],
                title: str, caption: str) -> str:
    """`out/NAME.json` (meta, setup, rows) and `out/NAME.md` (the metadata, then the rows as one
    table under `title`, after the setup and `caption`); the table's markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "setup": setup, "rows": rows}, indent=1) + "\n")
    head = list(rows[0])
    body = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                      *("| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows)])
    (out / f"{name}.md").write_text(
        f"{metadata_markdown(meta)}\n## {title}\n\nSetup: `{json.dumps(setup)}`; {caption}\n\n{body}\n")
    return body


def machine() -> str:
    """A short description of the machine for plot titles."""
    m = machine_info()
    return f"{m['cpu']}, {m['cores']} cores, {m['os']} (GPU: {gpu_name()})"


@contextmanager
def commit_launcher(commit: str, repo: Path = REPO) -> Iterator[tuple[list[str], dict[str, str], str]]:
    """The launcher of sgl-kvc at another commit of this repository, beside the working tree's, for
    before / after rows in one run: that commit's tree (a git worktree) staged as the package
    installs (`kernels/` and `server/` are its subpackages, pyproject's package-dir) and run with
    Python's -P, so that the working directory's `sgl_kvc` does not shadow it. Yields the command,
    the environment it needs and the commit's short name; removes the worktree after."""
    import shutil
    import tempfile

    short = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", commit], check=True,
                           capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix=f"sgl-kvc-{short}-"))
    tree, stage = tmp / "tree", tmp / "stage" / "sgl_kvc"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree), commit], check=True)
    try:
        stage.mkdir(parents=True)
        for f in (tree / "sgl_kvc").iterdir():
            (stage / f.name).symlink_to(f)
        for sub in ("kernels", "server"):
            (stage / sub).symlink_to(tree / sub)
        yield [sys.executable, "-P", "-m", "sgl_kvc.launch"], {"PYTHONPATH": str(stage.parent)}, short
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def config_runs(names: list[str], configs: dict[str, tuple[list[str], Any]], launch: list[str],
                baseline: str | None, compared: Collection[str] | None = None
                ) -> Iterator[list[tuple[str, list[str], Any, dict[str, str] | None]]]:
    """(label, command, request extras, environment) of each config of `names`, in order; with a
    `baseline` commit, each compressing one (not `plain`; of `compared` only, where given) followed
    by the same flags on sgl-kvc at that commit (`NAME@COMMIT`, `commit_launcher`). `configs`:
    name -> (command starting with `launch`, extras)."""
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(commit_launcher(baseline)) if baseline else None
        runs = []
        for name in names:
            flags, extra = configs[name]
            runs.append((name, flags, extra, None))
            if other is not None and name != "plain" and (compared is None or name in compared):
                # the same flags on the other commit's launcher
                before, env, short = other
                runs.append((f"{name}@{short}", [*before, *flags[len(launch):]], extra, env))
        yield runs
