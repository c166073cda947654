"""The Triton row decode kernel (`kernels/triton_row_decode.py`, the CUDA attention of a captured
decode step) against the torch version (`kernels/row_decode.py`): rows read in place, packed
tables of the unit pool's arena, padded batch rows, bf16 and FP8 pools, long rows over several
splits. Compiled on a GPU, under Triton's interpreter without one.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="needs the triton package (compiled on a GPU, interpreted on CPU)")
if not torch.cuda.is_available() and not triton.knobs.runtime.interpret:
    pytest.skip("triton was imported before conftest could select its interpreter", allow_module_level=True)

from sgl_kvc.kernels.fp8 import Fp8Rows  # noqa: E402
from sgl_kvc.kernels.row_decode import PackedLayer, row_decode  # noqa: E402
from sgl_kvc.kernels.triton_row_decode import triton_row_decode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, HEADS, D = 3, 2, 16


def _pool(units: int, fp8: str | None, g: torch.Generator) -> tuple:
    k, v = torch.randn(units, D, generator=g) * 2, torch.randn(units, D, generator=g)
    if fp8 is None:
        return k.to(torch.bfloat16).to(DEVICE), v.to(torch.bfloat16).to(DEVICE)
    pools = []
    for x in (k, v):
        rows = Fp8Rows.empty(units, 1, D, fp8=fp8, dtype=torch.bfloat16, device=DEVICE)
        rows[torch.arange(units, device=DEVICE)] = x[:, None].to(DEVICE)
        pools.append(Fp8Rows(rows.codes[:, 0], rows.scales[:, 0], fp8, rows.scale_format, torch.bfloat16))
    return tuple(pools)


@pytest.mark.parametrize("fp8", [None, "fp8_e4m3"])
@pytest.mark.parametrize("units_pool", [False, True], ids=["slots", "units"])
@pytest.mark.parametrize("group", [1, 3])
def test_the_triton_row_decode_is_the_torch_one(fp8: str | None, units_pool: bool, group: int) -> None:
    g = torch.Generator().manual_seed(7 + group)
    slots, rows_total, width = 800, 6, 400
    lens = [1, 333, 37, 5]  # a padded row (row 0, length 1), a long one over several splits
    rows = [0, 3, 1, 5]
    r2t = torch.zeros(rows_total, width, dtype=torch.int32)
    for row, n in zip(rows, lens):
        if row:
            r2t[row, :n] = torch.randperm(slots - 1, generator=g)[:n].to(torch.int32) + 1
    per_slot = LAYERS * HEADS if units_pool else HEADS
    k, v = _pool(slots * per_slot, fp8, g)
    packed = None
    layer = 1
    if units_pool:  # row 1 packed: 30 slots of table entries anywhere in the pool, then its tail
        table = torch.zeros(200, dtype=torch.int32)
        start = torch.zeros(rows_total, LAYERS, HEADS, dtype=torch.int32)
        own = torch.zeros(rows_total, LAYERS, HEADS, dtype=torch.int32)
        first = torch.zeros(rows_total, dtype=torch.int32)
        own[1] = torch.tensor([[3, 40], [0, 17], [9, 1]])
        start[1] = (torch.cumsum(own[1].flatten(), 0) - own[1].flatten()).view(LAYERS, HEADS) + 5
        table[5 : 5 + int(own[1].sum())] = torch.randperm(slots * per_slot, generator=g)[: int(own[1].sum())].to(torch.int32)
        first[1] = 30
        t = [x.to(DEVICE) for x in (table, start, own, first)]
        packed = PackedLayer(table=t[0], start=t[1][:, layer], lens=t[2][:, layer], packed=t[3])
    q = torch.randn(len(rows), HEADS * group, D, generator=g).to(torch.bfloat16).to(DEVICE)
    args = (q, k, v, r2t.to(DEVICE), torch.tensor(rows, device=DEVICE), torch.tensor(lens, device=DEVICE), 0.3)
    units = dict(heads=HEADS, slot_units=per_slot, layer_units=layer * HEADS if units_pool else 0, packed=packed)
    want = torch.zeros(len(rows), HEADS * group, D, dtype=torch.bfloat16, device=DEVICE)
    got = torch.zeros_like(want)
    row_decode(*args, want, width=512, **units)
    triton_row_decode(*args, got, **units)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert got.abs().sum() > 0
