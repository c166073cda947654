"""One decode block's group of requests whose policies share a statistic (`StatGroup`): what the
torch version (`core/stat_slab.py`) and the Triton kernel (`kernels/triton_stats.py`) both read. A
leaf, so that the kernel names it without importing the slab that dispatches to the kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from sgl_kvc.policies import Policy


@dataclass(frozen=True)
class StatGroup:
    """Requests of one decode block whose policies share a statistic (one policy class): what
    a step adds to their statistics is computed for all of them at once.

    Member m reads row `rows[m]` of the block's attention (the rows of the block's requests
    that keep statistics) and, from logits, its log-sum-exp at block row `lse_rows[m]`; its
    `lens[m]` columns start at `starts[m]` in the step's slab (device tensors from one copy of
    host-side lists; `total`, `max_len`: their sum and maximum, on the host)."""

    policy: "Policy"
    rows: Tensor
    lse_rows: Tensor
    starts: Tensor
    lens: Tensor
    total: int
    max_len: int

    def columns(self) -> tuple[Tensor, Tensor, Tensor]:
        """Each of the group's `total` columns: its member, its column there and its slab
        column (the torch version's gather and scatter), made on the device."""
        m = int(self.lens.shape[0])
        device = self.lens.device
        member = torch.repeat_interleave(torch.arange(m, device=device), self.lens, output_size=self.total)
        column = torch.arange(self.total, device=device) - (torch.cumsum(self.lens, 0) - self.lens)[member]
        return member, column, self.starts[member] + column
