"""Every SGLang internal sgl-kvc relies on is checked against the installed SGLang at start-up
(`sgl_kvc.adapter.sglang_api`): names, the parameters hooks and calls rely on, and attributes."""

from __future__ import annotations

import pytest

from sgl_kvc.adapter import hook_table, sglang_api
from sgl_kvc.adapter.sglang_api import INTERNALS, Internal, problems
from sgl_kvc.config import KvcConfig


def test_the_installed_sglang_is_the_one_written_for() -> None:
    import sglang

    assert sglang.__version__ == sglang_api.SGLANG_VERSION
    assert problems(INTERNALS) == []


@pytest.mark.parametrize(
    "config",
    [
        KvcConfig(policy="none"),
        KvcConfig(policy="rkv", kv_cache_dtype="fp8_e4m3", kv_cache_memory_gb=0.01),
        KvcConfig(policy="snapkv", kv_head_budget="variable"),
        KvcConfig(policy="h2o", kv_head_budget="layer", kv_cache_dtype="fp8_e5m2"),
    ],
    ids=["none", "fp8", "variable", "layer-fp8"],
)
def test_every_hook_matches_its_target(config: KvcConfig) -> None:
    hooks = hook_table(config)
    assert hooks and problems([h.internal() for h in hooks]) == []


def test_a_changed_signature_or_a_lost_attribute_is_reported() -> None:
    found = problems([
        Internal("sglang.srt.managers.scheduler.Scheduler.update_running_batch", ("batches",)),
        Internal("sglang.srt.mem_cache.common.evict_from_tree_cache", ("tree_cache", "num_tokens")),
        Internal("sglang.srt.managers.schedule_batch.ScheduleBatch", attrs=("reqs", "no_such_field")),
        Internal("sglang.srt.managers.scheduler.Scheduler.no_such_method", ()),
    ])
    assert found == [
        "sglang.srt.managers.scheduler.Scheduler.update_running_batch: takes (batch), sgl-kvc needs (batches)",
        "sglang.srt.managers.schedule_batch.ScheduleBatch: no attribute no_such_field",
        "sglang.srt.managers.scheduler.Scheduler.no_such_method: missing",
    ]


def _type_checking_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every import under `if TYPE_CHECKING:` in sgl-kvc's code."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted([*(root / "sgl_kvc").rglob("*.py"), *(root / "server").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                for stmt in node.body:
                    if isinstance(stmt, ast.ImportFrom) and stmt.module:
                        found += [(path.name, stmt.module, alias.name) for alias in stmt.names]
    return found


def test_type_hints_name_what_the_installed_sglang_has() -> None:
    """The SGLang types named in hints (`Req`, `ScheduleBatch`, ...) are never imported at run
    time; a moved or renamed one is reported here instead of going stale."""
    import importlib

    imports = _type_checking_imports()
    assert any(module.startswith("sglang.") for _, module, _ in imports)
    missing = [f"{file}: {module}.{name}" for file, module, name in imports
               if not hasattr(importlib.import_module(module), name)]
    assert missing == []
