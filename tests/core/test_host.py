"""Host-listed index tensors reach their data's device with their values and dtype."""

from __future__ import annotations

import torch

from sgl_kvc.core.host import host_tensor, to_device


def test_host_tensor_lands_on_the_device_with_its_values(device: torch.device) -> None:
    t = host_tensor([3, 1, 2], device)
    assert t.device == device and t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    mask = to_device(torch.arange(4, device="cpu") >= 2, device)
    assert mask.device == device and mask.dtype == torch.bool and mask.tolist() == [False, False, True, True]
    assert host_tensor([], device).numel() == 0
