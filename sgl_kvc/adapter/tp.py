"""Tensor parallelism: every rank must keep the same tokens.

Each TP rank runs its own scheduler with the same requests and the same slot table, but holds
only its shard of the KV heads. A kept set chosen from a rank's own heads would differ between
ranks and the ranks' tables would diverge. Policies combine scores as a mean over KV heads (then
layers); with equal head shards the mean of the ranks' means is the mean over all heads, so an
all-reduce of the combined [n] score (sum, divided by the group size) before choosing gives every
rank the single-GPU decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

AllReduce = Callable[[Tensor], None]  # in-place sum over the group


@dataclass(frozen=True)
class ScoreReducer:
    world_size: int
    all_reduce_sum: AllReduce

    def __call__(self, combined: Tensor) -> Tensor:
        out = combined.float().clone()
        # +inf marks protected tokens (the same on every rank); inf sums stay inf, NaN must not
        # leak into the sum, so the finite part is reduced and the masks re-applied.
        inf = torch.isinf(out) & (out > 0)
        out = torch.nan_to_num(out, nan=-1e30, posinf=0.0, neginf=-1e30)
        self.all_reduce_sum(out)
        out /= self.world_size
        out[inf] = float("inf")
        return out

    @classmethod
    def for_sglang_tp_group(cls) -> "ScoreReducer | None":
        """The reducer for SGLang's TP group (published process-wide by SGLang 0.5.23), or None
        with a single rank."""
        import torch.distributed as dist
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if int(parallel.tp_size) <= 1:
            return None
        group = parallel.tp_group

        def all_reduce_sum(t: Tensor) -> None:
            # The CPU group (gloo) takes tensors on the host; scores are small ([n] floats).
            host = t.cpu()
            dist.all_reduce(host, op=dist.ReduceOp.SUM, group=group.cpu_group)
            t.copy_(host.to(t.device))

        return cls(world_size=int(parallel.tp_size), all_reduce_sum=all_reduce_sum)


def tp_rank() -> int:
    """This process's tensor-parallel rank (0 without tensor parallelism)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def dp_rank() -> int:
    """This process's data-parallel rank (0 without data parallelism): `--dp-size N` runs N
    schedulers, each answering `/v1/kvc/stats` for its own rank."""
    from sglang.srt.runtime_context import get_parallel

    rank = get_parallel().dp_rank
    return int(rank) if rank is not None else 0
