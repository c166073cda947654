"""The core's stand-in pools (`tests/fakes.py`, what `.ci/gpu` runs the decode plans on) have the
surface and layouts of the serving pools: SGLang's `MHATokenToKVPool` (per-layer contiguous K and V),
sgl-kvc's unit pool and both FP8 pools, checked here against the installed classes."""

from __future__ import annotations

import pytest
import torch

from fakes import LayeredKvPool

SURFACE = ("get_key_buffer", "get_value_buffer", "get_kv_buffer", "start_layer", "layer_num", "head_num", "head_dim")


def _real(units: bool, fp8: str | None):
    pytest.importorskip("sglang")
    from sgl_kvc.compat import standins

    standins.install()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sgl_kvc.adapter.memory.fp8_pool import fp8_pool_class
    from sgl_kvc.adapter.memory.unit_pool import KvcFp8UnitTokenToKVPool, KvcUnitTokenToKVPool

    if fp8 is not None:
        cls = fp8_pool_class(fp8, base=KvcFp8UnitTokenToKVPool if units else None)
    else:
        cls = KvcUnitTokenToKVPool if units else MHATokenToKVPool
    return cls(15, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=32, v_head_dim=32, layer_num=3,
               device="cpu", enable_memory_saver=False, start_layer=0, end_layer=2, enable_alt_stream=False,
               enable_kv_cache_copy=False)


def _layout(buf) -> tuple:
    """What the decode plans rely on: shape, dtype, contiguity (codes and scales for FP8)."""
    codes = getattr(buf, "codes", None)
    if codes is None:
        return (tuple(buf.shape), buf.is_contiguous())
    return (tuple(codes.shape), codes.dtype, codes.is_contiguous(), tuple(buf.scales.shape), buf.scales.is_contiguous())


@pytest.mark.parametrize("fp8", [None, "fp8_e4m3"])
@pytest.mark.parametrize("units", [False, True], ids=["per-layer", "unit-layout"])
def test_stand_ins_have_the_serving_pools_surface_and_layouts(units: bool, fp8: str | None) -> None:
    real = _real(units, fp8)
    fake = LayeredKvPool(16, 3, 2, 32, torch.Generator().manual_seed(0), units=units, fp8=fp8)
    for name in SURFACE:
        assert hasattr(real, name) and hasattr(fake, name), name
    assert hasattr(real, "unit_buffers") == hasattr(fake, "unit_buffers") == units
    for layer in range(3):
        for get in ("get_key_buffer", "get_value_buffer"):
            assert _layout(getattr(fake, get)(layer)) == _layout(getattr(real, get)(layer)), (get, layer)
    if units:
        for f, r in zip(fake.unit_buffers(), real.unit_buffers()):
            assert _layout(f) == _layout(r)
