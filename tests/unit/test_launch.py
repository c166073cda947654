"""The launcher's argument handling, without starting a server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_kvc.config import KvcConfig
from sgl_kvc.launch import CPU_DEFAULTS, GPU_DEFAULTS, build_sglang_argv, parse_args


def _flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cpu_defaults_filled_in(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SGLKVC_CACHE", str(tmp_path))
    argv = build_sglang_argv([], on_gpu=False)
    for flag, value in CPU_DEFAULTS.items():
        assert _flag_value(argv, flag) == value
    assert _flag_value(argv, "--radix-cache-backend") == "sgl_kvc"
    assert "demo" in _flag_value(argv, "--served-model-name")
    assert _flag_value(argv, "--model-path").startswith(str(tmp_path))


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


def test_disable_radix_cache_keeps_sglang_default() -> None:
    argv = build_sglang_argv(["--model-path", "/m", "--disable-radix-cache"], on_gpu=False)
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
    monkeypatch.delenv("SGLKVC_CONFIG", raising=False)
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
