"""Stand-ins for SGLang objects that unit tests of the adapter need without a server."""

from __future__ import annotations

from typing import Any

import torch


class FakeAllocator:
    """SGLang's token-slot allocator surface (`alloc`, `free`, `available_size`,
    `get_kvcache`). Slot 0 is SGLang's padding slot and is never handed out; `seed` shuffles the
    free list, so rows are not runs of consecutive slots."""

    def __init__(self, slots: int, pool: Any = None, seed: int | None = None) -> None:
        order = torch.arange(1, slots)
        if seed is not None:
            order = order[torch.randperm(slots - 1, generator=torch.Generator().manual_seed(seed))]
        self.pool, self.free_slots = pool, order.tolist()

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, k: int) -> torch.Tensor:
        out, self.free_slots = self.free_slots[:k], self.free_slots[k:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots += slots.tolist()

    def get_kvcache(self) -> Any:
        return self.pool
