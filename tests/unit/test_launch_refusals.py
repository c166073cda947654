"""Set-ups sgl-kvc cannot serve correctly are refused at start-up with one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sgl_kvc.adapter.hooks import hook_table, missing_targets
from sgl_kvc.config import KvcConfig
from sgl_kvc.launch import build_sglang_argv, parse_args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "rkv", "--attention-backend", "fa3"], "--attention-backend fa3 is not supported"),
        (["--policy", "h2o", "--attention-backend=triton"], "--attention-backend triton"),
        (["--policy", "snapkv", "--decode-attention-backend", "triton"], "--decode-attention-backend"),
        (["--policy", "rkv", "--page-size", "16"], "needs --page-size 1"),
        (["--kv-cache-dtype", "fp8_e4m3", "--page-size", "64"], "needs --page-size 1"),
        (["--policy", "rkv", "--speculative-algorithm", "EAGLE"], "speculative decoding"),
        (["--policy", "rkv", "--enable-mixed-chunk"], "--enable-mixed-chunk"),
    ],
)
def test_unsupported_setups_are_usage_errors(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("python -m sgl_kvc.launch: error:")


@pytest.mark.parametrize(
    "argv",
    [
        ["--policy", "none", "--attention-backend", "fa3", "--page-size", "16", "--enable-mixed-chunk"],
        ["--policy", "rkv", "--attention-backend", "torch_native", "--page-size", "1"],
        ["--policy", "rkv", "--tp-size", "2"],  # supported: scores are all-reduced over TP
    ],
)
def test_supported_setups_pass(argv) -> None:
    parse_args(argv)


def test_cuda_graphs_off_for_compressing_policies_on_gpu() -> None:
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=True, compressing=True)
    assert "--disable-cuda-graph" in argv
    assert "--disable-cuda-graph" not in build_sglang_argv(["--model-path", "/m"], on_gpu=True)
    assert "--disable-cuda-graph" not in build_sglang_argv(["--model-path", "/m"], on_gpu=False, compressing=True)


@pytest.mark.parametrize("policy", ["none", "rkv"])
def test_every_hook_target_exists_in_the_installed_sglang(policy: str) -> None:
    targets = [t for t, _, _ in hook_table(KvcConfig(policy=policy))]
    assert targets and missing_targets(targets) == []


def test_a_renamed_target_is_reported() -> None:
    assert missing_targets([
        "sglang.srt.managers.scheduler.Scheduler.update_running_batch",
        "sglang.srt.managers.scheduler.Scheduler.no_such_method",
        "sglang.srt.no_such_module.Thing.method",
    ]) == [
        "sglang.srt.managers.scheduler.Scheduler.no_such_method",
        "sglang.srt.no_such_module.Thing.method",
    ]


def test_sglang_applies_every_hook() -> None:
    """In a fresh interpreter: the plugin loads through SGLang's loader and every target is patched
    (SGLang only logs a failed patch; the launcher refuses to serve then). A compressing policy
    registers a superset of --policy none's hooks."""
    policy = "rkv"
    code = (
        "from sgl_kvc.compat import standins; standins.install()\n"
        f"from sgl_kvc.config import KvcConfig; c = KvcConfig(policy={policy!r}); c.to_env()\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sgl_kvc.adapter import verify_applied; print('UNPATCHED', verify_applied(c))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "UNPATCHED []" in r.stdout, r.stdout[-2000:]


def test_a_failing_install_stops_the_process() -> None:
    code = (
        "from sgl_kvc.config import KvcConfig; KvcConfig(policy='rkv').to_env()\n"
        "import sgl_kvc.adapter as a\n"
        "def boom(config): raise RuntimeError('planted')\n"
        "a.install = boom\n"
        "from sgl_kvc import plugin; plugin.load()\n"
        "print('STILL RUNNING')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "STILL RUNNING" not in r.stdout
    assert "sgl-kvc failed to install into SGLang: planted" in r.stderr
