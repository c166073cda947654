"""FP8 KV quantization (sgl_kvc.kernels.fp8) and the SGLang FP8 pool built on it.

The kernel tests import no SGLang. Inputs have outlier channels (a few channels 50x larger than
the rest, as real keys have), not only Gaussian noise.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sgl_kvc.kernels import fp8 as F

FORMATS = ["fp8_e4m3", "fp8_e5m2"]
OUTLIER_CHANNELS = [3, 11, 17, 35, 49]


def outlier_rows(n: int = 512, heads: int = 2, d: int = 64, factor: float = 50.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g)
    x[..., [c for c in OUTLIER_CHANNELS if c < d]] *= factor
    return x


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("scale_format", sorted(F.SCALE_FORMATS))
def test_round_trip_error_bound_on_outliers(fp8: str, scale_format: str) -> None:
    spec = F.fp8_spec(fp8)
    x = outlier_rows()
    codes, stored = F.quantize_rows(x, fp8, scale_format)
    assert codes.dtype == spec.dtype and codes.shape == x.shape and stored.shape == x.shape[:-1]
    y = F.dequantize_rows(codes, stored, scale_format)
    err = (y - x).abs()
    scale = F.decode_scales(stored, scale_format)[..., None]
    # Elementwise: half an ulp of the value in the normal range, half a subnormal step below it.
    bound = spec.rel_error * x.abs() + 0.5 * spec.subnormal_step * scale
    assert bool((err <= bound * (1 + 1e-6)).all())
    # Row-wise, relative to the row's largest magnitude (what the outliers set).
    amax = x.abs().amax(-1, keepdim=True)
    assert bool((err <= spec.rel_error * amax).all())
    # The ordinary channels keep their own relative precision although the row's scale is
    # set by outliers 50x larger: FP8 is floating point, so only the range moves.
    normal = torch.ones(x.shape[-1], dtype=torch.bool)
    normal[OUTLIER_CHANNELS] = False
    rel = (y - x)[..., normal].norm() / x[..., normal].norm()
    assert rel < {"fp8_e4m3": 0.03, "fp8_e5m2": 0.06}[fp8]


def test_e4m3_is_twice_as_precise_as_e5m2() -> None:
    x = outlier_rows()
    errs = {
        fp8: float((F.fake_quantize_rows(x, fp8, "float16") - x).norm() / x.norm()) for fp8 in FORMATS
    }
    assert 1.6 < errs["fp8_e5m2"] / errs["fp8_e4m3"] < 2.4, errs


def test_scale_one_saturates_and_underflows_where_row_scales_do_not() -> None:
    """SGLang's per-layer scale of 1.0: values past 448 clip (e4m3), values under e4m3's
    smallest subnormal (2**-9) vanish; one scale per row keeps both."""
    big = outlier_rows(factor=50.0) * 20.0  # outliers up to ~ 4000
    small = outlier_rows() * 1e-4  # every value below e4m3's smallest normal (2**-6)
    for x, what in ((big, "saturation"), (small, "underflow")):
        one = F.fake_quantize_tensor(x, 1.0, "fp8_e4m3")
        rows = F.fake_quantize_rows(x, "fp8_e4m3", "float16")
        err_one = float((one - x).norm() / x.norm())
        err_rows = float((rows - x).norm() / x.norm())
        assert err_rows < 0.03, what
        assert err_one > 4 * err_rows, (what, err_one, err_rows)
    assert float(F.fake_quantize_tensor(big, 1.0).abs().max()) == 448.0  # clipped
    assert float((F.fake_quantize_tensor(small * 1e-2, 1.0) == 0).double().mean()) > 0.99  # flushed
    # e5m2 has the range (57344, subnormals to 2**-16) but half the precision of e4m3.
    e5 = float((F.fake_quantize_tensor(big, 1.0, "fp8_e5m2") - big).norm() / big.norm())
    assert 0.03 < e5 < 0.08


def test_e8m0_scales_are_powers_of_two_using_the_top_binade() -> None:
    x = outlier_rows() * torch.logspace(-8, 8, 512)[:, None, None]
    for fp8 in FORMATS:
        spec = F.fp8_spec(fp8)
        _, stored = F.quantize_rows(x, fp8, "e8m0")
        scale = F.decode_scales(stored, "e8m0")
        assert stored.dtype == torch.uint8
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        ratio = x.abs().amax(-1) / scale
        assert bool((ratio <= spec.max).all()) and bool((ratio > spec.max / 2).all())


@pytest.mark.parametrize("scale_format", ["float16", "bfloat16", "float32"])
def test_float_scales_are_rounded_up_so_nothing_saturates(scale_format: str) -> None:
    x = outlier_rows() * torch.logspace(-3, 3, 512)[:, None, None]
    _, stored = F.quantize_rows(x, "fp8_e4m3", scale_format)
    scale = F.decode_scales(stored, scale_format)
    assert bool((x.abs().amax(-1) / scale <= 448.0 * (1 + 2**-20)).all())  # to float32 rounding


def test_zero_rows_stay_zero() -> None:
    x = torch.zeros(3, 2, 8)
    for fmt in F.SCALE_FORMATS:
        y = F.fake_quantize_rows(x, "fp8_e4m3", fmt)
        assert torch.equal(y, x)


@settings(max_examples=200, deadline=None)
@given(
    fp8=st.sampled_from(FORMATS),
    scale_format=st.sampled_from(sorted(F.SCALE_FORMATS)),
    rows=st.integers(1, 6),
    d=st.integers(1, 40),
    log_mag=st.floats(-12, 12),
    outlier=st.floats(1, 200),
    seed=st.integers(0, 2**16),
)
def test_property_error_bounded_by_row_amax(fp8, scale_format, rows, d, log_mag, outlier, seed) -> None:
    """|dequant(quant(x)) - x| <= rel_error(fp8) * amax(row) for any magnitude the 16-bit cache
    can hold (a row's scale stays within float16's range unless the format is float16)."""
    if scale_format == "float16":
        # float16 scales: keep amax (randn up to ~5x, times the outlier) between ~1e-5 and ~1e7
        log_mag = max(min(log_mag, 6.0 - math.log10(outlier) - 1.0), -5.0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * (10.0 ** log_mag)
    x[:, 0] *= outlier
    x = x.to(torch.bfloat16).float()  # what the model hands the cache
    spec = F.fp8_spec(fp8)
    amax = x.abs().amax(-1, keepdim=True)
    if scale_format == "float16":
        # A scale (amax / fp8 max) below float16's smallest normal loses its own precision: the
        # bound is a claim about rows whose scale float16 represents (bf16 scales, the default,
        # cover float32's exponent range). Hypothesis found rows with amax ~1e-6 at log_mag -5.
        assume(bool((amax / spec.max >= torch.finfo(torch.float16).tiny).all()))
    y = F.fake_quantize_rows(x, fp8, scale_format)
    assert bool(((y - x).abs() <= spec.rel_error * amax * (1 + 1e-6)).all())


def test_running_amax_grows_and_requantizes() -> None:
    ra = F.RunningAmax("fp8_e4m3")
    a = outlier_rows(64)
    old, new = ra.observe(a)
    codes = F.quantize_tensor(a, new)
    b = a * 3
    old2, new2 = ra.observe(b)
    assert old2 == new and math.isclose(new2, 3 * new, rel_tol=1e-6)
    requant = ra.requantize(codes, old2, new2)
    back = F.dequantize_tensor(requant, new2)
    assert float((back - a).norm() / a.norm()) < 0.05  # a second rounding, still close
    assert ra.observe(a) == (new2, new2)  # smaller data does not move the scale


# --- Fp8Rows: the buffer the pool hands to readers --------------------------------------------
@pytest.mark.parametrize("scale_format", sorted(F.SCALE_FORMATS))
def test_rows_dequantize_only_what_is_indexed_and_copy_exactly(scale_format: str) -> None:
    rows = F.Fp8Rows.empty(32, 2, 16, fp8="fp8_e4m3", scale_format=scale_format, dtype=torch.bfloat16)
    x = outlier_rows(8, 2, 16).to(torch.bfloat16)
    slots = torch.tensor([3, 5, 7, 9, 11, 13, 15, 17])
    rows.store(slots, x.reshape(8, -1))
    got = rows[slots[:3]]
    assert got.shape == (3, 2, 16) and got.dtype == torch.bfloat16
    assert type(got.movedim(0, 1)) is torch.Tensor  # ordinary tensor arithmetic downstream
    assert float((got.float() - x[:3].float()).norm() / x[:3].float().norm()) < 0.04
    codes, scales = rows.codes.clone(), rows.scales.clone()
    dst = torch.tensor([20, 21, 22])
    rows[dst] = rows[slots[:3]]  # how compaction copies slots
    assert torch.equal(rows.codes[dst], codes[slots[:3]])
    assert torch.equal(rows.scales[dst], scales[slots[:3]])
    assert torch.equal(rows.codes[:20], codes[:20])  # nothing else changed
    rows.copy_rows(torch.tensor([0]), torch.tensor([5]))
    assert torch.equal(rows[torch.tensor([0])], rows[torch.tensor([5])])
    assert rows.nbytes() == 32 * 2 * (16 + F.SCALE_FORMATS[scale_format])


def test_rows_requantize_a_plain_tensor() -> None:
    rows = F.Fp8Rows.empty(4, 1, 8, scale_format="float16", dtype=torch.float32)
    x = torch.linspace(-3, 3, 8).reshape(1, 1, 8)
    rows[torch.tensor([2])] = x
    assert float((rows[torch.tensor([2])] - x).abs().max()) <= 3 * 2**-4


def test_bytes_per_token() -> None:
    # demo model: 2 layers, 2 KV heads, d=32 -> bf16 512 bytes per token
    assert F.bytes_per_token(2, 32, 32, 2, "float16") == 256 + 16
    assert F.bytes_per_token(2, 32, 32, 2, "e8m0") == 256 + 8
    assert F.bytes_per_token(8, 128, 128, 32, None) == 65536


# --- the SGLang pool (no server) ---------------------------------------------------------------
def _pool(fp8: str, size: int = 64, device: str = "cpu", units: bool = False):
    """The FP8 pool of `fp8`; `units`: its unit layout (`--kv-head-budget variable`)."""
    pytest.importorskip("sglang")
    from sgl_kvc.compat import standins

    standins.install()
    from sgl_kvc.adapter.fp8_pool import fp8_pool_class
    from sgl_kvc.adapter.unit_pool import KvcFp8UnitTokenToKVPool

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
    from sgl_kvc.core.compaction import move_units_many
    from sgl_kvc.adapter.fp8_pool import pool_bytes

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
    from sgl_kvc.adapter.compaction import compact_requests_units
    from sgl_kvc.core.request_state import ReqKvState, unit_index
    from sgl_kvc.policies import get_policy
    from sgl_kvc.kernels.per_head_attention import HeadTables, per_head_decode
    from sgl_kvc.policies import select_from_scores

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
    tables = ReqKvState(policy=get_policy("snapkv"), budget=3).tables(slots, layers, heads)  # unpacked
    scores = torch.rand(layers, heads, n, generator=torch.Generator().manual_seed(0))
    selection = select_from_scores(scores, torch.zeros(scores.shape, dtype=torch.bool), 3,
                                   lengths=tables.lens, mode="variable")
    kept = [[tables.units[l, h, selection.kept(l, h)] for h in range(heads)] for l in range(layers)]
    want = [[(k_units.codes[u].clone(), k_units.scales[u].clone(), v_units.codes[u].clone()) for u in row]
            for row in kept]
    [outcome] = compact_requests_units(batch, [(0, selection, tables.units)], pool.unit_buffers())
    q = torch.randn(1, 2 * heads, 32)
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
            assert torch.allclose(out[0, 2 * h : 2 * h + 2], probs @ values, atol=1e-5)


def test_torch_native_attention_reads_the_pool_like_a_tensor() -> None:
    """SGLang's torch-native decode path against a dense computation on dequantized keys."""
    pool = _pool("fp8_e4m3")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    n = 6
    k = outlier_rows(n, 2, 32, seed=3).to(torch.bfloat16)
    v = outlier_rows(n, 2, 32, seed=4).to(torch.bfloat16)
    slots = torch.arange(10, 10 + n)
    pool.set_kv_buffer(_Layer(0), slots, k.reshape(n, -1), v.reshape(n, -1))
    q = torch.randn(1, 4, 32).to(torch.bfloat16)
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
    from sgl_kvc.launch import build_sglang_argv, parse_args

    config, rest = parse_args(["--kv-cache-dtype", "fp8_e4m3", "--port", "1"])
    assert config.fp8_kv == "fp8_e4m3" and rest == ["--port", "1"]
    argv = build_sglang_argv(["--model-path", "/m", *rest], on_gpu=True, fp8_kv=True)
    assert "--kv-cache-dtype" not in argv  # SGLang: auto (the model's dtype), no AMX check
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"  # also on CUDA
    config, _ = parse_args(["--kv-cache-dtype=fp8_e5m2"])
    assert config.fp8_kv == "fp8_e5m2"


def test_other_kv_cache_dtypes_are_passed_to_sglang() -> None:
    from sgl_kvc.launch import parse_args

    config, rest = parse_args(["--kv-cache-dtype", "bf16"])
    assert config.fp8_kv is None and config.kv_cache_dtype == "auto"
    assert rest == ["--kv-cache-dtype", "bf16"]
    config, rest = parse_args([])
    assert config.kv_cache_dtype == "auto" and "--kv-cache-dtype" not in rest


def test_fp8_with_a_raw_buffer_backend_is_a_usage_error(capsys) -> None:
    from sgl_kvc.launch import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--kv-cache-dtype", "fp8_e4m3", "--attention-backend", "flashinfer"])
    assert info.value.code == 2 and "torch_native" in capsys.readouterr().err
    config, _ = parse_args(["--kv-cache-dtype", "fp8_e4m3", "--attention-backend=torch_native"])
    assert config.fp8_kv == "fp8_e4m3"


def test_memory_budget_replaces_the_cpu_token_cap() -> None:
    from sgl_kvc.config import KvcConfig
    from sgl_kvc.launch import build_sglang_argv, parse_args

    config, _ = parse_args(["--kv-cache-memory-gb", "0.5"])
    assert config.kv_cache_memory_gb == 0.5
    assert "--max-total-tokens" in build_sglang_argv(["--model-path", "/m"], on_gpu=False)
    argv = build_sglang_argv(["--model-path", "/m"], on_gpu=False, kv_memory_budget=True)
    assert "--max-total-tokens" not in argv
    with pytest.raises(ValueError, match="kv-cache-memory-gb"):
        KvcConfig(kv_cache_memory_gb=0.0)
