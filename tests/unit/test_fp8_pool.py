"""The SGLang FP8 pools built on sgl_kvc.kernels.fp8 (per-layer and unit layouts), without a
server, and the launcher's FP8 flags."""

from __future__ import annotations

import pytest
import torch

from fp8_rows import FORMATS, outlier_rows
from sgl_kvc.kernels import fp8 as F


# --- the SGLang pool (no server) ---------------------------------------------------------------
def _pool(fp8: str, size: int = 64, device: str = "cpu", units: bool = False):
    """The FP8 pool of `fp8`; `units`: its unit layout (`--kv-head-budget variable`)."""
    pytest.importorskip("sglang")
    from sgl_kvc.compat import standins

    standins.install()
    from sgl_kvc.adapter.memory.fp8_pool import fp8_pool_class
    from sgl_kvc.adapter.memory.unit_pool import KvcFp8UnitTokenToKVPool

    cls = fp8_pool_class(fp8, base=KvcFp8UnitTokenToKVPool if units else None)
    return cls(size, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=32, v_head_dim=32,
               layer_num=2, device=device, enable_memory_saver=False, start_layer=0, end_layer=1,
               enable_alt_stream=False, enable_kv_cache_copy=False)


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


@pytest.mark.parametrize("units", [False, True], ids=["per-layer", "unit-layout"])
@pytest.mark.parametrize("fp8", FORMATS)
def test_pool_stores_fp8_and_reads_dequantized_rows(fp8: str, units: bool) -> None:
    pool = _pool(fp8, units=units)
    from sgl_kvc.adapter.memory.fp8_pool import pool_bytes
    from sgl_kvc.core.moves import move_units_many

    # memory: codes + scales, as SGLang counts it (get_kv_size_bytes), per slot
    assert pool_bytes(pool) == (64 + 1) * pool.kvc_bytes_per_token
    assert pool.kvc_bytes_per_token == F.bytes_per_token(2, 32, 32, 2, pool.kvc_scale_format)
    assert pool.kvc_dtype_name == fp8 and pool.dtype == torch.bfloat16
    assert all(b.dtype == torch.uint8 for b in pool.k_buffer + pool.v_buffer)

    k = outlier_rows(5, 2, 32, seed=1).to(torch.bfloat16)
    v = outlier_rows(5, 2, 32, seed=2).to(torch.bfloat16) * 1e-3
    loc = torch.tensor([4, 8, 9, 10, 30])
    pool.set_kv_buffer(_Layer(1), loc, k.reshape(5, -1), v.reshape(5, -1))
    kb, vb = pool.get_kv_buffer(1)
    tol = {"fp8_e4m3": 0.04, "fp8_e5m2": 0.08}[fp8]
    for got, want in ((kb[loc], k), (vb[loc], v)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert float((got.float() - want.float()).norm() / want.float().norm()) < tol
    assert float(pool.get_key_buffer(0)[loc].abs().max()) == 0.0  # other layer untouched

    before = kb[loc[:2]].clone()
    every_head = torch.arange(2).expand(2, 2, 2)  # [layers, heads, 2]: entries 0 and 1
    move_units_many(pool, [(loc[:2], every_head, torch.tensor([40, 41]))])  # compaction's move
    assert torch.equal(pool.get_key_buffer(1)[torch.tensor([40, 41])], before)
    assert torch.equal(pool.k_buffer[1][40], pool.k_buffer[1][4])
    assert torch.equal(pool.k_scale_buffer[1][41], pool.k_scale_buffer[1][8])

    saved = pool.get_cpu_copy(loc)
    pool.set_kv_buffer(_Layer(1), loc, torch.zeros_like(k).reshape(5, -1), torch.zeros_like(v).reshape(5, -1))
    pool.load_cpu_copy(saved, loc)
    assert torch.equal(pool.get_key_buffer(1)[loc[:2]], before)


def test_fp8_unit_pool_units_are_the_layers_rows_and_move_exactly() -> None:
    """The FP8 unit layout (`--kv-head-budget variable --kv-cache-dtype fp8_*`): unit
    (t x L + l) x H + h of the flat pool is slot t of layer l, head h (codes and scale); a
    variable compaction moves codes and scales as they are, and per-head decode reads them."""
    from types import SimpleNamespace

    from fakes import FakeAllocator
    from sgl_kvc.adapter.moments.compaction import compact_requests_units
    from sgl_kvc.core.request_state import Budget, ReqKvState, unit_index
    from sgl_kvc.kernels.per_head_attention import HeadTables, per_head_decode
    from sgl_kvc.policies import get_policy, select_from_scores

    pool = _pool("fp8_e4m3", units=True)
    layers, heads, n = 2, 2, 10
    allocator = FakeAllocator(64, seed=4)
    slots = allocator.alloc(n)
    for layer in range(layers):
        k = outlier_rows(n, heads, 32, seed=10 + layer).to(torch.bfloat16)
        pool.set_kv_buffer(_Layer(layer), slots, k.reshape(n, -1), (k * 0.5).reshape(n, -1))
    k_units, v_units = pool.unit_buffers()
    units = unit_index(slots, layers, heads)  # [L, H, n]
    for layer in range(layers):
        per_layer = pool.get_key_buffer(layer)[slots]  # [n, H, d]
        assert torch.equal(k_units[units[layer]], per_layer.transpose(0, 1))
        assert torch.equal(k_units.scales[units[layer]], pool.k_scale_buffer[layer][slots].T)

    r2t = torch.zeros(1, 32, dtype=torch.int32)
    r2t[0, :n] = slots.to(torch.int32)
    batch = SimpleNamespace(
        reqs=[SimpleNamespace(kv=SimpleNamespace(req_pool_idx=0, cache_protected_len=0))],
        seq_lens_cpu=torch.tensor([n]), tree_cache=None,
        req_to_token_pool=SimpleNamespace(req_to_token=r2t), token_to_kv_pool_allocator=allocator,
    )
    tables = ReqKvState(policy=get_policy("snapkv"), budget=Budget(3)).tables(slots, layers, heads)  # unpacked
    scores = torch.rand(layers, heads, n, generator=torch.Generator().manual_seed(0))
    selection = select_from_scores(scores, torch.zeros(scores.shape, dtype=torch.bool), 3,
                                   lengths=tables.lens, mode="variable")
    kept = [[tables.units[l, h, selection.kept(l, h)] for h in range(heads)] for l in range(layers)]
    want = [[(k_units.codes[u].clone(), k_units.scales[u].clone(), v_units.codes[u].clone()) for u in row]
            for row in kept]
    [outcome] = compact_requests_units(batch, [(0, selection, tables.units)], pool.unit_buffers())
    q = torch.randn(1, 2 * heads, 32, generator=torch.Generator().manual_seed(1))
    for l in range(layers):
        for h in range(heads):
            moved = outcome.units[l, h, : int(selection.lengths[l, h])]
            assert torch.equal(k_units.codes[moved], want[l][h][0])  # no re-quantization
            assert torch.equal(k_units.scales[moved], want[l][h][1])
            assert torch.equal(v_units.codes[moved], want[l][h][2])
        out = per_head_decode(q, k_units, v_units, HeadTables(outcome.units[l][None], selection.lengths[l][None]))
        for h in range(heads):
            moved = outcome.units[l, h, : int(selection.lengths[l, h])]
            keys, values = k_units[moved].float(), v_units[moved].float()
            probs = torch.softmax(q[0, 2 * h : 2 * h + 2] @ keys.T / 32**0.5, dim=-1)
            # float32 rounding of a sum of values scaled to their own magnitude (outlier rows reach
            # 20+, where 1e-5 absolute is a few ulps); a wrong unit is off by the values' scale
            tol = 1e-5 * float(values.abs().max())
            assert torch.allclose(out[0, 2 * h : 2 * h + 2], probs @ values, rtol=0, atol=tol)


def test_torch_native_attention_reads_the_pool_like_a_tensor() -> None:
    """SGLang's torch-native decode path against a dense computation on dequantized keys."""
    pool = _pool("fp8_e4m3")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    n = 6
    k = outlier_rows(n, 2, 32, seed=3).to(torch.bfloat16)
    v = outlier_rows(n, 2, 32, seed=4).to(torch.bfloat16)
    slots = torch.arange(10, 10 + n)
    pool.set_kv_buffer(_Layer(0), slots, k.reshape(n, -1), v.reshape(n, -1))
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = torch.empty_like(q)
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    req_to_token[1, :n] = slots.to(torch.int32)
    backend = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    backend._run_sdpa_forward_decode(
        q, out, pool.get_key_buffer(0), pool.get_value_buffer(0), req_to_token,
        torch.tensor([1]), torch.tensor([n]), scaling=32**-0.5, enable_gqa=True,
    )
    kd, vd = pool.get_key_buffer(0)[slots], pool.get_value_buffer(0)[slots]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], kd.float().movedim(0, 1)[None], vd.float().movedim(0, 1)[None],
        scale=32**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)
    assert float((out.float() - ref).norm() / ref.norm()) < 0.01  # bf16 output rounding only


@pytest.mark.gpu
def test_pool_on_cuda() -> None:
    pool = _pool("fp8_e4m3", device="cuda")
    k = outlier_rows(5, 2, 32).to(torch.bfloat16).cuda()
    loc = torch.tensor([1, 2, 3, 4, 5], device="cuda")
    pool.set_kv_buffer(_Layer(0), loc, k.reshape(5, -1), k.reshape(5, -1))
    got = pool.get_key_buffer(0)[loc]
    assert got.device.type == "cuda"
    assert float((got.float() - k.float()).norm() / k.float().norm()) < 0.04


# --- the launcher: `--kv-cache-dtype` is SGLang's flag, FP8 values are ours -------------------
def test_fp8_flag_goes_to_our_config_and_sglang_keeps_the_model_dtype() -> None:
    from sgl_kvc.launcher.cli import parse_args
    from sgl_kvc.launcher.sglang_argv import build_sglang_argv

    config, rest = parse_args(["--kv-cache-dtype", "fp8_e4m3", "--port", "1"])
    assert config.fp8_kv == "fp8_e4m3" and rest == ["--port", "1"]
    argv = build_sglang_argv(["--model-path", "/m", *rest], on_gpu=True, fp8_kv=True)
    assert "--kv-cache-dtype" not in argv  # SGLang: auto (the model's dtype), no AMX check
    assert argv[argv.index("--attention-backend") + 1] == "triton"  # on CUDA: sgl-kvc's kernel decodes it
    config, _ = parse_args(["--kv-cache-dtype=fp8_e5m2"])
    assert config.fp8_kv == "fp8_e5m2"


def test_other_kv_cache_dtypes_are_passed_to_sglang() -> None:
    from sgl_kvc.launcher.cli import parse_args

    config, rest = parse_args(["--kv-cache-dtype", "bf16"])
    assert config.fp8_kv is None and config.kv_cache_dtype == "auto"
    assert rest == ["--kv-cache-dtype", "bf16"]
    config, rest = parse_args([])
    assert config.kv_cache_dtype == "auto" and "--kv-cache-dtype" not in rest


def test_fp8_with_a_raw_buffer_backend_is_a_usage_error(capsys) -> None:
    from sgl_kvc.launcher.cli import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "flashinfer"])
    assert info.value.code == 2 and "torch_native or triton" in capsys.readouterr().err
    for backend in ("torch_native", "triton"):
        config, _ = parse_args(["--kv-cache-dtype", "fp8_e4m3", f"--attention-backend={backend}"])
        assert config.fp8_kv == "fp8_e4m3"


def test_memory_budget_replaces_the_cpu_token_cap() -> None:
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.launcher.cli import parse_args
    from sgl_kvc.launcher.sglang_argv import build_sglang_argv

    config, _ = parse_args(["--kv-cache-memory-gb", "0.5"])
    assert config.kv_cache_memory_gb == 0.5
    assert "--max-total-tokens" in build_sglang_argv(["--model-path", "/m"], on_gpu=False)
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=False, kv_memory_gb=True)
    assert "--max-total-tokens" not in argv
    with pytest.raises(ValueError, match="kv-cache-memory-gb"):
        KvcConfig(kv_cache_memory_gb=0.0)
