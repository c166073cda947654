"""README.md's table of what is supported, checked against the live tests behind it, both ways.

The table ("What is supported") has a row per policy and a column per compression moment or setting;
a cell says T where a live-server test (tests/e2e) runs that policy there, – where none does, n/a
where it cannot apply. `RUNS` below says what each such test runs: the test (file::function) and a
function from one of its parametrizations (argument -> value, and its module) to the cells it covers.
The policies are read from the test itself wherever it lists them (its `parametrize` values, or a
constant of its module), so a policy taken out of a test takes its cells out with it; a column that
needs a flag (`--tp-size 2`, an `fp8_e...` dtype, `"variable"` head budgets) needs it in the test's
module, and a policy named here needs its name in the module.

1. Every T cell is covered by a test in `RUNS`.
2. Every cell a test in `RUNS` covers says T (a test added to `RUNS` that covers a cell marked – fails).

A row is the policy a request names, as `policy` or `prompt_policy` (per request or as the server's
flag): the chunk and prefill moments count for its prompt policy, or for its `policy` where it names
none (even where that policy hands prompts to another: `--policy rkv` compresses them with SnapKV, as
README says), decode and preempt for its policy, and the settings (selection, head budgets, FP8, TP)
for both. The request-mix fuzz test and the hostile-client suite draw their policies at random and are
not counted. A new live test of a policy somewhere the table says –: add it to `RUNS`, mark the cell T.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
E2E = REPO / "tests" / "e2e"

COLUMNS = ("chunk", "prefill", "decode", "preempt", "per-head uniform", "shared", "variable", "layer", "FP8",
           "TP = 2")  # fmt: skip
SYMBOLS = {"T", "–", "n/a", ""}  # tested, not run, cannot apply; blank: `none` compresses nothing
PROMPT_MOMENTS, DECODE_MOMENTS = {"chunk", "prefill"}, {"decode", "preempt"}
UNIFORM = "per-head uniform"
# What a test's module must say for the test to run in that column (a server flag, a request setting).
FLAGS = {"chunk": '"--chunked-prefill-size"', "preempt": '"preempt"', "shared": '"shared"',
         "variable": '"variable"', "layer": '"layer"', "FP8": '"fp8_e', "TP = 2": '"--tp-size", "2"'}  # fmt: skip

Cell = tuple[str, str]  # (policy, column)


def serves(kvc: str | dict, *columns: str) -> set[Cell]:
    """The cells covered by a request that names `kvc` (a policy, or `{"policy", "prompt_policy"}`)
    and is compressed in each of `columns`."""
    kvc = {"policy": kvc} if isinstance(kvc, str) else kvc
    policy = kvc.get("policy")
    prompt = kvc.get("prompt_policy") or policy
    cells = set()
    for column in columns:
        assert column in COLUMNS, column
        names = {prompt} if column in PROMPT_MOMENTS else {policy} if column in DECODE_MOMENTS else {policy, prompt}
        cells |= {(name, column) for name in names if name is not None}
    return cells


def each(kvcs: Iterable[str | dict], *columns: str) -> set[Cell]:
    return set().union(*(serves(kvc, *columns) for kvc in kvcs))


def selection(p: dict) -> str:
    return UNIFORM if p["selection"] == "per-head" else "shared"


# test_variable_budget_serving.py's two servers: variable head budgets in bf16, layer ones in FP8.
HEAD_BUDGETS = {"bf16": ("variable",), "fp8": ("layer", "FP8")}

RUNS: dict[str, Callable[[dict, ModuleType], set[Cell]]] = {
    # one R-KV server, the policy chosen per request
    "test_compression.py::test_logits_after_compaction_match_dense_reference":
        lambda p, m: serves("rkv", "prefill", "decode", selection(p)),
    "test_compression.py::test_every_policy_compresses_per_request":
        lambda p, m: serves(p["policy"], "prefill", "decode", UNIFORM),
    "test_compression.py::test_request_chooses_its_prompt_policy":
        lambda p, m: serves({"policy": p["policy"], "prompt_policy": p["prompt_policy"]}, "prefill", "decode"),
    # compression between chunks: when the pool runs short, and after every chunk (bf16 and FP8 servers)
    "test_chunk_pressure.py::test_the_default_server_answers_a_prompt_of_four_times_its_pool":
        lambda p, m: serves("rkv", "chunk", UNIFORM),
    "test_chunk_compression.py::test_prompts_four_times_the_pool_are_served_within_budget_plus_one_chunk":
        lambda p, m: serves("rkv", "chunk", UNIFORM, "FP8"),
    "test_chunk_compression.py::test_expected_attention_reads_every_chunk_and_lets_go_of_it":
        lambda p, m: each([{"policy": "expected_attention"}, {"policy": "rkv", "prompt_policy": "expected_attention"}],
                          "chunk", UNIFORM, "FP8"),
    "test_chunk_compression.py::test_later_chunks_attend_to_the_kept_entries_at_logical_positions":
        lambda p, m: serves("rkv", "chunk", "FP8", selection(p)),
    # every policy per request on long prompts; the concurrent ones generate 48 tokens past a prompt
    # cut to budget 64 with buffer 32: a decode pass each
    "test_long_prompts.py::test_long_prompt_every_policy":
        lambda p, m: each(m.POLICIES, "chunk", "prefill", UNIFORM),
    "test_long_prompts.py::test_long_prompts_concurrently":
        lambda p, m: each(m.POLICIES, "decode", UNIFORM),
    "test_scheduler_moments.py::test_compress_before_preempt_and_admit_by_footprint":
        lambda p, m: serves("rkv", "preempt", UNIFORM),
    "test_variable_budget_serving.py::test_variable_budgets_match_the_dense_reference":
        lambda p, m: serves(p["policy"], "prefill", "decode", "variable"),
    "test_variable_budget_serving.py::test_concurrent_variable_requests_complete_and_free_everything":
        lambda p, m: each(["rkv", "h2o", "kvcompress", "streamingllm"], "decode", *HEAD_BUDGETS[p["name"]]),
    "test_variable_budget_serving.py::test_fp8_layer_budgets_match_a_dense_fp8_reference":
        lambda p, m: serves("rkv", "prefill", "decode", "layer", "FP8"),
    "test_variable_budget_serving.py::test_chunks_after_a_variable_compaction_attend_through_the_tables":
        lambda p, m: serves({"prompt_policy": "kvzip"} if p["policy"] == "kvzip" else p["policy"],
                            "chunk", *HEAD_BUDGETS[p["name"]]),
    "test_variable_budget_serving.py::test_a_shared_request_on_the_unit_pool_matches_the_dense_reference":
        lambda p, m: serves("snapkv", "prefill", "decode", "shared", "variable"),
    "test_fp8_serving.py::test_fp8_rkv_logits_match_a_dense_fp8_reference":
        lambda p, m: serves("rkv", "prefill", "decode", UNIFORM, "FP8"),
    "test_fp8_serving.py::test_accuracy_against_the_bf16_cache":
        lambda p, m: serves("none", "FP8"),
    "test_fp8_serving.py::test_a_shared_document_matches_a_dense_fp8_reference":  # the default: KVzip sorted once
        lambda p, m: serves({"prompt_policy": "kvzip"}, "FP8"),
    "test_tensor_parallel.py::test_ranks_keep_the_same_tokens_or_choose_per_head":
        lambda p, m: each(m.POLICIES, "chunk", "prefill", "decode", UNIFORM, "shared", "TP = 2"),
    "test_tensor_parallel.py::test_kvzip_reconstruction_runs_on_both_ranks_in_step":
        lambda p, m: serves({"prompt_policy": "kvzip"}, "chunk", "prefill", UNIFORM, "shared", "TP = 2"),
    "test_tensor_parallel.py::test_requests_wait_for_a_document_alike_on_both_ranks":
        lambda p, m: serves({"prompt_policy": "streamingllm"}, UNIFORM, "TP = 2"),
    "test_kvzip_serving.py::test_prompts_read_in_chunks_repeat_their_whole_context_at_each_pass":
        lambda p, m: serves({"prompt_policy": "kvzip"}, "chunk", "prefill", UNIFORM),
    "test_documents.py::test_variable_head_budgets":
        lambda p, m: serves({"prompt_policy": "kvzip"}, "variable"),
    "test_documents.py::test_a_second_request_prefills_only_its_suffix":
        lambda p, m: serves({"prompt_policy": "kvzip"}, {"uniform": UNIFORM, "whole": "layer"}[p["name"]]),
}  # fmt: skip


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def readme_table(text: str | None = None) -> dict[str, dict[str, str]]:
    """policy -> column -> cell of README's support table (of `text` instead, when given)."""
    lines = (README.read_text() if text is None else text).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| policy |"))
    assert tuple(_cells(lines[start])[1:]) == COLUMNS, _cells(lines[start])
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        first, *rest = _cells(line)
        name = re.match(r"`(\w+)`", first)
        assert name and len(rest) == len(COLUMNS), line
        rows[name.group(1)] = dict(zip(COLUMNS, rest))
    return rows


@functools.cache
def e2e_module(file: str) -> ModuleType:
    """The e2e test module, imported under a name of its own (nothing in it runs: no server starts)."""
    spec = importlib.util.spec_from_file_location(f"readme_table_{Path(file).stem}", E2E / file)
    assert spec and spec.loader, file
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parametrizations(fn: Callable[..., Any]) -> list[dict[str, Any]]:
    """Every combination of a test function's `parametrize` values, as argument -> value."""
    combos: list[dict[str, Any]] = [{}]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        rows = []
        for value in values:
            if type(value).__name__ == "ParameterSet":  # pytest.param(...)
                value = value.values
            elif len(names) == 1:
                value = (value,)
            rows.append(dict(zip(names, value)))
        combos = [{**c, **r} for c in combos for r in rows]
    return combos


def _test_function(test: str) -> tuple[ModuleType, Callable[..., Any]]:
    file, name = test.split("::")
    module = e2e_module(file)
    return module, getattr(module, name)


@functools.cache
def covered() -> dict[Cell, list[str]]:
    """(policy, column) -> the tests in RUNS that cover it."""
    out: dict[Cell, list[str]] = {}
    for test, cells in RUNS.items():
        module, fn = _test_function(test)
        for p in parametrizations(fn):
            for cell in cells(p, module):
                out.setdefault(cell, [])
                if test not in out[cell]:
                    out[cell].append(test)
    return out


def test_the_table_has_a_row_per_policy_and_known_cells() -> None:
    from sgl_kvc.policies import available_policies

    table = readme_table()
    assert sorted(table) == sorted(available_policies())
    odd = {(p, c, v) for p, row in table.items() for c, v in row.items() if v not in SYMBOLS}
    assert not odd, f"cells other than {sorted(SYMBOLS)}: {sorted(odd)}"


def test_every_T_is_run_by_a_live_test() -> None:
    table = readme_table()
    missing = [f"{p} / {c}" for p, row in table.items() for c, v in row.items() if v == "T" and (p, c) not in covered()]
    assert not missing, (
        "README's support table says T (tested by a live server) where no test in RUNS "
        "(tests/unit/test_readme_table.py) runs that policy there; mark it – or add the test:\n" + "\n".join(missing)
    )


def test_every_combination_a_live_test_runs_says_T() -> None:
    table = readme_table()
    wrong = [f"{p} / {c}: {table.get(p, {}).get(c, 'no such row')!r}, run by {tests}"
             for (p, c), tests in sorted(covered().items()) if table.get(p, {}).get(c) != "T"]  # fmt: skip
    assert not wrong, "README's support table does not say T where a live test runs:\n" + "\n".join(wrong)


@pytest.mark.parametrize("test", list(RUNS))
def test_each_run_names_a_live_test_that_can_run_it(test: str) -> None:
    """The test exists, starts a live server (marked e2e), and its module has the flags and the
    policy names of the cells it covers."""
    module, fn = _test_function(test)
    assert callable(fn) and fn.__name__.startswith("test_"), test
    marks = getattr(module, "pytestmark", [])
    assert any(m.name == "e2e" for m in (marks if isinstance(marks, list) else [marks])), f"{test}: not marked e2e"
    source = inspect.getsource(module)
    # the names its source gives, and those its constants compute (`decode_policies()`)
    names = source + repr([v for k, v in vars(module).items() if k.isupper()])
    cells = set().union(*(RUNS[test](p, module) for p in parametrizations(fn)))
    assert cells, test
    for policy, column in sorted(cells):
        assert f"'{policy}'" in names or f'"{policy}"' in names, f"{test}: its module never names {policy!r}"
        assert FLAGS.get(column, "") in source, f"{test}: {column} needs {FLAGS[column]} in its module"


def test_the_rules() -> None:
    assert serves("rkv", "prefill", "decode", "FP8") == {("rkv", "prefill"), ("rkv", "decode"), ("rkv", "FP8")}
    assert serves({"policy": "rkv", "prompt_policy": "kvzip"}, "chunk", "decode", "shared") == {
        ("kvzip", "chunk"), ("rkv", "decode"), ("rkv", "shared"), ("kvzip", "shared")}
    assert serves({"prompt_policy": "kvzip"}, "prefill", "decode") == {("kvzip", "prefill")}

    @pytest.mark.parametrize(("name", "policy"), [("a", "rkv"), pytest.param("b", "h2o")])
    @pytest.mark.parametrize("selection", ["per-head", "shared"])
    def fn() -> None: ...

    assert len(parametrizations(fn)) == 4
    assert {"name": "b", "policy": "h2o", "selection": "shared"} in parametrizations(fn)
    text = ("| policy | " + " | ".join(COLUMNS) + " |\n| --- |" + " :-: |" * len(COLUMNS) + "\n"
            "| `rkv` (R-KV) | T | T | T | T | T | T | T | T | T | – |\n"
            "| `none` (plain SGLang) | | | | | | | | | T | – |\n\nafter")  # fmt: skip
    table = readme_table(text)
    assert table["rkv"]["TP = 2"] == "–" and table["none"]["FP8"] == "T" and table["none"]["chunk"] == ""
