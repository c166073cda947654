"""Decode batches shared by the kernel's tests and the SGLang comparison: random K/V in a slot
pool, requests of given lengths in `req_to_token` rows (slot 0 is SGLang's padding slot)."""

from __future__ import annotations

import torch

H_KV, GROUP, D = 2, 3, 8


def case(seed: int, lens: list[int], slots_total: int = 96, device: torch.device | str = "cpu"):
    """(q, k, v, req_to_token, slots [b, n_max], pad mask) on `device`, drawn on the CPU so that
    every device gets the same numbers. Past its length a request's slots repeat its first
    slot, as `DecodeStep.build` pads them."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(slots_total, H_KV, D, generator=g)
    v = torch.randn(slots_total, H_KV, D, generator=g)
    n_max = max(lens)
    r2t = torch.zeros(len(lens), 64, dtype=torch.int32)
    perm = torch.randperm(slots_total - 1, generator=g) + 1  # slot 0 is SGLang's padding slot
    used = 0
    for b, n in enumerate(lens):
        r2t[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    slots = r2t[:, :n_max].long()
    pad = torch.arange(n_max)[None, :] >= torch.tensor(lens)[:, None]
    slots = torch.where(pad, slots[:, :1], slots)
    q = torch.randn(len(lens), H_KV * GROUP, D, generator=g)
    return q.to(device), k.to(device), v.to(device), r2t.to(device), slots.to(device), pad.to(device)
