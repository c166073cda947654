"""The device guard itself: a tensor made without its data's device in sgl-kvc's code fails a
test on a CPU-only machine (here, a planted copy of a bug that once reached CUDA users)."""

from __future__ import annotations

import pytest
import torch

import sgl_kvc.core.moves as entry_moves
from device_guard import LIBRARY_ROOTS, DeviceMix
from sgl_kvc.policies import HeadSelection


def _library_function(source: str, name: str) -> object:
    """`source` compiled as if it were a file of sgl-kvc (the guard judges code by its file)."""
    namespace = {"torch": torch, "HeadSelection": HeadSelection, "UnitMoves": entry_moves.UnitMoves}
    exec(compile(source, LIBRARY_ROOTS[0] + "planted.py", "exec"), namespace)
    return namespace[name]


def test_a_tensor_made_without_a_device_next_to_data_fails() -> None:
    f = _library_function("def f(x):\n    return x + torch.arange(x.numel())\n", "f")
    with pytest.raises(DeviceMix, match="mixes devices"):
        f(torch.ones(3))


def test_the_planted_unit_plan_bug_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit plan once numbered kept entries with a CPU `arange` beside destinations on the
    device (CUDA raised at the first variable compaction)."""
    planted = _library_function(
        "def unit_moves(selection, units, dest):\n"
        "    per_slot = selection.num_layers * selection.num_heads\n"
        "    valid = selection.valid()\n"
        "    src = units.gather(-1, torch.where(valid, selection.indices, 0))[valid]\n"
        "    rel = torch.arange(src.numel())\n"
        "    dst = dest[rel // per_slot] * per_slot + rel % per_slot\n"
        "    table = torch.zeros_like(selection.indices)\n"
        "    table[valid] = dst\n"
        "    return UnitMoves(src=src, dst=dst, table=table)\n",
        "unit_moves",
    )
    selection = HeadSelection(
        indices=torch.tensor([[[0, 2], [1, -1]]]), lengths=torch.tensor([[2, 1]]), n=3
    )
    units = torch.arange(6).reshape(1, 2, 3)
    dest = torch.tensor([5, 9])
    moves = entry_moves.unit_moves(selection, units, dest)  # the real one passes
    assert moves.dst.tolist() == [10, 11, 18]
    with pytest.raises(DeviceMix):
        planted(selection, units, dest)
