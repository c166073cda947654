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


class SegmentFreeRecorder:
    """The allocator calls SGLang's radix tree makes when it evicts a node (`free_segment`) and
    when a request's row is given back (`free_segments`), recording the slots they gave back."""

    device = "cpu"
    page_size = 1

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.freed += slots.tolist()

    def free_segments(self, segments: list[tuple[torch.Tensor, int]]) -> None:
        """A request's row given back (`free_kv_row_segments`), its segments at once."""
        for slots, start in segments:
            self.free_segment(slots, start)


class LayeredKvPool:
    """SGLang's KV pool surface (`get_key_buffer` / `get_value_buffer` / `get_kv_buffer`,
    `start_layer`, `layer_num`, `head_num`, `head_dim`), in the layouts the serving pools have:

    * `units=False`: SGLang's `MHATokenToKVPool`, one contiguous [slots, H_kv, d] K and V buffer
      per layer;
    * `units=True`: sgl-kvc's unit pool (`adapter/memory/unit_pool.py`), one [slots, L, H_kv, d]
      allocation per K and V, each layer a strided view of it, and `unit_buffers()` its flat form;
    * `fp8` ("fp8_e4m3" / "fp8_e5m2"): the FP8 pools (`adapter/memory/fp8_pool.py`), whose buffers are
      `Fp8Rows` (uint8 codes and a bfloat16 scale per (slot, head)) of either layout.

    Random values from the CPU generator `g`, on `device`. `k` / `v` are the dense float values
    [slots, L, H_kv, d] the test references read (dequantized for FP8)."""

    def __init__(self, slots: int, layers: int, heads: int, dim: int, g: torch.Generator,
                 device: torch.device | str = "cpu", units: bool = False, fp8: str | None = None) -> None:
        self.start_layer, self.layer_num, self.head_num, self.head_dim = 0, layers, heads, dim
        self.units, self.fp8 = units, fp8
        k = torch.randn(slots, layers, heads, dim, generator=g).to(device)
        v = torch.randn(slots, layers, heads, dim, generator=g).to(device)
        if fp8 is not None:
            from sgl_kvc.kernels.fp8 import Fp8Rows, quantize_rows

            def rows(x: torch.Tensor) -> Fp8Rows:
                codes, scales = quantize_rows(x.reshape(-1, dim), fp8, "bfloat16")
                return Fp8Rows(codes.view(torch.uint8).reshape(x.shape), scales.reshape(x.shape[:-1]), fp8,
                               "bfloat16", torch.float32)

            self._k, self._v = rows(k), rows(v)
            everything = torch.arange(slots, device=device)
            self.k, self.v = self._k[everything], self._v[everything]  # [slots, L, H, d], dequantized
        else:
            self._k, self._v, self.k, self.v = k, v, k, v
        if units:
            self.unit_buffers = lambda: (_flat(self._k, dim), _flat(self._v, dim))
            self._layers_k = [_layer(self._k, layer) for layer in range(layers)]
            self._layers_v = [_layer(self._v, layer) for layer in range(layers)]
        else:  # one allocation per layer, as SGLang's pool makes them
            self._layers_k = [_own(_layer(self._k, layer)) for layer in range(layers)]
            self._layers_v = [_own(_layer(self._v, layer)) for layer in range(layers)]

    def get_key_buffer(self, layer: int) -> Any:
        return self._layers_k[layer - self.start_layer]

    def get_value_buffer(self, layer: int) -> Any:
        return self._layers_v[layer - self.start_layer]

    def get_kv_buffer(self, layer: int) -> tuple[Any, Any]:
        return self.get_key_buffer(layer), self.get_value_buffer(layer)


def _layer(buf: Any, layer: int) -> Any:
    """Layer `layer` of a [slots, L, ...] tensor or `Fp8Rows` (a strided view)."""
    codes = getattr(buf, "codes", None)
    if codes is None:
        return buf[:, layer]
    return type(buf)(codes[:, layer], buf.scales[:, layer], buf.fp8, buf.scale_format, buf.dtype)


def _own(buf: Any) -> Any:
    """A contiguous copy: a buffer of its own."""
    codes = getattr(buf, "codes", None)
    if codes is None:
        return buf.contiguous()
    return type(buf)(codes.contiguous(), buf.scales.contiguous(), buf.fp8, buf.scale_format, buf.dtype)


def _flat(buf: Any, dim: int) -> Any:
    """The flat unit pool [slots x L x H_kv, d] of a [slots, L, H_kv, d] buffer."""
    codes = getattr(buf, "codes", None)
    if codes is None:
        return buf.view(-1, dim)
    return type(buf)(codes.view(-1, dim), buf.scales.view(-1), buf.fp8, buf.scale_format, buf.dtype)
