"""Reproducible wheel rewriting for the GPU kit: drop entries, rewrite RECORD, fixed zip metadata.

Also decides which SGLang model files the GPU smoke path can do without: SGLang's model registry
imports every `sglang.srt.models.*` module and tolerates import errors, so model files that no
module on the serving path imports at module level can go (they are ~1.5 MiB and many have
CUDA-only module-level imports). Stdlib only.
"""

from __future__ import annotations

import ast
import base64
import csv
import hashlib
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

# 1980-01-01, the earliest zip timestamp: every entry gets it, so equal input gives equal bytes.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)

# Entries of the sglang wheel the kit never needs (FEASIBILITY.md section 4):
SGLANG_DROP_PATTERNS: tuple[str, ...] = (
    # optional Rust extensions: the Rust HTTP server (SGLANG_RUST_SERVER), the Rust bench client,
    # the gRPC server (--grpc-port) and the multimodal preprocessors
    r"sglang/srt/rust_extensions/_(server|bench|grpc|multimodal)\.[^/]*\.so",
    # the Rust radix-tree core: it links libtorch C++ symbols of another torch build; the kit
    # runs SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python and SGLang falls back without it
    r"sglang/srt/mem_cache/rust_tree_core/[^/]*\.so",
    r"sglang/multimodal_gen/.*",  # diffusion serving
    r"sglang/benchmark/.*",
)

# Where the serving path starts: the HTTP server, scheduler and detokenizer processes, the two
# non-FlashInfer attention backends, and the model files the kit must serve (Llama; Mistral is a
# Llama subclass the project documents as supported).
SGLANG_ROOTS: tuple[str, ...] = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.torch_native_backend",
    # imported inside a function by the decode CUDA-graph runner (`_forks_draft_metadata_prep`) at
    # every capture, plain SGLang's default on CUDA: it imports `models.deepseek_v2` at module level
    "sglang.srt.layers.attention.deepseek_v4_backend",
    "sglang.srt.models.llama",
    "sglang.srt.models.mistral",
    "sglang.srt.models.registry",
    "sglang.srt.models.utils",
)
MODELS_PREFIX = "sglang/srt/models/"


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


@dataclass(frozen=True)
class Entry:
    name: str
    data: bytes
    executable: bool = False


def _order(name: str) -> tuple[int, str]:
    # .dist-info last (as the wheel spec recommends), its RECORD the very last entry
    dist_info = ".dist-info/" in name
    return (int(dist_info) + int(dist_info and name.endswith("/RECORD")), name)


def write_wheel(path: Path, entries: Iterable[Entry], dist_info: str) -> None:
    """Write a wheel with sorted entries, fixed timestamps and modes, and a fresh RECORD."""
    record_name = f"{dist_info}/RECORD"
    files = sorted((e for e in entries if e.name != record_name), key=lambda e: _order(e.name))
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")  # csv: some sglang file names hold commas
    writer.writerows((e.name, record_hash(e.data), len(e.data)) for e in files)
    writer.writerow((record_name, "", ""))
    files.append(Entry(record_name, record.getvalue().encode("utf-8")))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w") as out:
        for e in files:
            info = zipfile.ZipInfo(e.name, date_time=ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, so that the mode below is honoured
            info.external_attr = (0o100755 if e.executable else 0o100644) << 16
            out.writestr(info, e.data, compresslevel=9)
    tmp.replace(path)


def dist_info_dir(names: Iterable[str]) -> str:
    found = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    if len(found) != 1:
        raise ValueError(f"expected one .dist-info folder, found {sorted(found)}")
    return found.pop()


@dataclass(frozen=True)
class SlimResult:
    kept: list[str]
    dropped: list[str]


def slim_wheel(src: Path, dst: Path, drop: Callable[[str], bool]) -> SlimResult:
    """Copy wheel `src` to `dst` without the entries `drop` selects (RECORD rewritten)."""
    kept: list[Entry] = []
    dropped: list[str] = []
    with zipfile.ZipFile(src) as z:
        infos = [i for i in z.infolist() if not i.is_dir()]
        dist_info = dist_info_dir(i.filename for i in infos)
        for info in infos:
            if info.filename == f"{dist_info}/RECORD":
                continue
            if drop(info.filename):
                dropped.append(info.filename)
                continue
            mode = info.external_attr >> 16
            kept.append(Entry(info.filename, z.read(info), bool(mode & 0o111)))
    write_wheel(dst, kept, dist_info)
    return SlimResult(sorted(e.name for e in kept), sorted(dropped))


def pattern_rule(patterns: Iterable[str]) -> Callable[[str], bool]:
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    return lambda name: regex.fullmatch(name) is not None


def _module_name(path: str) -> str:
    mod = path[: -len(".py")].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def module_level_imports(source: bytes, module: str, is_package: bool) -> set[str]:
    """Modules a file imports when it is imported: every import statement outside a function
    body (branches of `if`/`try` included, as if all were taken)."""
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                out.add(base)
                out.update(f"{base}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    visit([s for s in sub if isinstance(s, ast.stmt | ast.excepthandler)])

    visit(ast.parse(source).body)
    return out


def reachable_modules(sources: dict[str, bytes], roots: Iterable[str]) -> set[str]:
    """Modules (of `sources`: wheel path -> file bytes) reachable from `roots` through
    module-level imports; importing `a.b.c` also imports `a` and `a.b`."""
    files = {_module_name(p): p for p in sources if p.endswith(".py")}
    seen: set[str] = set()
    todo = [r for r in roots if r in files]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = files[mod]
        try:
            imports = module_level_imports(sources[path], mod, path.endswith("__init__.py"))
        except SyntaxError:
            continue
        for name in imports:
            parts = name.split(".")
            todo.extend(p for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1))
                        if p in files and p not in seen)
    return seen


def unused_model_files(paths: Iterable[str], reachable: set[str]) -> set[str]:
    """Files under sglang/srt/models/ whose model module (a file or a subpackage) is not in
    `reachable`."""
    kept_units = {m.split(".")[3] for m in reachable if m.startswith("sglang.srt.models.")}
    out = set()
    for path in paths:
        rest = path[len(MODELS_PREFIX):] if path.startswith(MODELS_PREFIX) else None
        if not rest or rest == "__init__.py":
            continue
        unit = rest.split("/", 1)[0].removesuffix(".py")
        if unit not in kept_units:
            out.add(path)
    return out


def sglang_drop_rule(wheel: Path) -> Callable[[str], bool]:
    """What to leave out of the sglang wheel: the fixed patterns plus unused model files; fails
    if a module on the serving path would be dropped."""
    with zipfile.ZipFile(wheel) as z:
        sources = {n: z.read(n) for n in z.namelist() if n.endswith(".py")}
        names = z.namelist()
    by_pattern = pattern_rule(SGLANG_DROP_PATTERNS)
    reachable = reachable_modules(sources, SGLANG_ROOTS)
    models = unused_model_files(names, reachable)
    needed = {p for p in sources if _module_name(p) in reachable}
    clash = sorted(p for p in needed if by_pattern(p) or p in models)
    if clash:
        raise RuntimeError(f"slimming would drop modules the serving path imports: {clash[:10]}")
    return lambda name: by_pattern(name) or name in models
