"""FP8 KV quantization (sgl_kvc.kernels.fp8): codes, scales and rows that dequantize on read;
and the per-layer scales the FP8 study compares them with (tests/fp8_reference.py).

Inputs have outlier channels (a few channels 50x larger than the rest, as real keys have), not
only Gaussian noise. The SGLang pool built on it: tests/unit/test_fp8_pool.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fp8_reference import (
    RunningAmax, dequantize_tensor, fake_quantize_rows, fake_quantize_tensor, quantize_tensor, rel_error, subnormal_step,
)
from fp8_rows import FORMATS, OUTLIER_CHANNELS, outlier_rows
from sgl_kvc.kernels import fp8 as F



@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("scale_format", sorted(F.SCALE_FORMATS))
def test_round_trip_error_bound_on_outliers(device: torch.device, fp8: str, scale_format: str) -> None:
    spec = F.fp8_spec(fp8)
    x = outlier_rows().to(device)
    codes, stored = F.quantize_rows(x, fp8, scale_format)
    assert codes.dtype == spec.dtype and codes.shape == x.shape and stored.shape == x.shape[:-1]
    y = F.dequantize_rows(codes, stored, scale_format)
    assert codes.device == stored.device == y.device == device
    err = (y - x).abs()
    scale = F.decode_scales(stored, scale_format)[..., None]
    # Elementwise: half an ulp of the value in the normal range, half a subnormal step below it.
    bound = rel_error(spec) * x.abs() + 0.5 * subnormal_step(spec) * scale
    assert bool((err <= bound * (1 + 1e-6)).all())
    # Row-wise, relative to the row's largest magnitude (what the outliers set).
    amax = x.abs().amax(-1, keepdim=True)
    assert bool((err <= rel_error(spec) * amax).all())
    # The ordinary channels keep their own relative precision although the row's scale is
    # set by outliers 50x larger: FP8 is floating point, so only the range moves.
    normal = torch.ones(x.shape[-1], dtype=torch.bool, device=device)
    normal[OUTLIER_CHANNELS] = False
    rel = (y - x)[..., normal].norm() / x[..., normal].norm()
    assert rel < {"fp8_e4m3": 0.03, "fp8_e5m2": 0.06}[fp8]


def test_e4m3_is_twice_as_precise_as_e5m2(device: torch.device) -> None:
    x = outlier_rows().to(device)
    errs = {
        fp8: float((fake_quantize_rows(x, fp8, "float16") - x).norm() / x.norm()) for fp8 in FORMATS
    }
    assert 1.6 < errs["fp8_e5m2"] / errs["fp8_e4m3"] < 2.4, errs


def test_scale_one_saturates_and_underflows_where_row_scales_do_not(device: torch.device) -> None:
    """SGLang's per-layer scale of 1.0: values past 448 clip (e4m3), values under e4m3's
    smallest subnormal (2**-9) vanish; one scale per row keeps both."""
    big = (outlier_rows(factor=50.0) * 20.0).to(device)  # outliers up to ~ 4000
    small = (outlier_rows() * 1e-4).to(device)  # every value below e4m3's smallest normal (2**-6)
    for x, what in ((big, "saturation"), (small, "underflow")):
        one = fake_quantize_tensor(x, 1.0, "fp8_e4m3")
        rows = fake_quantize_rows(x, "fp8_e4m3", "float16")
        assert one.device == rows.device == device
        err_one = float((one - x).norm() / x.norm())
        err_rows = float((rows - x).norm() / x.norm())
        assert err_rows < 0.03, what
        assert err_one > 4 * err_rows, (what, err_one, err_rows)
    assert float(fake_quantize_tensor(big, 1.0).abs().max()) == 448.0  # clipped
    assert float((fake_quantize_tensor(small * 1e-2, 1.0) == 0).double().mean()) > 0.99  # flushed
    # e5m2 has the range (57344, subnormals to 2**-16) but half the precision of e4m3.
    e5 = float((fake_quantize_tensor(big, 1.0, "fp8_e5m2") - big).norm() / big.norm())
    assert 0.03 < e5 < 0.08


def test_e8m0_scales_are_powers_of_two_using_the_top_binade(device: torch.device) -> None:
    x = (outlier_rows() * torch.logspace(-8, 8, 512)[:, None, None]).to(device)
    for fp8 in FORMATS:
        spec = F.fp8_spec(fp8)
        _, stored = F.quantize_rows(x, fp8, "e8m0")
        scale = F.decode_scales(stored, "e8m0")
        assert stored.dtype == torch.uint8 and scale.device == device
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        ratio = x.abs().amax(-1) / scale
        assert bool((ratio <= spec.max).all()) and bool((ratio > spec.max / 2).all())


@pytest.mark.parametrize("scale_format", ["float16", "bfloat16", "float32"])
def test_float_scales_are_rounded_up_so_nothing_saturates(device: torch.device, scale_format: str) -> None:
    x = (outlier_rows() * torch.logspace(-3, 3, 512)[:, None, None]).to(device)
    _, stored = F.quantize_rows(x, "fp8_e4m3", scale_format)
    scale = F.decode_scales(stored, scale_format)
    assert scale.device == device
    assert bool((x.abs().amax(-1) / scale <= 448.0 * (1 + 2**-20)).all())  # to float32 rounding


def test_zero_rows_stay_zero(device: torch.device) -> None:
    x = torch.zeros(3, 2, 8, device=device)
    for fmt in F.SCALE_FORMATS:
        y = fake_quantize_rows(x, "fp8_e4m3", fmt)
        assert y.device == device and torch.equal(y, x)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    fp8=st.sampled_from(FORMATS),
    scale_format=st.sampled_from(sorted(F.SCALE_FORMATS)),
    rows=st.integers(1, 6),
    d=st.integers(1, 40),
    log_mag=st.floats(-12, 12),
    outlier=st.floats(1, 200),
    seed=st.integers(0, 2**16),
)
def test_property_error_bounded_by_row_amax(device, fp8, scale_format, rows, d, log_mag, outlier, seed) -> None:
    """|dequant(quant(x)) - x| <= rel_error(fp8) * amax(row) for any magnitude the 16-bit cache
    can hold (a row's scale stays within float16's range unless the format is float16)."""
    if scale_format == "float16":
        # float16 scales: keep amax (randn up to ~5x, times the outlier) between ~1e-5 and ~1e7
        log_mag = max(min(log_mag, 6.0 - math.log10(outlier) - 1.0), -5.0)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g) * (10.0 ** log_mag)
    x[:, 0] *= outlier
    x = x.to(torch.bfloat16).float().to(device)  # what the model hands the cache
    spec = F.fp8_spec(fp8)
    amax = x.abs().amax(-1, keepdim=True)
    if scale_format == "float16":
        # A scale (amax / fp8 max) below float16's smallest normal loses its own precision: the
        # bound is a claim about rows whose scale float16 represents (bf16 scales, the default,
        # cover float32's exponent range). Hypothesis found rows with amax ~1e-6 at log_mag -5.
        assume(bool((amax / spec.max >= torch.finfo(torch.float16).tiny).all()))
    y = fake_quantize_rows(x, fp8, scale_format)
    assert bool(((y - x).abs() <= rel_error(spec) * amax * (1 + 1e-6)).all())


def test_running_amax_grows_and_requantizes(device: torch.device) -> None:
    ra = RunningAmax("fp8_e4m3")
    a = outlier_rows(64).to(device)
    old, new = ra.observe(a)
    codes = quantize_tensor(a, new)
    b = a * 3
    old2, new2 = ra.observe(b)
    assert old2 == new and math.isclose(new2, 3 * new, rel_tol=1e-6)
    requant = ra.requantize(codes, old2, new2)
    back = dequantize_tensor(requant, new2)
    assert back.device == device
    assert float((back - a).norm() / a.norm()) < 0.05  # a second rounding, still close
    assert ra.observe(a) == (new2, new2)  # smaller data does not move the scale


# --- Fp8Rows: the buffer the pool hands to readers --------------------------------------------
@pytest.mark.parametrize("scale_format", sorted(F.SCALE_FORMATS))
def test_rows_dequantize_only_what_is_indexed_and_copy_exactly(device: torch.device, scale_format: str) -> None:
    rows = F.Fp8Rows.empty(
        32, 2, 16, fp8="fp8_e4m3", scale_format=scale_format, dtype=torch.bfloat16, device=device
    )
    x = outlier_rows(8, 2, 16).to(device, torch.bfloat16)
    slots = torch.tensor([3, 5, 7, 9, 11, 13, 15, 17], device=device)
    rows.store(slots, x.reshape(8, -1))
    got = rows[slots[:3]]
    assert got.shape == (3, 2, 16) and got.dtype == torch.bfloat16 and got.device == device
    assert type(got.movedim(0, 1)) is torch.Tensor  # ordinary tensor arithmetic downstream
    assert float((got.float() - x[:3].float()).norm() / x[:3].float().norm()) < 0.04
    codes, scales = rows.codes.clone(), rows.scales.clone()
    dst = torch.tensor([20, 21, 22], device=device)
    rows[dst] = rows[slots[:3]]  # how compaction copies slots
    assert torch.equal(rows.codes[dst], codes[slots[:3]])
    assert torch.equal(rows.scales[dst], scales[slots[:3]])
    assert torch.equal(rows.codes[:20], codes[:20])  # nothing else changed
    zero, five = torch.tensor([0], device=device), torch.tensor([5], device=device)
    rows[zero] = rows[five]  # a read of the same rows is copied as codes and scales
    assert torch.equal(rows[zero], rows[five])
    assert rows.nbytes() == 32 * 2 * (16 + F.SCALE_FORMATS[scale_format])


def test_rows_requantize_a_plain_tensor(device: torch.device) -> None:
    rows = F.Fp8Rows.empty(4, 1, 8, scale_format="float16", dtype=torch.float32, device=device)
    x = torch.linspace(-3, 3, 8).reshape(1, 1, 8).to(device)
    two = torch.tensor([2], device=device)
    rows[two] = x
    assert float((rows[two] - x).abs().max()) <= 3 * 2**-4


def test_bytes_per_token(device: torch.device) -> None:
    # demo model: 2 layers, 2 KV heads, d=32 -> bf16 512 bytes per token
    assert F.bytes_per_token(2, 32, 32, 2, "float16") == 256 + 16
    assert F.bytes_per_token(2, 32, 32, 2, "e8m0") == 256 + 8
    assert F.bytes_per_token(8, 128, 128, 32, None) == 65536
