"""Index tensors built on the host and sent to their data's device without stalling it.

A blocking copy to a GPU (`tensor.to("cuda")`) first waits for every kernel queued before it, so
one in each decode step would keep the host from queueing the next layer's kernels while the
GPU runs the current ones: every step would pay the host's launch time on top of the GPU's.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """Host tensor `t` on `device`, copied without waiting for the device's queued work: from
    pinned memory on CUDA (the copy is queued; PyTorch keeps the pinned block until it is done),
    as is on the CPU."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_tensor(values: Sequence[int] | Sequence[bool], device: torch.device,
                dtype: torch.dtype = torch.int64) -> Tensor:
    """`values`, listed on the host, as a tensor on `device` (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=dtype, device="cpu"), device)
