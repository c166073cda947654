"""Tensor parallelism: every rank must keep the same tokens and fail the same requests.

Each TP rank runs its own scheduler with the same requests and the same slot table, but holds
only its shard of the KV heads. A kept set chosen from a rank's own heads would differ between
ranks and the ranks' tables would diverge. Policies combine scores as a mean over KV heads (then
layers); with equal head shards the mean of the ranks' means is the mean over all heads, so an
all-reduce of the combined [n] score (sum, divided by the group size) before choosing gives every
rank the single-GPU decision.

The ranks' schedulers stay in lock step only while they make the same decisions, so a request
that fails on one rank must fail on every rank, in the same step (`RankVote`), and a rank whose
own scoring failed still joins the score all-reduce (`ScoreReducer.reduce`): no rank ever enters
a collective alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

AllReduce = Callable[[Tensor], None]  # in-place sum over the group


@dataclass(frozen=True)
class ScoreReducer:
    world_size: int
    all_reduce_sum: AllReduce

    def __call__(self, combined: Tensor) -> Tensor:
        out, _ = self.reduce(combined, combined.shape[0], failed=False)
        return out

    def reduce(self, combined: Tensor | None, n: int, failed: bool) -> tuple[Tensor, bool]:
        """(the mean of the ranks' combined [n] scores, whether any rank failed to score). A rank
        that failed (`combined` None) still takes part, so that the others do not wait forever;
        the scores are then meaningless and every rank fails the request."""
        out = torch.zeros(n, dtype=torch.float32, device="cpu") if combined is None else combined.float()
        out = torch.cat([out, out.new_tensor([1.0 if failed else 0.0])])
        # +inf marks protected tokens (the same on every rank); inf sums stay inf, NaN must not
        # leak into the sum, so the finite part is reduced and the masks re-applied.
        inf = torch.isinf(out) & (out > 0)
        out = torch.nan_to_num(out, nan=-1e30, posinf=0.0, neginf=-1e30)
        self.all_reduce_sum(out)
        failed_anywhere = bool(out[n] > 0)
        out = out[:n] / self.world_size
        out[inf[:n]] = float("inf")
        return out, failed_anywhere

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


@dataclass(frozen=True)
class RankVote:
    """Sums small integer tallies over the TP group, so that every rank takes the same decision
    from the same numbers (what failed, was skipped or is ready where)."""

    world_size: int
    all_reduce_sum: AllReduce

    def __call__(self, tally: Tensor) -> Tensor:
        out = tally.to(torch.int64).cpu().clone()
        self.all_reduce_sum(out)
        return out

    @classmethod
    def for_sglang_tp_group(cls) -> "RankVote | None":
        """The vote over SGLang's TP group, or None with a single rank (nothing to agree on)."""
        reducer = ScoreReducer.for_sglang_tp_group()
        return None if reducer is None else cls(reducer.world_size, reducer.all_reduce_sum)


def agree(vote: RankVote | None, tally: Tensor) -> Tensor:
    """The one way the ranks agree: `tally` (small integers per request, the same shape on every
    rank: what failed, was skipped or is ready here) summed over the TP group, so that every rank
    decides from the same numbers; with one rank (`vote` None) its own, and no collective. Every
    rank calls it at the same point, or none does."""
    return tally.to(torch.int64).cpu() if vote is None else vote(tally)


def anywhere(vote: RankVote | None, flags: Sequence[bool]) -> list[bool]:
    """Per flag, whether it holds on any rank (`agree`)."""
    return (agree(vote, torch.tensor(list(flags), dtype=torch.int64, device="cpu")) > 0).tolist()


def everywhere(vote: RankVote | None, flags: Sequence[bool]) -> list[bool]:
    """Per flag, whether it holds on every rank (`agree`)."""
    ranks = 1 if vote is None else vote.world_size
    return (agree(vote, torch.tensor(list(flags), dtype=torch.int64, device="cpu")) == ranks).tolist()


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
