"""Stand-ins for SGLang objects that unit tests of the adapter need without a server."""

from __future__ import annotations

from typing import Any

import torch


class FakeAllocator:
    """SGLang's token-slot allocator surface (`size`, `alloc`, `free`, `available_size`,
    `get_kvcache`). Slot 0 is SGLang's padding slot and is never handed out; `seed` shuffles the
    free list, so rows are not runs of consecutive slots. `alloc` hands slots out on `device`,
    the device of the KV pool (SGLang's allocator keeps its free list there)."""

    def __init__(
        self, slots: int, pool: Any = None, seed: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        order = torch.arange(1, slots)
        if seed is not None:
            order = order[torch.randperm(slots - 1, generator=torch.Generator().manual_seed(seed))]
        self.pool, self.free_slots, self.device = pool, order.tolist(), torch.device(device)
        self.size = slots - 1  # the slots it hands out (the invariant checks count them)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, k: int) -> torch.Tensor:
        out, self.free_slots = self.free_slots[:k], self.free_slots[k:]
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def free(self, slots: torch.Tensor) -> None:
        self.free_slots += slots.tolist()

    def get_kvcache(self) -> Any:
        return self.pool


class LayeredKvPool:
    """SGLang's KV pool surface: per-layer [slots, H_kv, d] K and V, as views of one
    [slots, L, H_kv, d] allocation (the unit pool's layout, so `unit_buffers` is its flat form,
    present when `units`). Random values from the CPU generator `g`, on `device`."""

    def __init__(self, slots: int, layers: int, heads: int, dim: int, g: torch.Generator,
                 device: torch.device | str = "cpu", units: bool = False) -> None:
        self.k = torch.randn(slots, layers, heads, dim, generator=g).to(device)
        self.v = torch.randn(slots, layers, heads, dim, generator=g).to(device)
        self.start_layer, self.layer_num = 0, layers
        if units:
            self.unit_buffers = lambda: (self.k.view(-1, dim), self.v.view(-1, dim))

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[:, layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[:, layer]

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, layer], self.v[:, layer]
