"""What tests check the FP8 codec (`sgl_kvc.kernels.fp8`) against: what a reader of the pool gets
back, and the rounding bounds of an FP8 format."""

from __future__ import annotations

from torch import Tensor

from sgl_kvc.kernels.fp8 import DEFAULT_SCALE_FORMAT, Fp8Spec, dequantize_rows, quantize_rows


def fake_quantize_rows(
    x: Tensor, fp8: str = "fp8_e4m3", scale_format: str = DEFAULT_SCALE_FORMAT
) -> Tensor:
    """dequantize(quantize(x)) in x's dtype: what a reader of the cache gets back."""
    codes, stored = quantize_rows(x, fp8, scale_format)
    return dequantize_rows(codes, stored, scale_format, x.dtype)


def rel_error(spec: Fp8Spec) -> float:
    """Largest relative rounding error of a value in the normal range (half an ulp)."""
    return 2.0 ** -(spec.mantissa_bits + 1)


def subnormal_step(spec: Fp8Spec) -> float:
    """Spacing of the subnormal codes (absolute, before scaling)."""
    return 2.0 ** (spec.min_normal_exp - spec.mantissa_bits)


