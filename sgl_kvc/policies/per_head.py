"""Per-(layer, KV head) selection: every KV head of every layer keeps its own tokens.

:meth:`Policy.select` averages the per-head scores over heads and layers and keeps ONE set for the
whole request, because SGLang's single ``req_to_token`` table can hold only one. That shared set
is what loses quality (measured: docs/quality.md, "Per-head selection is what the papers' quality
needs"). Here each (layer, KV head) ranks its own scores ``Policy.score(view)[h]`` and keeps its own
tokens, as the papers do (SnapKV and R-KV select per head; KV-Compress §4.1 per KV head with the
query group summed, eq. 9-10). Nothing here changes a policy's scoring, protection or timing.

Two budget modes (``budget`` is the per-request budget in tokens, as in ``PolicyParams.budget``):

* ``"uniform"``: each (layer, head) keeps exactly ``min(budget, n)`` tokens: its protected tokens
  (observation window, sinks, H2O's recent half; the newest ones if there are more than
  ``budget``) plus its best-scoring candidates.
* ``"variable"``: KV-Compress's variable-head-rate allocation (§4.2, following Ada-SnapKV, extended
  across layers). The request keeps ``budget x L x H_kv`` (token, head) pairs in total, the number
  of KVs an input of ``budget`` tokens would hold (§5.1), chosen by ONE sort over the flattened
  layer x head x token metrics (§4.2: "sorting metrics over a flattened tensor where head and
  sequence length dimensions are combined"). With SGLang's page size 1 the block schedule of
  eq. 16-18 reduces to exactly this: for b = 1, m(h, e) (eq. 17) is head h's e-th smallest metric,
  and eq. 18 evicts the request's E_s globally smallest ones. Every head first keeps its protected
  tokens (KV-Compress §3: keys of the observation window are safe from eviction) and at least
  ``min_per_head`` tokens (not in the paper: a floor so that no head is ever emptied, which
  matters for policies with nothing protected, e.g. batchmax); the rest of the budget goes to the
  globally highest metrics.
* ``"layer"``: Ada-SnapKV's allocation as KV-Compress §4.2 describes it ("sorting metrics over a
  flattened tensor where head and sequence length dimensions are combined, then selecting ... the
  first eH metrics"): the same sort, but within each layer, which keeps ``budget x H_kv`` pairs;
  heads of a layer share its budget, layers keep equal shares. Same floors as ``"variable"``.
  On a row whose layers hold different numbers (packed by an earlier pass of one sort over every
  head), what a layer cannot use of its share goes to the others alike, so that the request still
  keeps ``budget x L x H_kv`` pairs (`layer_shares`); where every layer holds its share that is
  Ada-SnapKV's split.

Comparability of scores across heads and layers (needed by the variable and layer modes only): like
KV-Compress and Ada-SnapKV we sort the RAW metrics, with no per-head normalisation. Each metric
is already on a common scale: SnapKV, H2O, batchmax and KV-Compress sum (squared) softmax
probabilities, and every query head spreads exactly mass 1 over the keys it sees, so every KV head
of every layer receives the same total mass from the same queries; R-KV's Z (eq. 7) is a
difference of two distributions over the candidates (importance and softmax redundancy), again
mass 1 per head; StreamingLLM's recency is identical in every head; KeyDiff's minus cosine lies in
[-1, 1] in every head; Expected Attention's expected softmax also has mass 1 per head, weighted by
the value norms (kvpress sorts it across heads under AdaKV the same way). The squared attention of
KV-Compress (§4.3) deliberately gives sharp heads larger metrics; normalising would undo that.

Tie-breaking (deterministic, documented so the tests' references can follow it): within a head,
higher score first, then the lower token index (as :meth:`Policy.select`); surplus protected
tokens, newest first. In the variable mode's global sort, equal metrics go to the lower per-head
rank first, then to the lower (layer, head): when all heads hold identical scores the allocation
is therefore exactly uniform.

The result is a :class:`HeadSelection`: kept columns per (layer, head), ascending, padded
to a rectangle, plus per-head lengths. Tensor parallelism: a rank scores and selects only its own
KV heads; see ``docs/per-head-eviction.md`` for why no all-reduce is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal

import torch
from torch import Tensor

from .base import LayerView, Policy

BudgetMode = Literal["uniform", "policy", "variable", "layer"]
BUDGET_MODES: tuple[str, ...] = ("uniform", "policy", "variable", "layer")
# How a request's kept tokens are chosen: each (layer, KV head) its own ("per-head", what the
# papers do), or one set for the whole request ("shared": scores averaged over heads and layers).
SELECTIONS: tuple[str, ...] = ("per-head", "shared")
DEFAULT_SELECTION = "per-head"


@dataclass(frozen=True)
class HeadSelection:
    """Kept tokens of one request per (layer, KV head).

    indices: int64 [L, H_kv, max_keep]: kept columns (indices into the n entries each head's view
             held: physical indices of the row, or columns of a head's table),
             ascending per head; entries at or beyond ``lengths[l, h]`` are :attr:`PAD`.
    lengths: int64 [L, H_kv]: how many tokens each head keeps.
    n:       number of columns the views held before the selection.
    """

    indices: Tensor
    lengths: Tensor
    n: int

    PAD: ClassVar[int] = -1

    def __post_init__(self) -> None:
        if self.indices.dim() != 3 or self.lengths.shape != self.indices.shape[:2]:
            raise ValueError(
                f"indices must be [L, H, K] and lengths [L, H], got {tuple(self.indices.shape)} "
                f"and {tuple(self.lengths.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return int(self.indices.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.indices.shape[1])

    @property
    def max_keep(self) -> int:
        return int(self.indices.shape[2])

    @property
    def total(self) -> int:
        """Entries kept over all layers and heads: the request's footprint in units."""
        return int(self.lengths.sum())

    def valid(self) -> Tensor:
        """Bool [L, H, max_keep]: which entries of :attr:`indices` are real."""
        cols = torch.arange(self.max_keep, device=self.indices.device)
        return cols < self.lengths.unsqueeze(-1)

    @cached_property
    def host_lengths(self) -> list[list[int]]:
        """`lengths` on the host, read once (one GPU wait, not one per (layer, head) kept)."""
        return self.lengths.tolist()

    def kept(self, layer: int, head: int) -> Tensor:
        """Ascending int64 columns kept by one (layer, head)."""
        return self.indices[layer, head, : self.host_lengths[layer][head]]

    def gather(self, layer: int, x: Tensor, fill: float = 0.0) -> Tensor:
        """Per-head gather of a layer's per-token tensor.

        ``x``: [H_kv, n, *rest] (e.g. a statistic [H_kv, n]) -> [H_kv, max_keep, *rest], row h
        holding ``x[h, kept(layer, h)]`` followed by ``fill`` in the padding.
        """
        if x.shape[0] != self.num_heads or x.shape[1] != self.n:
            raise ValueError(
                f"x must be [{self.num_heads}, {self.n}, ...], got {tuple(x.shape)}"
            )
        valid = self.valid()[layer]  # [H, K]
        idx = torch.where(valid, self.indices[layer], 0).to(x.device)
        view_idx = idx.reshape(*idx.shape, *([1] * (x.dim() - 2))).expand(
            *idx.shape, *x.shape[2:]
        )
        out = torch.gather(x, 1, view_idx)
        pad = (~valid).to(x.device).reshape(*valid.shape, *([1] * (x.dim() - 2)))
        return out.masked_fill(pad, fill)

    @classmethod
    def broadcast(cls, keep: Tensor, num_layers: int, num_heads: int, n: int) -> "HeadSelection":
        """The shared selection ``keep`` [k] (as :meth:`Policy.select` returns) for every head."""
        keep = torch.sort(keep.to(torch.int64)).values
        idx = keep.expand(num_layers, num_heads, keep.numel()).clone()
        lengths = torch.full((num_layers, num_heads), keep.numel(), dtype=torch.int64,
                             device=keep.device)
        return cls(indices=idx, lengths=lengths, n=n)


def _stack_views(
    policy: Policy, views: Sequence[LayerView]
) -> tuple[Tensor, Tensor]:
    """(scores [L, H, n] float32, protected [L, n] bool) for views of equal n and H_kv."""
    if len(views) == 0:
        raise ValueError("select_per_head needs at least one LayerView")
    n, h = views[0].n, views[0].n_kv_heads
    for view in views:
        if view.n != n or view.n_kv_heads != h:
            raise ValueError(
                f"all layers must hold the same tokens and heads: ({view.n}, {view.n_kv_heads})"
                f" != ({n}, {h})"
            )
    scores = torch.stack([policy.score(view) for view in views])
    protected = torch.stack([policy.protected(view).to(scores.device) for view in views])
    return scores, protected


def rank_per_head(
    scores: Tensor, protected: Tensor, lengths: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Each head's tokens, best first.

    scores [L, H, N]; protected [L, N] or [L, H, N]; lengths [L, H] or None (all N real) ->
    (order [L, H, N] int64 columns, keys [L, H, N] float32 sort keys in that order,
    non-increasing). Protected tokens come first (key +inf), newest first; then candidates by
    score, ties to the lower index; NaN ranks last (-inf); padding (index >= length) after all.
    """
    num_layers, num_heads, n = scores.shape
    idx = torch.arange(n, device=scores.device)
    if protected.dim() == 2:
        protected = protected.unsqueeze(1)
    protected = protected.expand(num_layers, num_heads, n).to(scores.device)
    real = (
        torch.ones_like(protected) if lengths is None
        else idx < lengths.to(scores.device).unsqueeze(-1)
    )
    protected = protected & real
    finite_max = torch.finfo(torch.float32).max
    keys = torch.nan_to_num(scores.float(), nan=-math.inf, posinf=finite_max)
    keys = torch.where(protected, math.inf, torch.where(real, keys, -math.inf))
    # Two stable sorts = one lexicographic sort: first by the tie-break (protected newest first,
    # then candidates oldest first, then padding), then by key, descending.
    tie = torch.where(protected, -1 - idx, torch.where(real, idx, n + idx))
    pre = torch.argsort(tie, dim=-1, stable=True)
    pre_keys = keys.gather(-1, pre)
    sorted_keys, perm = torch.sort(pre_keys, dim=-1, descending=True, stable=True)
    return pre.gather(-1, perm), sorted_keys


def _first_k_sorted(order: Tensor, counts: Tensor, n: int, k_max: int | None = None) -> tuple[Tensor, Tensor]:
    """The first counts[l, h] entries of each head's ranking, ascending, padded with PAD.
    `k_max`: the largest count when the caller knows it on the host (else read from the device)."""
    if k_max is None:
        k_max = int(counts.max()) if counts.numel() else 0
    head = order[..., :k_max]
    valid = torch.arange(k_max, device=order.device) < counts.unsqueeze(-1)
    head = torch.where(valid, head, n)  # padding sorts last
    head = torch.sort(head, dim=-1).values
    return torch.where(head == n, HeadSelection.PAD, head), counts.to(torch.int64)


def _check_args(budget: int, mode: str, min_per_head: int) -> None:
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be a positive integer, got {budget!r}")
    if mode not in BUDGET_MODES:
        raise ValueError(f"mode must be one of {BUDGET_MODES}, got {mode!r}")
    if not isinstance(min_per_head, int) or not 1 <= min_per_head <= budget:
        raise ValueError(
            f"min_per_head must be an integer in [1, budget={budget}], got {min_per_head!r}"
        )


def select_from_scores(
    scores: Tensor,
    protected: Tensor,
    budget: int,
    *,
    lengths: Tensor | None = None,
    mode: BudgetMode = "uniform",
    min_per_head: int = 1,
) -> HeadSelection:
    """Per-(layer, head) selection from per-head scores (the core of :func:`select_per_head`).

    scores [L, H, N] (higher = keep); protected bool [L, N] or [L, H, N] (always kept, newest
    first if a head has more than ``budget``); lengths int [L, H] or None: head (l, h) holds only
    its first lengths[l, h] entries (ragged tables after an earlier per-head compaction; the
    padding is never kept). Indices in the result are positions in each head's own table.

    Uniform: head (l, h) keeps min(budget, lengths[l, h]). Variable (KV-Compress §4.2): the
    request keeps min(budget x L x H, sum(lengths)) entries in total, each head at least
    min(max(min_per_head, its protected count), budget, its length); the rest by one sort.
    Layer (Ada-SnapKV): the same within each layer, which keeps its share of the request's total
    (`layer_shares`): min(budget x H, its lengths) where every layer holds as much.
    """
    _check_args(budget, mode, min_per_head)
    if scores.dim() != 3:
        raise ValueError(f"scores must be [L, H, N], got {tuple(scores.shape)}")
    num_layers, num_heads, n = scores.shape
    device = scores.device
    known = None  # the uniform width, known on the host when every head holds all n entries
    if lengths is None:
        lengths = torch.full((num_layers, num_heads), n, dtype=torch.int64, device=device)
        known = min(budget, n)
    else:
        lengths = lengths.to(device=device, dtype=torch.int64)
        bad = bool((lengths < 0).any() | (lengths > n).any())
        if lengths.shape != (num_layers, num_heads) or bad:
            raise ValueError(f"lengths must be [{num_layers}, {num_heads}] in [0, {n}]")
    order, keys = rank_per_head(scores, protected, lengths)
    per_head = lengths.clamp(max=budget)  # [L, H]
    if mode == "uniform":
        indices, counts = _first_k_sorted(order, per_head, n, known)
        return HeadSelection(indices=indices, lengths=counts, n=n)

    # --- variable: KV-Compress §4.2, one sort over layer x head x token (layer: per layer) -----
    # Mandatory part of every head: its protected tokens (KV-Compress §3: the observation window
    # is safe from eviction) and the floor min_per_head, capped at the per-head budget so the
    # request total stays budget x L x H. A head with more protected tokens than that keeps its
    # newest ones here; the others compete (key +inf) in the global sort below.
    prot = protected.unsqueeze(1) if protected.dim() == 2 else protected
    idx = torch.arange(n, device=device)
    n_protected = (
        prot.to(device).expand(num_layers, num_heads, n) & (idx < lengths.unsqueeze(-1))
    ).sum(dim=-1)
    mandatory = torch.minimum(n_protected.clamp(min=min_per_head), per_head)
    # §5.1: as many KVs over all layers and heads as an input of `budget` tokens holds; the
    # layer mode sorts each layer alone (a group of H heads), the variable mode the whole request.
    groups = num_layers if mode == "layer" else 1
    heads_per_group = num_layers * num_heads // groups
    held = lengths.reshape(groups, -1).sum(dim=-1)
    total = layer_shares(held, budget * num_layers * num_heads) if mode == "layer" else held.clamp(
        max=budget * heads_per_group)
    remaining = total - mandatory.reshape(groups, -1).sum(dim=-1)  # [groups]
    # Eq. 16-17 with block size b = 1: the candidates of head h, in its ranking order, beyond its
    # mandatory prefix. Eq. 18: keep the `remaining` largest of each group (= evict the smallest).
    # Rank-major flattening ([N, heads of the group]) + stable sort: equal metrics go to the
    # lower rank first, then to the lower (layer, head).
    eligible = (idx >= mandatory.unsqueeze(-1)) & (idx < lengths.unsqueeze(-1))  # by rank
    lowest = torch.finfo(torch.float32).min
    flat = torch.where(eligible, keys.clamp(min=lowest), -math.inf)
    flat = flat.reshape(groups, heads_per_group, n).transpose(1, 2).reshape(groups, -1)
    order_g = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    take = torch.arange(flat.shape[1], device=device)[None, :] < remaining[:, None]
    head_of = order_g % heads_per_group  # rank-major: index = r x heads_per_group + head
    extra = torch.zeros(groups, heads_per_group, dtype=torch.int64, device=device)
    extra.scatter_add_(1, head_of, take.to(torch.int64))
    counts = mandatory + extra.reshape(num_layers, num_heads)
    # Within a head the global order follows its ranking, so the chosen ones are a prefix of it.
    indices, counts = _first_k_sorted(order, counts, n)
    return HeadSelection(indices=indices, lengths=counts, n=n)


def layer_shares(held: Tensor, budget: int) -> Tensor:
    """The entries each layer keeps in the layer mode, of the request's `budget` (budget x L x
    H_kv), where layer l holds `held[l]` (int64 [L]): Ada-SnapKV's equal shares, min(budget / L,
    held[l]), and what a layer cannot use of its share goes to the others alike (the largest
    level s with sum(min(held, s)) <= budget; the lower layers take what rounding leaves), so
    that the request keeps min(budget, sum(held)). Where every layer holds its share, as on any
    row no earlier pass packed, that is Ada-SnapKV's split; a share is never below it, so every
    head's floor fits. A row packed by one sort over every head (KVzip's, `Policy.global_sort`)
    holds unequal layers: with equal shares its narrow layers could not use theirs, its widest
    were cut to budget / L, and the request kept less than its budget (a conversation's first
    decode pass kept 272 entries a head of 349, 225 of its document's 317: docs/quality.md,
    Conversations). No host read (`test_pass_syncs`)."""
    held = held.to(torch.int64)
    groups = held.numel()
    if groups == 0:
        return held.clone()
    keep = held.sum().clamp(max=budget)
    ordered = held.sort().values  # ascending
    before = torch.cumsum(ordered, 0) - ordered  # sum of the j smaller ones
    capped = torch.arange(groups, 0, -1, device=held.device)  # layers at or above the j-th
    # F(h_j) = before_j + capped_j x h_j is what a level at the j-th smallest keeps; the level is
    # in [h_{j*-1}, h_{j*}) for j* the count of those within the budget
    j = (before + capped * ordered <= keep).sum().clamp(max=groups - 1).reshape(1)
    level = ((keep - before.index_select(0, j)) // capped.index_select(0, j))[0]  # (a tensor index reads the host)
    shares = torch.minimum(held, level)
    left = keep - shares.sum()
    above = held > level
    shares = shares + (above & (torch.cumsum(above.to(torch.int64), 0) <= left)).to(torch.int64)
    return torch.where(keep >= held.sum(), held, shares)


def token_scores(scores: Tensor, positions: Tensor) -> Tensor:
    """Each entry's score replaced by its token's: the mean over every (layer, head) that holds the
    token (the same logical position), +inf where any of them protects it.

    scores [L, H, N]; positions [N] or [L, H, N] (each head's own after an earlier per-head
    compaction). A uniform top-k over the result keeps the same tokens in every head wherever the
    heads hold the same ones: how a policy whose scores are for one sort over every head
    (`Policy.global_sort`) keeps what it needs where every head must keep the same number. With
    tensor parallelism each rank averages over the KV heads it holds.
    """
    num_layers, num_heads, n = scores.shape
    pos = positions.to(device=scores.device, dtype=torch.int64).expand(num_layers, num_heads, n).reshape(-1)
    values = torch.nan_to_num(scores.float(), nan=0.0, posinf=math.inf, neginf=0.0).reshape(-1)
    size = int(pos.max()) + 1 if pos.numel() else 0
    sums = torch.zeros(size, dtype=torch.float32, device=scores.device).index_add_(0, pos, values)
    counts = torch.zeros(size, dtype=torch.float32, device=scores.device).index_add_(0, pos, torch.ones_like(values))
    return (sums / counts.clamp(min=1.0))[pos].reshape(num_layers, num_heads, n)


def select_per_head(
    policy: Policy,
    views: Sequence[LayerView],
    budget: int,
    *,
    mode: BudgetMode = "uniform",
    min_per_head: int = 1,
) -> HeadSelection:
    """Kept tokens per (layer, KV head) of one request.

    ``views``: one :class:`LayerView` per layer, all with the same n tokens and H_kv heads.
    ``budget``: tokens per head in the uniform mode; in the variable mode the request keeps
    ``min(budget, n) x L x H_kv`` (token, head) pairs in total (KV-Compress §5.1). ``min_per_head``
    (variable mode, 1 <= min_per_head <= budget): no head keeps fewer tokens than this (or n).
    Scores are ``policy.score(view)`` per head, protected tokens ``policy.protected(view)``.
    """
    _check_args(budget, mode, min_per_head)
    scores, protected = _stack_views(policy, views)
    return select_from_scores(scores, protected, budget, mode=mode, min_per_head=min_per_head)


def carry_stats_per_head(
    policy: Policy, views: Iterable[LayerView], selection: HeadSelection
) -> list[Tensor | None]:
    """Per-layer statistic [H_kv, max_keep] (zero padded) to keep after a per-head compaction.

    Uses the policy's own :meth:`Policy.carry_stats` on all n tokens (for KV-Compress that seeds
    eq. 20 with M^(pool)), then gathers each head's kept tokens.
    """
    out: list[Tensor | None] = []
    for layer, view in enumerate(views):
        everything = torch.arange(view.n, device=view.keys.device)
        full = policy.carry_stats(view, everything)
        out.append(None if full is None else selection.gather(layer, full))
    return out
