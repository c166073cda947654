"""The launcher's argument handling, without starting a server."""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
import sys

import pytest

from sgl_kvc.config import KvcConfig
from sgl_kvc.launcher.cli import parse_args
from sgl_kvc.launcher.sglang_argv import CPU_DEFAULTS, EMULATED_BF16_DTYPE, GPU_DEFAULTS, build_sglang_argv


def _flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cpu_defaults_filled_in(tmp_path, monkeypatch) -> None:
    import sgl_kvc.model

    # No --model-path: SmolLM2 under its real name (the conversion itself is tested elsewhere).
    monkeypatch.setattr(sgl_kvc.model, "ensure_smollm2", lambda: tmp_path / "smollm2")
    argv = build_sglang_argv([], on_gpu=False)
    for flag, value in CPU_DEFAULTS.items():
        assert flag in argv and (value is None or _flag_value(argv, flag) == value)
    assert "--radix-cache-backend" not in argv  # --policy none: SGLang's own prefix cache
    assert _flag_value(argv, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert _flag_value(argv, "--model-path") == str(tmp_path / "smollm2")


@pytest.mark.parametrize("given", [["--model-path", "demo"], ["--model-path=demo"], ["--model", "demo"]])
def test_demo_alias_serves_the_random_model(given: list[str], tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SGLKVC_CACHE", str(tmp_path))
    argv = build_sglang_argv([*given, "--port", "1"], on_gpu=False)
    assert "demo" in _flag_value(argv, "--served-model-name")
    assert argv.count("--model-path") == 1 and "--model" not in argv
    assert not any(a.endswith("=demo") for a in argv)
    assert _flag_value(argv, "--model-path").startswith(str(tmp_path))
    assert _flag_value(argv, "--port") == "1"


def test_user_flags_win_over_defaults() -> None:
    user = ["--model-path", "/models/x", "--attention-backend=triton", "--max-total-tokens", "99"]
    argv = build_sglang_argv(user, on_gpu=False)
    assert argv.count("--attention-backend") == 0  # given in --flag=value form, not duplicated
    assert "--attention-backend=triton" in argv
    assert argv.count("--max-total-tokens") == 1 and _flag_value(argv, "--max-total-tokens") == "99"
    assert "--served-model-name" not in argv  # a real model keeps its own name


def test_gpu_defaults() -> None:
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=True)
    for flag, value in GPU_DEFAULTS.items():
        assert _flag_value(argv, flag) == value
    assert "--device" not in argv
    # the offline GPU kit's sgl_kernel stub: no breakable prefill graphs (they call sgl_kernel)
    assert "--disable-prefill-cuda-graph" in build_sglang_argv(["--model-path", "/m"], on_gpu=True, gpu_kit=True)
    assert "--disable-prefill-cuda-graph" not in argv
    # without FlashInfer (an AMD GPU, the offline GPU kit): SGLang's Triton backend
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=True, flashinfer=False)
    assert _flag_value(argv, "--attention-backend") == "triton"
    given = build_sglang_argv(["--model-path", "/m", "--attention-backend", "torch_native"], on_gpu=True,
                              flashinfer=False)
    assert _flag_value(given, "--attention-backend") == "torch_native" and given.count("--attention-backend") == 1


def test_compressing_policies_pin_the_tree_compaction_is_written_for() -> None:
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=False, compressing=True)
    assert _flag_value(argv, "--radix-cache-backend") == "sgl_kvc"
    argv = build_sglang_argv(["--model-path", "/m", "--disable-radix-cache"], on_gpu=False, compressing=True)
    assert "--radix-cache-backend" not in argv


def test_our_flags_are_removed_from_sglang_argv() -> None:
    config, rest = parse_args(["--policy", "none", "--port", "31000"])
    assert config == KvcConfig(policy="none")
    assert rest == ["--port", "31000"]


def test_unknown_policy_is_a_usage_error() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "sgl_kvc.launch", "--policy", "bogus"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 2
    assert "--policy" in r.stderr and "invalid choice" in r.stderr


def test_config_roundtrips_through_env(monkeypatch) -> None:
    # set first, so that the variable `to_env` writes is removed after the test: left behind, it
    # made this worker's environment differ from its prelauncher's, which then refused every
    # server a later test in that worker started (test_prelaunch failed)
    monkeypatch.setenv("SGLKVC_CONFIG", "")
    monkeypatch.delenv("SGLKVC_CONFIG")
    assert KvcConfig.from_env() is None
    KvcConfig(policy="none").to_env()
    assert KvcConfig.from_env() == KvcConfig(policy="none")


def test_config_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        KvcConfig(policy="bogus")


@pytest.mark.e2e
def test_help_lists_our_flags() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "sgl_kvc.launch", "--help"],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ours, _, sglang_part = r.stdout.partition("SGLang server flags")
    assert "--policy" in ours and "sgl-kvc" in ours
    assert "--model-path" in sglang_part and "--radix-cache-backend" in sglang_part


def test_sglang_is_first_imported_as_a_cpu_engine() -> None:
    """The launcher reads SGLang's flags with SGLang's parser, which imports SGLang: on a CPU it
    must say `SGLANG_USE_CPU_ENGINE` first, since SGLang's modules read their device once, at
    import (too late, its rotary embedding asked for vLLM's kernel with `--tp 2`)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine is no CPU engine")
    code = (
        "import importlib.abc, os, sys\n"
        "seen = []\n"
        "class Spy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sglang' and not seen: seen.append(os.environ.get('SGLANG_USE_CPU_ENGINE'))\n"
        "sys.meta_path.insert(0, Spy())\n"
        "from sgl_kvc.launcher import serve\n"
        "def stop(*args, **kwargs): print('AT IMPORT', seen); raise SystemExit(0)\n"
        "serve.build_sglang_argv = stop\n"  # the name `main` calls, once the flags are read
        "serve.main(['--model-path', 'demo', '--policy', 'rkv', '--tp', '2'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "AT IMPORT ['1']" in r.stdout, r.stdout[-2000:]


def test_compressing_policy_disables_overlap_schedule() -> None:
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=False, compressing=True)
    assert "--disable-overlap-schedule" in argv
    assert "--disable-overlap-schedule" not in build_sglang_argv(["--model-path", "/m"], on_gpu=False)


def test_compression_flags_parse_into_config() -> None:
    config, rest = parse_args(
        ["--policy", "rkv", "--kv-budget", "64", "--kv-buffer", "32", "--kv-window", "4",
         "--rkv-lambda", "0.2", "--sink-tokens", "2", "--compress-on", "decode,preempt", "--port", "1"]
    )
    assert rest == ["--port", "1"]
    assert (config.policy, config.kv_budget, config.kv_buffer, config.kv_window) == ("rkv", 64, 32, 4)
    assert config.compress_on == ("decode", "preempt") and config.compressing
    params = config.policy_params()
    assert (params.budget, params.rkv_lambda, params.sink_tokens) == (64, 0.2, 2)
    assert params.rkv_exemption == "own"
    assert parse_args(["--rkv-exemption", "recent"])[0].policy_params().rkv_exemption == "recent"
    assert params.keep_recent == 0 and params.recent_kept == 4
    recent = parse_args(["--kv-keep-recent", "32"])[0].policy_params()
    assert (recent.window, recent.keep_recent, recent.recent_kept) == (8, 32, 32)


def test_prompt_policy_flag() -> None:
    """auto: the policy's own prompt policy (R-KV, a decode-time method: SnapKV); a policy
    given by name compresses every prompt of the server."""
    assert parse_args(["--policy", "rkv"])[0].prompt_policy_name == "snapkv"
    assert parse_args(["--policy", "h2o"])[0].prompt_policy_name == "h2o"
    config = parse_args(["--policy", "rkv", "--prompt-policy", "kvcompress"])[0]
    assert (config.prompt_policy, config.prompt_policy_name) == ("kvcompress", "kvcompress")
    assert parse_args(["--policy", "h2o", "--prompt-policy", "snapkv"])[0].prompt_policy_name == "snapkv"
    # the query-agnostic scorers: policies of their own, and prompt policies under any policy
    assert parse_args(["--policy", "expected_attention"])[0].prompt_policy_name == "expected_attention"
    assert parse_args(["--policy", "keydiff"])[0].prompt_policy_name == "keydiff"
    for policy in ("rkv", "h2o", "batchmax", "kvcompress"):
        for prompt in ("expected_attention", "keydiff"):
            assert parse_args(["--policy", policy, "--prompt-policy", prompt])[0].prompt_policy_name == prompt


def test_flag_defaults_come_from_policy_params() -> None:
    from sgl_kvc.policies import PolicyParams

    config, _ = parse_args([])
    p = PolicyParams()
    assert (config.kv_budget, config.kv_buffer, config.kv_window, config.rkv_lambda) == (
        p.budget, p.buffer, p.window, p.rkv_lambda)
    # between chunks only when the next chunk would not fit: prompts longer than the pool are served
    assert config.compress_on == ("prefill", "chunk", "decode", "preempt") and config.chunk_moment is None
    assert parse_args(["--policy", "rkv"])[0].chunk_moment == "pressure"
    assert KvcConfig().compress_on == config.compress_on
    assert parse_args(["--policy", "rkv", "--compress-on", "chunk-always,prefill"])[0].chunk_moment == "always"
    assert parse_args(["--policy", "rkv", "--compress-on", "prefill,decode"])[0].chunk_moment is None
    assert config.kv_selection == "per-head"  # what the papers do
    assert parse_args(["--kv-selection", "shared"])[0].kv_selection == "shared"
    assert config.kv_decode_attention == "batched"
    assert parse_args(["--kv-decode-attention", "sglang"])[0].kv_decode_attention == "sglang"
    assert config.kv_chunk_window == "question"  # a cut between chunks scores by the question
    assert parse_args(["--kv-chunk-window", "chunk"])[0].kv_chunk_window == "chunk"
    assert config.kv_head_budget == "auto" and not config.variable_budget  # --policy none: SGLang's pool
    assert parse_args(["--policy", "rkv"])[0].kv_head_budget == "policy"  # the unit pool, on this CPU
    variable = parse_args(["--policy", "rkv", "--kv-head-budget", "variable", "--model-path", "/m"])
    assert variable[0].variable_budget
    # the unit pool is read by sgl-kvc's kernel: in the Triton backend on a GPU
    gpu_argv = build_sglang_argv(variable[1], on_gpu=True, compressing=True, unit_pool=True)
    assert gpu_argv[gpu_argv.index("--attention-backend") + 1] == "triton"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--compress-on", "prefill,later"], "--compress-on"),
        (["--kv-chunk-window", "last"], "--kv-chunk-window"),
        (["--kv-budget", "0"], "budget"),
        (["--kv-budget-ratio", "1.5"], "--kv-budget-ratio"),
        (["--rkv-lambda", "2"], "rkv_lambda"),
        (["--kv-keep-recent", "-1"], "keep_recent"),
        (["--rkv-exemption", "last"], "--rkv-exemption"),
        (["--kv-selection", "per-layer"], "--kv-selection"),
        (["--kv-pass-work", "-1"], "--kv-pass-work"),
        (["--kv-decode-attention", "flash"], "--kv-decode-attention"),
        (["--kv-head-budget", "adaptive"], "--kv-head-budget"),
        (["--policy", "rkv", "--kv-head-budget", "variable", "--kv-selection", "shared"], "--kv-selection per-head"),
        (["--policy", "rkv", "--kv-head-budget", "variable", "--kv-decode-attention", "sglang"],
         "--kv-decode-attention batched"),
        (["--policy", "rkv", "--kv-head-budget", "variable", "--attention-backend", "flashinfer"], "torch_native"),
        (["--policy", "rkv", "--prompt-policy", "h2o"], "use it with policy 'h2o'"),
        (["--policy", "rkv", "--prompt-policy", "none"], "--prompt-policy"),
    ],
)
def test_bad_flag_values_are_usage_errors(argv: list[str], needle: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_float32_by_default_only_where_bfloat16_is_emulated() -> None:
    """A CPU without native bfloat16 serves in float32 unless --dtype says otherwise (measured
    on AVX2: 2.1x the tokens/s at 16 users, 5.4x faster pre-fill); a GPU or a CPU with
    AVX512-BF16 / AMX keeps the model's dtype."""
    def dtype(argv: list[str], **kw) -> str | None:
        out = build_sglang_argv(["--model-path", "/m", *argv], **kw)
        return out[out.index("--dtype") + 1] if "--dtype" in out else None

    assert EMULATED_BF16_DTYPE == "float32"
    assert dtype([], on_gpu=False, native_bf16=False) == "float32"
    assert dtype(["--dtype", "bfloat16"], on_gpu=False, native_bf16=False) == "bfloat16"
    given = build_sglang_argv(["--model-path", "/m", "--dtype=float16"], on_gpu=False, native_bf16=False)
    assert "--dtype=float16" in given and "--dtype" not in given
    assert dtype([], on_gpu=False, native_bf16=True) is None
    assert dtype([], on_gpu=True, native_bf16=False) is None


def test_float32_only_where_the_doubled_weights_fit(tmp_path, monkeypatch) -> None:
    """float32 doubles a 16-bit checkpoint's weights: a model that would then take over half of
    the free memory keeps its own dtype."""
    from sgl_kvc.launcher import sglang_argv

    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "config.json").write_text("{}")  # not a weight file
    assert sglang_argv.float32_fits(str(tmp_path), available=4000)
    assert not sglang_argv.float32_fits(str(tmp_path), available=3999)
    assert sglang_argv.float32_fits("/no/such/folder", available=1)  # SGLang reports a bad path itself
    seen = []
    monkeypatch.setattr(sglang_argv, "float32_fits", lambda path: seen.append(path) or False)
    argv = build_sglang_argv(["--model-path", str(tmp_path)], on_gpu=False, native_bf16=False)
    assert "--dtype" not in argv and seen == [str(tmp_path)]


def test_workers_are_forked_only_from_a_launcher_that_started_no_thread() -> None:
    """A fork copies only the forking thread: a thread started since the baseline (an OpenMP pool
    that converting a model started) would be missing in the child with whatever it held."""
    from sgl_kvc.launcher.cpu_processes import fork_is_safe

    assert fork_is_safe({"1", "2"}, {"1", "2"}, python_threads=1)
    assert not fork_is_safe({"1", "2"}, {"1", "2", "3"}, python_threads=1)  # an OS thread started
    assert not fork_is_safe({"1", "2"}, {"1", "2"}, python_threads=2)  # a Python thread runs
    assert not fork_is_safe(set(), set(), python_threads=1)  # no /proc: unknown, spawn


def test_kvzip_with_uniform_head_budgets_is_warned_about() -> None:
    """KVzip's scores need one sort over every head (docs/quality.md): a server started with it
    as the prompt policy and uniform head budgets says so in one line; with variable budgets, or
    another prompt policy, it says nothing."""
    from sgl_kvc.launcher.refusals import allocation_warning

    def warning(*flags: str) -> str | None:
        return allocation_warning(parse_args(["--model-path", "demo", *flags])[0])

    kvzip = ("--policy", "snapkv", "--prompt-policy", "kvzip")
    assert "--kv-head-budget policy" in warning(*kvzip, "--kv-head-budget", "uniform")
    assert "--kv-head-budget policy" in warning(*kvzip, "--tp-size", "2")  # auto: uniform there
    assert warning(*kvzip, "--kv-head-budget", "variable") is None and warning(*kvzip) is None
    assert warning("--policy", "rkv", "--kv-head-budget", "uniform") is None and warning() is None


@pytest.mark.parametrize(
    ("flags", "on_gpu", "flashinfer", "capability", "mode", "why"),
    [
        ((), False, True, None, "policy", None),
        (("--kv-head-budget", "uniform"), False, True, None, "uniform", None),
        (("--kv-head-budget", "layer"), False, True, None, "layer", None),
        (("--tp-size", "2"), False, True, None, "uniform", "--tp-size 2"),
        (("--kv-selection", "shared"), False, True, None, "uniform", "--kv-selection shared"),
        (("--kv-decode-attention", "sglang"), False, True, None, "uniform", "--kv-decode-attention sglang"),
        (("--attention-backend", "flashinfer"), True, True, (9, 0), "uniform", "--attention-backend flashinfer"),
        ((), True, True, (9, 0), "uniform", "--attention-backend flashinfer"),  # FlashInfer's default kept
        ((), True, False, (9, 0), "policy", None),  # no FlashInfer: triton reads the unit pool
        ((), True, False, (7, 5), "uniform", "compute capability 7.5"),
        (("--kv-cache-dtype", "fp8_e4m3"), True, True, (8, 0), "uniform", "compute capability 8.0"),
        (("--kv-cache-dtype", "fp8_e4m3"), True, True, (9, 0), "policy", None),
    ],
)
def test_auto_head_budgets_take_the_unit_pool_where_the_server_can_have_it(
    flags, on_gpu, flashinfer, capability, mode, why,
) -> None:
    """`--kv-head-budget auto` (the default) resolves, in the launcher, to `policy` where one rank,
    per-head selection, batched decode attention and a backend that reads sgl-kvc's pools (the one
    asked for, or the one the server gets) allow it, else to `uniform`, saying which in one line."""
    from sgl_kvc.launcher.head_budget import resolve_head_budget

    config, rest = parse_args(["--model-path", "demo", "--policy", "rkv", *flags])
    # parse_args resolved it for this (CPU) machine; resolve the flags again as the given machine
    asked = replace(config, kv_head_budget=dict(zip(flags[::2], flags[1::2])).get("--kv-head-budget", "auto"))
    resolved, line = resolve_head_budget(asked, rest, on_gpu, flashinfer, capability)
    assert resolved.kv_head_budget == mode
    if "--kv-head-budget" in flags:
        assert line is None
    else:
        assert line is not None and "\n" not in line and f"--kv-head-budget {mode} (auto)" in line
        assert (why is None) == (mode == "policy") and (why is None or why in line)
    none, _ = parse_args(["--model-path", "demo", "--policy", "none"])
    assert not none.variable_budget and resolve_head_budget(none, [], False)[1] is None


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"attn_logit_softcapping": 30.0}, "a logit cap"),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64}, "a sliding window"),
        ({"sliding_window": 64, "sliding_window_pattern": 4}, "a sliding window"),
        ({"text_config": {"attn_logit_softcapping": 50.0}}, "a logit cap"),  # a multimodal model's text model
        # SGLang's Llama, Mistral, Qwen2 and Phi-3 attend to every token whatever `sliding_window` says
        ({"sliding_window": 4096}, None),
        ({"layer_types": ["full_attention"] * 2, "sliding_window": 64, "attn_logit_softcapping": None}, None),
        ({}, None),
    ],
)
def test_auto_head_budgets_keep_sglangs_pool_for_a_model_the_unit_pool_cannot_serve(tmp_path, fields, why) -> None:
    """A model whose attention layers use a logit cap or a sliding window (its config.json says so)
    is one the unit pool's kernel does not serve: `auto` gives it uniform head budgets, saying why
    in one line, where the server would otherwise stop at start-up; an explicit `--kv-head-budget
    policy` keeps it (the scheduler refuses the model, naming `uniform`)."""
    import json

    from sgl_kvc.launcher.head_budget import resolve_head_budget

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **fields}))
    config, rest = parse_args(["--model-path", str(tmp_path), "--policy", "rkv"])
    assert config.kv_head_budget == ("policy" if why is None else "uniform")
    if why is not None:
        _, line = resolve_head_budget(replace(config, kv_head_budget="auto"), rest, False)
        assert line is not None and "\n" not in line and "--kv-head-budget uniform (auto)" in line and why in line
    explicit, _ = parse_args(["--model-path", str(tmp_path), "--policy", "rkv", "--kv-head-budget", "policy"])
    assert explicit.kv_head_budget == "policy"
