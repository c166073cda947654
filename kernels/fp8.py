"""FP8 KV-cache quantization: plain torch, no SGLang.

One scale per row, per (token, KV head), computed from the row as it is written,
`scale = amax(|row|) / fp8_max`. This is what the sgl-kvc FP8 pool stores. The scale itself is
stored in one of `SCALE_FORMATS`: `bfloat16` (the pool's choice: float32's range in two
bytes; rounded up so that no value of the row saturates), `float16`, `float32`, or `e8m0`, the
power-of-two exponent of the scale in one byte as in the OCP MX formats. With a power-of-two
scale a floating-point FP8 code rounds exactly as with no scale at all, so e8m0 only moves the
range; an exact scale also maps the row's largest value (nearly) exactly onto fp8_max, which
lowers the error (docs/fp8.md, Accuracy, scale formats). The per-layer scales sgl-kvc is
compared against (SGLang's fixed scale, a running amax) are in research/fp8_accuracy.py.

Casting to FP8 is done after an explicit clamp to +-fp8_max, so out-of-range values saturate on
every device (torch's cast saturates on CPU; not every kernel does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# Bytes per stored scale.
SCALE_FORMATS: dict[str, int] = {"e8m0": 1, "float16": 2, "bfloat16": 2, "float32": 4}
DEFAULT_SCALE_FORMAT = "bfloat16"
_E8M0_BIAS = 127


@dataclass(frozen=True)
class Fp8Spec:
    """Numbers of an FP8 format: largest finite value, mantissa bits, smallest normal exponent."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal_exp: int  # smallest normal value is 2**min_normal_exp


FP8_SPECS: dict[str, Fp8Spec] = {
    "fp8_e4m3": Fp8Spec("fp8_e4m3", torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": Fp8Spec("fp8_e5m2", torch.float8_e5m2, 57344.0, 2, -14),
}


def fp8_spec(name: str) -> Fp8Spec:
    try:
        return FP8_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; choose one of {sorted(FP8_SPECS)}") from None


def _check_scale_format(scale_format: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"unknown scale format {scale_format!r}; choose one of {sorted(SCALE_FORMATS)}")


def scale_storage_dtype(scale_format: str) -> torch.dtype:
    _check_scale_format(scale_format)
    return {
        "e8m0": torch.uint8,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
    }[scale_format]


def bytes_per_token(
    head_num: int, head_dim: int, v_head_dim: int, layer_num: int, scale_format: str | None
) -> int:
    """Bytes one token takes in an FP8 KV cache with one scale per (token, KV head) for K and
    one for V (`scale_format=None`: no per-row scales, i.e. per-layer scales)."""
    codes = head_num * (head_dim + v_head_dim) * layer_num
    scales = 0 if scale_format is None else 2 * head_num * layer_num * SCALE_FORMATS[scale_format]
    return codes + scales


# --- per-row scales ------------------------------------------------------------------------------
def encode_scales(amax: Tensor, spec: Fp8Spec, scale_format: str) -> Tensor:
    """Stored scales for rows whose largest magnitude is `amax` (float32)."""
    _check_scale_format(scale_format)
    s = amax.float() / spec.max
    if scale_format == "e8m0":
        # Smallest power of two >= s (so that amax / scale <= fp8 max), as a biased exponent.
        tiny = torch.finfo(torch.float32).tiny
        mant, exp = torch.frexp(s.clamp_min(tiny))  # s = mant * 2**exp, mant in [0.5, 1)
        exp = exp - (mant == 0.5).to(exp.dtype)
        return (exp.clamp(-_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS).to(torch.uint8)
    dtype = scale_storage_dtype(scale_format)
    info = torch.finfo(dtype)
    # Round the scale up (never down), so that no value of the row saturates: where rounding
    # to nearest went down, take s * (1 + eps) rounded, which is above s (and at most 1.5 ulp
    # above). No data-dependent branch: no device synchronization on a GPU.
    stored = s.clamp(info.tiny, info.max).to(dtype)
    bumped = (s * (1.0 + info.eps)).clamp(info.tiny, info.max).to(dtype)
    return torch.where(stored.float() < s, bumped, stored)


def decode_scales(stored: Tensor, scale_format: str) -> Tensor:
    """float32 scales from their stored form."""
    _check_scale_format(scale_format)
    if scale_format == "e8m0":
        return torch.exp2(stored.to(torch.float32) - _E8M0_BIAS)
    return stored.to(torch.float32)


def quantize_rows(
    x: Tensor, fp8: str = "fp8_e4m3", scale_format: str = DEFAULT_SCALE_FORMAT
) -> tuple[Tensor, Tensor]:
    """Quantize `x[..., D]` with one scale per row (the last dimension is the row).
    Returns (codes of dtype FP8 with x's shape, stored scales of shape x.shape[:-1])."""
    spec = fp8_spec(fp8)
    xf = x.float()
    stored = encode_scales(xf.abs().amax(dim=-1), spec, scale_format)
    scale = decode_scales(stored, scale_format)
    codes = (xf / scale.unsqueeze(-1)).clamp_(-spec.max, spec.max).to(spec.dtype)
    return codes, stored


def dequantize_rows(
    codes: Tensor, stored_scales: Tensor, scale_format: str = DEFAULT_SCALE_FORMAT,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of `quantize_rows`: `codes * scale` per row, in `dtype`."""
    scale = decode_scales(stored_scales, scale_format)
    return (codes.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


# --- a cache buffer that dequantizes only what it is indexed with ------------------------------
class DequantizedRows(torch.Tensor):
    """What `Fp8Rows[idx]` returns: a plain tensor of dequantized values (torch operations on it
    give ordinary tensors) that remembers the codes and scales it was made from, so that
    `rows[dst] = rows[src]` copies those exactly instead of quantizing a second time."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    fp8_source: tuple[str, str, Tensor, Tensor]  # (fp8, scale format, codes, stored scales)


class Fp8Rows:
    """FP8 codes with one scale per (slot, head): `[slots, H, D]` codes and `[slots, H]` scales.

    Reading `rows[idx]` returns the dequantized rows `idx` as a tensor of `dtype` (the model's
    dtype), so attention and eviction scoring read only the slots they use: no dequantized copy
    of the cache ever exists. `rows[idx] = x` quantizes `x` (one scale per row) into slots
    `idx`, except when `x` is itself a read of an `Fp8Rows` of the same format
    (`rows[dst] = rows[src]`, how compaction copies slots): then codes and scales are copied
    as they are, so a copy never adds rounding.
    """

    __slots__ = ("codes", "scales", "fp8", "scale_format", "dtype", "_spec")

    def __init__(
        self, codes: Tensor, scales: Tensor, fp8: str, scale_format: str, dtype: torch.dtype
    ) -> None:
        # codes are stored as uint8 (index_put of float8 tensors is not implemented everywhere)
        assert codes.dtype == torch.uint8 and codes.shape[:-1] == scales.shape
        self.codes = codes
        self.scales = scales
        self.fp8 = fp8
        self.scale_format = scale_format
        self.dtype = dtype
        self._spec = fp8_spec(fp8)

    @classmethod
    def empty(
        cls, slots: int, head_num: int, head_dim: int, *, fp8: str = "fp8_e4m3",
        scale_format: str = DEFAULT_SCALE_FORMAT, dtype: torch.dtype = torch.bfloat16,
        device: Any = "cpu",
    ) -> "Fp8Rows":
        codes = torch.zeros((slots, head_num, head_dim), dtype=torch.uint8, device=device)
        scales = torch.zeros((slots, head_num), dtype=scale_storage_dtype(scale_format), device=device)
        return cls(codes, scales, fp8, scale_format, dtype)

    # tensor-like metadata (read by generic code that inspects a KV buffer)
    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def __len__(self) -> int:
        return self.codes.shape[0]

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def __getitem__(self, idx: Any) -> Tensor:
        codes, scales = self.codes[idx], self.scales[idx]
        out = dequantize_rows(codes.view(self._spec.dtype), scales, self.scale_format, self.dtype)
        out = out.as_subclass(DequantizedRows)
        out.fp8_source = (self.fp8, self.scale_format, codes, scales)
        return out

    def __setitem__(self, idx: Any, value: Tensor) -> None:
        source = getattr(value, "fp8_source", None)
        if source is not None and source[:2] == (self.fp8, self.scale_format):
            codes, stored = source[2], source[3]
        else:
            codes, stored = quantize_rows(value, self.fp8, self.scale_format)
            codes = codes.view(torch.uint8)
        self.codes[idx] = codes
        self.scales[idx] = stored

    def store(self, idx: Tensor, value: Tensor) -> None:
        """`rows[idx] = value` for `value` of shape `[n, H * D]` or `[n, H, D]`."""
        self[idx] = value.reshape(-1, *self.codes.shape[1:])

    def __repr__(self) -> str:
        return (f"Fp8Rows(slots={self.codes.shape[0]}, heads={self.codes.shape[1]}, "
                f"dim={self.codes.shape[2]}, {self.fp8}, scales={self.scale_format}, dtype={self.dtype})")
