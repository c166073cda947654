"""FP8 test inputs shared by the codec and pool tests: rows with outlier channels."""

from __future__ import annotations

import torch

FORMATS = ["fp8_e4m3", "fp8_e5m2"]
OUTLIER_CHANNELS = [3, 11, 17, 35, 49]


def outlier_rows(n: int = 512, heads: int = 2, d: int = 64, factor: float = 50.0, seed: int = 0) -> torch.Tensor:
    """[n, heads, d] Gaussian rows with a few channels `factor` x larger, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g)
    x[..., [c for c in OUTLIER_CHANNELS if c < d]] *= factor
    return x
