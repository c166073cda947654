"""Set-ups sgl-kvc cannot serve correctly are refused at start-up with one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from sgl_kvc.config import KvcConfig
from sgl_kvc.launcher.cli import parse_args
from sgl_kvc.launcher.sglang_argv import build_sglang_argv


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "rkv", "--attention-backend", "fa3"], "--attention-backend fa3 is not supported"),
        (["--policy", "h2o", "--attention-backend=fa4"], "--attention-backend fa4"),
        (["--policy", "snapkv", "--decode-attention-backend", "fa3"], "--decode-attention-backend"),
        (["--policy", "rkv", "--page-size", "16"], "needs --page-size 1"),
        (["--kv-cache-dtype", "fp8_e4m3", "--page-size", "64"], "needs --page-size 1"),
        (["--policy", "rkv", "--speculative-algorithm", "EAGLE"], "speculative decoding"),
        (["--policy", "rkv", "--enable-mixed-chunk"], "--enable-mixed-chunk"),
        (["--policy", "rkv", "--kv-head-budget", "variable", "--tp-size", "2"], "does not support --tp-size 2"),
        (["--policy", "snapkv", "--kv-head-budget", "layer", "--tp-size=4"], "does not support --tp-size 4"),
        (["--policy", "rkv", "--enable-dp-attention"], "does not support --enable-dp-attention"),
        (["--policy", "rkv", "--attn-dp-size", "2"], "does not support --attn-dp-size 2"),
        (["--policy", "h2o", "--disaggregation-mode", "prefill"], "does not support --disaggregation-mode prefill"),
        (["--policy", "rkv", "--disaggregation-mode=decode"], "does not support --disaggregation-mode decode"),
        (["--policy", "rkv", "--enable-lmcache"], "does not support --enable-lmcache"),
        (["--policy", "rkv", "--enable-flexkv"], "does not support --enable-flexkv"),
        (["--policy", "rkv", "--enable-hierarchical-cache"], "does not support --enable-hierarchical-cache"),
        (["--policy", "rkv", "--enable-pdmux"], "does not support --enable-pdmux"),
        (["--kv-cache-dtype", "fp8_e5m2", "--disaggregation-mode=decode"], "FP8 pool"),
        (["--policy", "rkv", "--pp-size", "2"], "does not support --pp-size 2"),
        (["--policy", "snapkv", "--pipeline-parallel-size=4"], "does not support --pp-size 4"),
        (["--policy", "rkv", "--kv-cache-dtype", "nvfp4"], "does not support --kv-cache-dtype nvfp4"),
        (["--policy", "h2o", "--kv-cache-dtype=fp4_mx_block16"], "does not support --kv-cache-dtype fp4_mx_block16"),
        (["--policy", "rkv", "--kv-cache-dtype", "mxfp8"], "does not support --kv-cache-dtype mxfp8"),
        (["--policy", "rkv", "--kv-document-depth", "0"], "--kv-document-depth must be an integer in [1, 1024]"),
        (["--policy", "rkv", "--kv-document-depth", "1025"], "--kv-document-depth must be an integer in [1, 1024]"),
        # split backends: SGLang's hybrid backend, which leaves the observation store unattached
        (["--policy", "rkv", "--prefill-attention-backend", "flashinfer"], "one attention backend for prefill and decode"),
        (["--policy", "snapkv", "--attention-backend", "flashinfer", "--decode-attention-backend", "torch_native"],
         "--decode-attention-backend torch_native"),
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
        ["--policy", "h2o", "--attention-backend=triton"],  # SGLang's Triton backend, wrapped
        ["--policy", "rkv", "--tp-size", "2"],  # supported: scores are all-reduced over TP
        ["--policy", "rkv", "--attn-dp-size", "1", "--disaggregation-mode", "null"],
        ["--policy", "none", "--enable-dp-attention", "--enable-lmcache", "--disaggregation-mode", "prefill"],
        ["--policy", "rkv", "--dp-size", "2"],  # every rank is a scheduler of its own
        ["--policy", "rkv", "--prefill-attention-backend", "torch_native"],  # the same one as decode
        ["--policy", "none", "--prefill-attention-backend", "flashinfer"],  # plain SGLang
        ["--policy", "none", "--pp-size", "2", "--kv-cache-dtype", "nvfp4"],  # plain SGLang
        ["--policy", "rkv", "--pp-size", "1", "--kv-cache-dtype", "bf16"],
    ],
)
def test_supported_setups_pass(argv) -> None:
    parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "capability", "message"),
    [
        (["--policy", "rkv", "--kv-head-budget", "variable"], (7, 5), "compute capability 8.0"),
        (["--policy", "rkv", "--kv-head-budget", "layer", "--kv-cache-dtype", "fp8_e4m3"], (8, 0),
         "--kv-head-budget layer with --kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9"),
        (["--policy", "rkv", "--kv-head-budget", "variable", "--kv-cache-dtype", "fp8_e5m2"], (9, 0), None),
        (["--policy", "rkv", "--kv-head-budget", "variable"], (8, 0), None),
        (["--policy", "rkv", "--kv-head-budget", "uniform"], (7, 0), None),  # SGLang's kernels decode
    ],
)
def test_a_gpu_the_triton_kernel_cannot_compile_for_is_refused(argv, capability, message) -> None:
    from sgl_kvc.launcher.refusals import gpu_unsupported

    config, _ = parse_args(argv)
    problem = gpu_unsupported(config, capability)
    assert problem is None if message is None else message in problem and "\n" not in problem


@pytest.mark.parametrize(
    ("argv", "backend", "warned"),
    [
        (["--policy", "rkv", "--kv-head-budget", "variable"], "triton", False),
        (["--kv-cache-dtype", "fp8_e4m3"], "triton", False),
        (["--policy", "snapkv", "--kv-cache-dtype", "fp8_e5m2", "--kv-head-budget", "layer"], "triton", False),
        (["--policy", "rkv", "--kv-head-budget", "layer", "--attention-backend", "torch_native"], "torch_native", True),
        (["--policy", "rkv"], "flashinfer", False),
    ],
)
def test_sgl_kvc_pools_take_the_triton_backend_on_a_gpu(monkeypatch, argv, backend, warned) -> None:
    """On a GPU, FP8 KV storage and variable / layer budgets (sgl-kvc's pools, which FlashInfer does
    not read) get SGLang's Triton backend, whose decode kernel call is sgl-kvc's; the torch_native
    backend, asked for, serves them too, and the launcher says once that its prefill is slow."""
    from sgl_kvc.launcher import machine
    from sgl_kvc.launcher.flags import sglang_flags
    from sgl_kvc.launcher.refusals import torch_native_on_gpu

    monkeypatch.setattr(machine, "cuda_available", lambda: True)
    monkeypatch.setattr(machine, "flashinfer_installed", lambda: True)
    config, rest = parse_args(argv)
    out = build_sglang_argv(rest, on_gpu=True, compressing=config.compressing, fp8_kv=config.fp8_kv is not None,
                            unit_pool=config.variable_budget)
    assert sglang_flags(out).get("--attention-backend") == backend
    assert (torch_native_on_gpu(config, rest) is not None) == warned


def test_sgl_kvc_pools_refuse_flashinfer(capsys) -> None:
    for argv in (["--policy", "rkv", "--kv-head-budget", "variable", "--attention-backend", "flashinfer"],
                 ["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "flashinfer"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert "torch_native or triton" in err and "flashinfer" in err


def test_cuda_graphs_off_for_compressing_policies_on_gpu() -> None:
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=True, compressing=True)
    assert "--disable-cuda-graph" in argv
    assert "--disable-cuda-graph" not in build_sglang_argv(["--model-path", "/m"], on_gpu=True)
    assert "--disable-cuda-graph" not in build_sglang_argv(["--model-path", "/m"], on_gpu=False, compressing=True)


@pytest.mark.parametrize("policy, captures", [("rkv", True), ("snapkv", True), ("h2o", False), ("kvcompress", False)])
def test_decode_graphs_replay_for_the_policies_they_hold(policy: str, captures: bool) -> None:
    """`--kv-decode-graphs on`: SGLang captures decode graphs (prefill graphs off) for a policy whose
    decode keeps no attention statistics; one that keeps them is served with graphs off, and says why."""
    config, rest = parse_args(["--policy", policy, "--kv-decode-graphs", "on"])
    assert config.decode_graphs is captures
    assert (config.graphs_refusal is None) is captures
    argv = build_sglang_argv(["--model-path", "/m", *rest], on_gpu=True, compressing=True,
                             decode_graphs=config.decode_graphs)
    assert ("--disable-cuda-graph" in argv) is not captures
    assert ("--disable-prefill-cuda-graph" in argv) is captures
    assert not parse_args(["--policy", policy])[0].decode_graphs  # off unless asked for
    assert not parse_args(["--kv-decode-graphs", "on"])[0].decode_graphs  # --policy none: SGLang's own graphs


def test_sglang_applies_every_hook() -> None:
    """In a fresh interpreter: the plugin loads through SGLang's loader and the launcher's
    start-up check finds every internal as written for and every hook target patched (SGLang
    only logs a failed patch; the launcher refuses to serve then), the pool and configurator
    hooks of FP8, variable budgets and a fixed memory budget included."""
    config = "KvcConfig(policy='rkv', kv_head_budget='variable', kv_cache_dtype='fp8_e4m3', kv_cache_memory_gb=0.01)"
    code = (
        "from sgl_kvc.compat import standins; standins.install()\n"
        f"from sgl_kvc.config import KvcConfig; c = {config}; c.to_env()\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sgl_kvc.adapter import check; print('PROBLEMS', check(c))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PROBLEMS []" in r.stdout, r.stdout[-2000:]


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


class _Attention(torch.nn.Module):
    """SGLang's RadixAttention surface that the unit pool's model check reads."""

    def __init__(self, layer_id: int, logit_cap: float = 0.0, window: int = -1, cross: bool = False) -> None:
        super().__init__()
        self.layer_id, self.logit_cap, self.sliding_window_size, self.is_cross_attention = layer_id, logit_cap, window, cross


@pytest.mark.parametrize(
    ("layer", "encoder_decoder", "message"),
    [
        (_Attention(1, logit_cap=30.0), False, "attention layer 1 uses a logit cap"),
        (_Attention(1, window=4096), False, "attention layer 1 uses a sliding window of 4096"),
        (_Attention(1, cross=True), False, "attention layer 1 uses cross-attention"),
        (_Attention(1), True, "does not support encoder-decoder models"),
        (_Attention(1), False, None),
    ],
)
def test_the_unit_pool_refuses_layers_its_kernel_does_not_serve(layer, encoder_decoder, message) -> None:
    """Checked when SGLang configures the KV pool (the model is loaded, nothing served yet)."""
    from sgl_kvc.adapter.memory.unit_pool import unsupported_model

    model = torch.nn.ModuleList([_Attention(0), layer])
    problem = unsupported_model(model, encoder_decoder, "--kv-head-budget variable")
    if message is None:
        assert problem is None
    else:
        assert problem.startswith("--kv-head-budget variable does not support") and message in problem


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ((True, False, False), "MLA attention"),
        ((False, True, False), "hybrid SWA"),
        ((False, False, True), "state-space layers"),
        ((False, False, False), None),
    ],
)
def test_models_whose_kv_compaction_does_not_model_are_refused(layout, message) -> None:
    """Checked when SGLang configures the KV pool, under every compressing policy."""
    from sgl_kvc.adapter.safety.refusals import unsupported_layout

    problem = unsupported_layout(*layout, policy="rkv")
    if message is None:
        assert problem is None
    else:
        assert problem.startswith("--policy rkv does not support this model") and message in problem
        assert "\n" not in problem


def test_an_attention_backend_sgl_kvc_does_not_wrap_is_refused() -> None:
    """SGLang's hybrid backend (a split prefill / decode pair) would leave the store unattached."""
    from sgl_kvc.adapter.attention import _kvc_class
    from sgl_kvc.adapter.safety.refusals import unattached_backend

    class HybridAttnBackend:
        pass

    problem = unattached_backend(HybridAttnBackend(), "snapkv")
    assert problem is not None and "HybridAttnBackend" in problem and "one attention backend" in problem
    wrapped = _kvc_class(HybridAttnBackend, "torch_native").__new__(_kvc_class(HybridAttnBackend, "torch_native"))
    assert unattached_backend(wrapped, "snapkv") is None


@pytest.mark.parametrize(
    ("ranks", "cpus", "nodes", "bind"),
    [
        (2, [0, 1], 1, "0|1"),  # --dp-size 2 on a 2-core, one-node VM
        (2, list(range(8)), 1, "0-3|4-7"),
        (3, list(range(8)), 1, "0-1|2-3|4-7"),  # the last rank takes the remainder
        (4, [0, 1], 1, "0|1|0|1"),  # fewer CPUs than ranks: shared round-robin
        (2, [0, 2, 4, 6], 1, "0,2|4,6"),
        (2, list(range(8)), 2, None),  # one NUMA node per rank: SGLang's own placement
        (1, [0, 1], 1, None),
    ],
)
def test_cpu_ranks_get_cores_where_sglang_has_too_few_numa_nodes(ranks, cpus, nodes, bind) -> None:
    from sgl_kvc.launcher.cpu_processes import cpu_threads_bind, parallel_ranks

    assert cpu_threads_bind(ranks, cpus, nodes) == bind
    assert parallel_ranks(["--dp-size", "2", "--tp-size=3"]) == 6 and parallel_ranks([]) == 1


def _server_config(tmp_path, values: dict) -> list[str]:
    """`--config FILE`: SGLang's YAML file of server flags, holding `values`."""
    path = tmp_path / "server.yaml"
    path.write_text("".join(f"{key}: {value}\n" for key, value in values.items()))
    return ["--config", str(path)]


@pytest.mark.parametrize(
    ("argv", "config", "message"),
    [
        (["--policy", "rkv", "--kv-head-budget", "variable", "--tp", "2"], {}, "does not support --tp-size 2"),
        (["--policy", "rkv", "--kv-head-budget", "layer"], {"tp-size": 2}, "does not support --tp-size 2"),
        (["--policy", "rkv", "--page-s", "16"], {}, "needs --page-size 1"),
        (["--policy", "rkv"], {"page-size": 16}, "needs --page-size 1"),
        (["--kv-cache-dtype", "fp8_e4m3"], {"page-size": 64}, "needs --page-size 1"),
        (["--policy", "rkv"], {"attention-backend": "fa3"}, "--attention-backend fa3 is not supported"),
        (["--policy", "rkv"], {"kv-cache-dtype": "nvfp4"}, "does not support --kv-cache-dtype nvfp4"),
        (["--policy", "rkv"], {"pp-size": 2}, "does not support --pp-size 2"),
        (["--policy", "rkv", "--enable-mixed"], {}, "does not support --enable-mixed-chunk"),
        (["--policy", "rkv"], {"enable-lmcache": True}, "does not support --enable-lmcache"),
    ],
)
def test_sglang_flags_are_read_as_sglang_reads_them(tmp_path, argv, config, message, capsys) -> None:
    """A flag SGLang's parser accepts abbreviated, or reads from a `--config` file, is refused as
    the flag spelled out is: the launcher decides from what SGLang will serve, not from its argv."""
    with pytest.raises(SystemExit) as exc:
        parse_args([*argv, *(_server_config(tmp_path, config) if config else [])])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("python -m sgl_kvc.launch: error:")


def test_auto_head_budgets_and_cpu_ranks_read_sglang_flags_as_sglang_does(tmp_path) -> None:
    """`auto` takes SGLang's pool where SGLang will run two tensor-parallel ranks, however they were
    asked for, and the CPU ranks the launcher places are the ones SGLang starts."""
    from sgl_kvc.launcher.cpu_processes import parallel_ranks

    for argv in (["--tp", "2"], ["--tensor-parallel-size=2"], _server_config(tmp_path, {"tp-size": 2})):
        assert parse_args(["--policy", "rkv", *argv])[0].kv_head_budget == "uniform", argv
        assert parallel_ranks(argv) == 2 and parallel_ranks(["--policy", "rkv", *argv]) == 2, argv
    assert parallel_ranks([*_server_config(tmp_path, {"dp-size": 2}), "--tp", "3"]) == 6
    # the command line wins over the file, as in SGLang
    assert parse_args(["--policy", "rkv", *_server_config(tmp_path, {"tp-size": 2}), "--tp-size", "1"])[0] \
        .kv_head_budget == "policy"
