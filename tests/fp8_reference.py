"""What tests check the FP8 codec (`sgl_kvc.kernels.fp8`) against: what a reader of the pool gets
back, the rounding bounds of an FP8 format, and the per-layer scales sgl-kvc's per-(token, head)
scales are compared with (SGLang's fixed scale, a running amax; the FP8 study,
`research/fp8_accuracy.py`, uses them too). Serving never uses these."""

from __future__ import annotations

import torch
from torch import Tensor

from sgl_kvc.kernels.fp8 import DEFAULT_SCALE_FORMAT, Fp8Spec, dequantize_rows, fp8_spec, quantize_rows


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


def quantize_tensor(x: Tensor, scale: float | Tensor, fp8: str = "fp8_e4m3") -> Tensor:
    """Quantize with one scale for the whole tensor (SGLang: the checkpoint's or 1.0)."""
    spec = fp8_spec(fp8)
    return (x.float() / scale).clamp_(-spec.max, spec.max).to(spec.dtype)


def dequantize_tensor(codes: Tensor, scale: float | Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (codes.to(torch.float32) * scale).to(dtype)


def fake_quantize_tensor(x: Tensor, scale: float | Tensor, fp8: str = "fp8_e4m3") -> Tensor:
    return dequantize_tensor(quantize_tensor(x, scale, fp8), scale, x.dtype)


class RunningAmax:
    """One scale per layer from the largest magnitude seen so far (`amax / fp8_max`).

    A cache using it holds codes quantized with the scale of the moment; when new data raises
    the amax, `observe` returns the old and new scale so that the stored codes can be
    re-quantized (`requantize`), which costs a pass over the layer and a second rounding."""

    def __init__(self, fp8: str = "fp8_e4m3") -> None:
        self.spec = fp8_spec(fp8)
        self.amax = 0.0

    @property
    def scale(self) -> float:
        return max(self.amax, torch.finfo(torch.float32).tiny) / self.spec.max

    def observe(self, x: Tensor) -> tuple[float, float]:
        """Update with new data; returns (old scale, new scale)."""
        old = self.scale
        self.amax = max(self.amax, float(x.detach().abs().max())) if x.numel() else self.amax
        return old, self.scale

    def requantize(self, codes: Tensor, old: float, new: float) -> Tensor:
        if old == new:
            return codes
        return quantize_tensor(dequantize_tensor(codes, old), new, self.spec.name)
