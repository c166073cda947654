"""Engine-agnostic interface of a KV-cache eviction policy.

A policy is plain torch on tensors: it sees, for one layer of one request, the cached keys (and, for
the policies that read them, the values), the last few observation queries, the logical RoPE
positions and (for policies that need it) an attention statistic it maintains itself through
:meth:`Policy.accumulate`; it answers which tokens to keep.
Nothing here knows SGLang; the adapter layer translates.

Protocol for the caller (the adapter):

* After prefill: ``k = policy.prefill_target_length(n)``; if not None, compress to ``k``.
* Before every decode step: ``k = policy.target_length(n)``; if not None, compress to ``k``.
* Before it would have to preempt: compress to ``params.budget`` (or any size) with ``select``.
* To compress: build one :class:`LayerView` per layer (same ``n`` for all), call
  ``keep = policy.select(views, k)``, gather the KV of ``keep`` (sorted, so cache order and
  increasing positions are preserved), and replace each layer's statistic by
  ``policy.carry_stats(view, keep)``.
* Statistics (only when ``policy.uses_stats``): after each forward pass, per layer,
  ``stats = policy.accumulate(stats, probs, n_kv_heads)`` with the softmax probabilities of that
  pass's queries over all ``n`` cached tokens (causal masking applied). Feed prefill passes too only
  when ``policy.accumulate_prefill``. ``accumulate`` is additive over query rows, so a long prefill
  can be fed in row blocks; a statistic narrower than ``n`` (tokens appended since the last call) is
  zero-padded on the right.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ._ops import group_probs


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


RKV_EXEMPTIONS: tuple[str, ...] = ("own", "recent")  # see PolicyParams.rkv_exemption


@dataclass(frozen=True)
class PolicyParams:
    """Hyper-parameters shared by all policies (each policy reads the ones it needs).

    These defaults are the single source of the command-line defaults.
    """

    budget: int = 128
    """B_budget: tokens kept per request after a compression (observation window included)."""
    buffer: int = 128
    """B_buffer: tokens allowed to accumulate above the budget before a decode-time compression."""
    window: int = 8
    """alpha (R-KV) / w (SnapKV, KV-Compress): number of observation queries, kept as protected."""
    keep_recent: int = 0
    """Most recent tokens always kept by the policies that protect their observation window
    (R-KV, SnapKV, KV-Compress, Expected Attention, KeyDiff), when more than ``window``; 0 keeps
    the window only, as the papers do. Not a paper setting: it keeps recent text without widening
    the observation window."""
    rkv_lambda: float = 0.1
    """R-KV lambda of eq. (7) (the paper's 0.1; the public code uses 0.07)."""
    rkv_threshold: float = 0.5
    """R-KV similarity threshold T (Alg. 1 line 24); from the public code."""
    rkv_beta: int = 1
    """R-KV beta: most recent highly-similar tokens exempted (Alg. 1 lines 25-31)."""
    rkv_exemption: str = "own"
    """Whose mean similarity (eq. 6) loses a token's similarity to its beta most recent similar
    tokens (Alg. 1 lines 25-31): "own", the token's (Alg. 1 and eq. 6 as printed), or "recent",
    the recent token's (the public code), which leaves the newest of similar tokens least
    redundant."""
    rkv_reference_keys: int = 1024
    """R-KV redundancy (eq. 6) is exact up to this many candidates; above, each candidate's mean
    similarity is estimated against this many evenly spaced candidates, so a long prompt costs
    n x this instead of n^2 (decode-time passes, budget + buffer tokens, stay exact)."""
    pool_kernel: int = 7
    """Odd 1-D max-pool kernel (SnapKV / KV-Compress eq. 8 p=7, R-KV eq. 4 / Alg. 1 line 16)."""
    sink_tokens: int = 4
    """Attention sinks: the first tokens StreamingLLM and Expected Attention (kvpress ``n_sink``)
    always keep."""
    evict_chunk: int = 64
    """Batch-Max p: tokens evicted at once by the average-attention policy (Algorithm 1)."""
    ea_future_positions: int = 512
    """Expected Attention: future positions its query distribution is averaged over (kvpress
    ``n_future_positions``)."""
    ea_covariance: bool = True
    """Expected Attention: include the query covariance term (kvpress ``use_covariance``)."""
    ea_value_norm: bool = True
    """Expected Attention: weight the expected attention by the value norm (kvpress ``use_vnorm``)."""
    ea_epsilon: float = 0.0
    """Expected Attention: added to the expected attention before the value-norm weighting
    (kvpress ``epsilon``; its class default)."""
    rope_theta: float = 10000.0
    """The served model's RoPE base. Not a flag: the adapter fills in the model's (Expected
    Attention moves observation queries to future positions with it)."""
    rope_dim: int = 0
    """The served model's rotary dimensions (its first ``rope_dim`` of each head); 0: all of them."""
    rope_neox: bool = True
    """The served model's RoPE layout: True pairs dimension i with i + rope_dim / 2 (Llama, GPT-NeoX,
    "rotate half"), False pairs 2i with 2i + 1 (GPT-J)."""

    @property
    def recent_kept(self) -> int:
        """Most recent tokens a window-protecting policy always keeps."""
        return max(self.window, self.keep_recent)

    def __post_init__(self) -> None:
        _check_int("budget", self.budget, 1)
        _check_int("buffer", self.buffer, 0)
        _check_int("window", self.window, 1)
        _check_int("keep_recent", self.keep_recent, 0)
        _check_float("rkv_lambda", self.rkv_lambda, 0.0, 1.0)
        _check_float("rkv_threshold", self.rkv_threshold, -1.0, 1.0)
        _check_int("rkv_beta", self.rkv_beta, 0)
        if self.rkv_exemption not in RKV_EXEMPTIONS:
            raise ValueError(
                f"rkv_exemption must be one of {RKV_EXEMPTIONS}, got {self.rkv_exemption!r}"
            )
        _check_int("rkv_reference_keys", self.rkv_reference_keys, 1)
        _check_int("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 != 1:
            raise ValueError(f"pool_kernel must be odd (centred window), got {self.pool_kernel}")
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("evict_chunk", self.evict_chunk, 1)
        _check_int("ea_future_positions", self.ea_future_positions, 1)
        _check_float("ea_epsilon", self.ea_epsilon, 0.0, math.inf)
        for name in ("ea_covariance", "ea_value_norm", "rope_neox"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_float("rope_theta", self.rope_theta, 1.0, math.inf)
        _check_int("rope_dim", self.rope_dim, 0)
        if self.rope_dim % 2 != 0:
            raise ValueError(f"rope_dim must be even (dimensions rotate in pairs), got {self.rope_dim}")


@dataclass
class LayerView:
    """What a policy sees for ONE layer of ONE request.

    keys:      [n, H_kv, d] dequantized keys of the cached tokens, in cache order.
    queries:   [q, H_q, d] or None: the last q (<= window) observation queries; they belong to the
               LAST q cached tokens. H_q must be a multiple of H_kv; query head h uses KV head
               h // (H_q // H_kv) (KV-Compress eq. 11).
    positions: [n] logical RoPE positions, strictly increasing (gaps allowed after compaction);
               None means 0..n-1. [H_kv, n] after a per-head compaction, when every KV head
               holds its own tokens (row h increasing; entry j of head h is keys[j, h]).
    stats:     [H_kv, m] (m <= n) or None: the statistic maintained by ``Policy.accumulate``; same
               token order as keys; columns m..n-1 (tokens appended since) count as zero.
    scale:     softmax scale; None means 1/sqrt(d).
    values:    [n, H_kv, d_v] or None: the cached values, same order as keys; given only to the
               policies that read them (``Policy.uses_values``).
    query_mean: [H_q, d] or None: the mean of the request's pre-RoPE queries over its whole prompt
               read so far (``Policy.uses_query_moments``; `sgl_kvc.core.query_moments`), per query
               head; None: the policy uses the observation window's queries.
    query_cov: [H_q, d, d] or None: their covariance (divided by the query count), given with
               ``query_mean`` when the policy asks for it.
    reconstruction: [H_kv, n] or None: the scores a reconstruction pass gave the entries
               (``Policy.uses_reconstruction``; `sgl_kvc.core.reconstruction`), +inf where it
               scored nothing (always kept).
    stats_since: the logical position of the first query ``stats`` accumulated: an entry at an
               earlier position was seen by the queries from there on only. 0 for a request that
               read its whole prompt; D for one that started from a shared document of D tokens
               (`adapter/documents/__init__.py`: the document's own queries were read once, by whoever
               compressed it, and never by this request).
    """

    keys: Tensor
    queries: Tensor | None = None
    positions: Tensor | None = None
    stats: Tensor | None = None
    scale: float | None = None
    values: Tensor | None = None
    query_mean: Tensor | None = None
    query_cov: Tensor | None = None
    reconstruction: Tensor | None = None
    stats_since: int = 0

    def __post_init__(self) -> None:
        if self.keys.dim() != 3:
            raise ValueError(f"keys must be [n, H_kv, d], got shape {tuple(self.keys.shape)}")
        n, h_kv, d = self.keys.shape
        if self.queries is not None:
            if self.queries.dim() != 3 or self.queries.shape[2] != d:
                raise ValueError(
                    f"queries must be [q, H_q, {d}], got shape {tuple(self.queries.shape)}"
                )
            if self.queries.shape[1] % h_kv != 0:
                raise ValueError(
                    f"H_q={self.queries.shape[1]} is not a multiple of H_kv={h_kv}"
                )
            if self.queries.shape[0] > n:
                raise ValueError(f"{self.queries.shape[0]} queries for only {n} cached tokens")
        if self.positions is None:
            self.positions = torch.arange(n, device=self.keys.device)
        elif tuple(self.positions.shape) not in ((n,), (h_kv, n)):
            raise ValueError(
                f"positions must be [{n}] or [{h_kv}, {n}], got shape {tuple(self.positions.shape)}"
            )
        if self.stats is not None:
            if self.stats.dim() != 2 or self.stats.shape[0] != h_kv or self.stats.shape[1] > n:
                raise ValueError(
                    f"stats must be [{h_kv}, m<={n}], got shape {tuple(self.stats.shape)}"
                )
        if self.values is not None:
            if self.values.dim() != 3 or tuple(self.values.shape[:2]) != (n, h_kv):
                raise ValueError(f"values must be [{n}, {h_kv}, d_v], got shape {tuple(self.values.shape)}")
        if self.query_mean is not None:
            if self.query_mean.dim() != 2 or self.query_mean.shape[1] != d or self.query_mean.shape[0] % h_kv:
                raise ValueError(f"query_mean must be [H_q, {d}], H_q a multiple of {h_kv}, "
                                 f"got shape {tuple(self.query_mean.shape)}")
            if self.query_cov is not None and tuple(self.query_cov.shape) != (self.query_mean.shape[0], d, d):
                raise ValueError(f"query_cov must be [{self.query_mean.shape[0]}, {d}, {d}], "
                                 f"got shape {tuple(self.query_cov.shape)}")
        elif self.query_cov is not None:
            raise ValueError("query_cov needs query_mean")
        if self.reconstruction is not None and tuple(self.reconstruction.shape) != (h_kv, n):
            raise ValueError(f"reconstruction must be [{h_kv}, {n}], got shape {tuple(self.reconstruction.shape)}")
        if self.scale is None:
            self.scale = 1.0 / math.sqrt(d)

    @property
    def n(self) -> int:
        return int(self.keys.shape[0])

    def observation_queries(self, policy: str, window: int) -> Tensor:
        """The last ``window`` observation queries as float32 [q, H_q, d]; a policy that scores
        by them (SnapKV, R-KV, KV-Compress, Expected Attention) cannot run without any."""
        if self.queries is None or self.queries.shape[0] == 0:
            raise ValueError(
                f"policy {policy!r} needs observation queries (LayerView.queries) to score tokens"
            )
        return self.queries[-window:].float()

    @property
    def n_kv_heads(self) -> int:
        return int(self.keys.shape[1])

    def head(self, h: int) -> "LayerView":
        """The view of KV head h alone (its keys, its query group, its statistic and positions).
        Every policy scores a KV head from these only, so per-head selection may run one head
        at a time (staged passes) and choose what the whole layer's selection chooses."""
        group = None if self.queries is None else self.queries.shape[1] // self.n_kv_heads
        positions = self.positions
        mean, cov = self.query_mean, self.query_cov
        if mean is not None:
            g = mean.shape[0] // self.n_kv_heads
            mean = mean[h * g : (h + 1) * g]
            cov = None if cov is None else cov[h * g : (h + 1) * g]
        return LayerView(
            keys=self.keys[:, h : h + 1],
            queries=None if group is None else self.queries[:, h * group : (h + 1) * group],
            positions=positions[h : h + 1] if positions.dim() > 1 else positions,
            stats=None if self.stats is None else self.stats[h : h + 1],
            scale=self.scale,
            values=None if self.values is None else self.values[:, h : h + 1],
            query_mean=mean,
            query_cov=cov,
            reconstruction=None if self.reconstruction is None else self.reconstruction[h : h + 1],
            stats_since=self.stats_since,
        )


def pad_stats(stats: Tensor, n: int) -> Tensor:
    """Float32 copy of ``stats`` [H_kv, m] widened with zero columns to [H_kv, n]."""
    stats = stats.float()
    m = stats.shape[1]
    if m > n:
        raise ValueError(f"stats cover {m} tokens but only {n} are cached")
    if m == n:
        return stats
    return torch.nn.functional.pad(stats, (0, n - m))


class Policy(ABC):
    """One eviction policy. Subclasses implement :meth:`_score` and override rules as needed."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    """Earlier names of the policy, still accepted wherever a policy is named (flags, requests)."""
    uses_stats: ClassVar[bool] = False
    """Whether the caller must maintain ``stats`` through :meth:`accumulate`."""
    contribution_power: ClassVar[int] = 0
    """When :meth:`contribution` is the sum over queries and the query group of the attention to
    this power (1 or 2), that power: a decode step's kernel then computes it without the
    probabilities (`kernels/triton_stats.py`); 0: only :meth:`contribution` knows."""
    accumulate_prefill: ClassVar[bool] = False
    """Whether prefill queries are fed to :meth:`accumulate` too (else decode queries only)."""
    compress_after_prefill: ClassVar[bool] = False
    """Whether the policy compresses right after prefill (see :meth:`prefill_target_length`)."""
    uses_values: ClassVar[bool] = False
    """Whether the policy reads the cached values (``LayerView.values``); the caller reads them
    from the pool only for such a policy."""
    uses_query_moments: ClassVar[bool] = False
    """Whether the policy, compressing a prompt, reads the moments of every query of the prompt
    read so far (``LayerView.query_mean``, ``query_cov``); the caller accumulates them while the
    prompt is prefilled (`sgl_kvc.core.query_moments`) only for a request whose prompt policy
    asks, with :meth:`prerope_queries` to undo RoPE."""
    uses_reconstruction: ClassVar[bool] = False
    """Whether the policy scores a prompt from a reconstruction pass (KVzip): the caller runs the
    pass at a prompt moment before the policy chooses and gives its scores in
    ``LayerView.reconstruction``."""
    prompt_only: ClassVar[bool] = False
    """Whether the policy compresses prompts only (a prompt policy, never a request's policy)."""
    question_free: ClassVar[bool] = False
    """Whether the policy chooses what a prompt keeps without reading any query of the prompt (no
    observation window, no query statistics): only such a policy compresses a document before the
    questions that will be asked about it (`kv_compression.document`)."""
    reads_window: ClassVar[bool] = False
    """Whether the policy scores a prompt from its observation window (``LayerView.queries``: the
    last ``window`` queries). A prompt cut between its chunks before its question is read gets its
    question's queries there, from one forward of the prompt's end (`--kv-chunk-window question`),
    as the pass after its last chunk would."""
    global_sort: ClassVar[bool] = False
    """Whether the policy's scores are comparable across layers and heads, so that where heads may
    keep different numbers of entries (the unit pool: `--kv-head-budget variable` or `layer`) one
    sort over layer x head x entry chooses what the request keeps, whatever the server's mode; where
    every head keeps the same number (uniform budgets), one sort over the tokens, by their mean
    score over every layer and head, and every head keeps those (`per_head.token_scores`)."""
    variable_sort: ClassVar[bool] = False
    """Whether, on a `--kv-head-budget variable` server, one sort over layer x head x entry chooses
    what the request keeps, as the policy's paper does (KV-Compress §4.2). Otherwise each layer
    keeps its share (budget x KV heads) and its heads split it by one sort (Ada-KV's allocation),
    as under `layer`: attention sums do not compare across layers, and one sort over them hands the
    diffuse early layers most of the budget (SnapKV kept 1 of 7 answers that way on SmolLM2, 5 per
    layer; docs/quality.md, "Which allocation each policy gets")."""
    prompt_policy: ClassVar[str | None] = None
    """The policy that compresses the prompt (the prefill and chunk moments) when the user leaves
    it to this one (``--prompt-policy auto``); None: this policy itself. A decode-time method
    names a prompt method here (R-KV: SnapKV)."""

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params if params is not None else PolicyParams()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"

    def prerope_queries(self, queries: Tensor, positions: Tensor) -> Tensor:
        """The queries [e, H_q, d] (after RoPE, at logical ``positions`` [e]) before RoPE, for
        :attr:`uses_query_moments` policies."""
        raise NotImplementedError(f"policy {self.name!r} reads no query moments")

    # ---- scoring -------------------------------------------------------------------------------
    @abstractmethod
    def _score(self, view: LayerView) -> Tensor:
        """Raw float32 scores [H_kv, n], higher = keep; values at protected tokens are ignored."""

    def score(self, view: LayerView) -> Tensor:
        """Float32 scores [H_kv, n] per KV head, higher = keep; protected tokens score +inf."""
        scores = self._score(view).float().clone()
        return scores.masked_fill_(self.protected(view), math.inf)  # a mask, not an index: no device sync

    def protected(self, view: LayerView) -> Tensor:
        """Bool [n] tokens always kept. Default: the observation window (last ``window`` tokens),
        or the last ``keep_recent`` if more."""
        mask = torch.zeros(view.n, dtype=torch.bool, device=view.keys.device)
        mask[max(view.n - self.params.recent_kept, 0):] = True
        return mask

    # ---- statistics ----------------------------------------------------------------------------
    def accumulate(self, stats: Tensor | None, probs: Tensor, n_kv_heads: int) -> Tensor:
        """Updated statistic [H_kv, n] from ``probs`` [H_q, q_len, n] of new queries."""
        grouped, base = group_probs(stats, probs, n_kv_heads)
        return base + self.contribution(grouped)

    def contribution(self, grouped: Tensor) -> Tensor:
        """What new queries add to the statistic: float32 ``grouped`` [..., H_kv, G, q_len, n]
        (softmax attention, query heads grouped by KV head) -> [..., H_kv, n]. Batched over any
        leading dims, so a decode step computes it for all its requests at once."""
        raise NotImplementedError(f"policy {self.name!r} does not use attention statistics")

    def carry_stats(self, view: LayerView, keep: Tensor) -> Tensor | None:
        """Statistic to keep for the next cycle after the cache was compacted to ``keep``."""
        if view.stats is None:
            return None
        return pad_stats(view.stats, view.n)[:, keep]

    def score_cost(self, n: int) -> int:
        """Relative cost of scoring one layer of n cached tokens, in units of one token of a
        linear-cost scorer (what a staged pass budgets per scheduler step)."""
        return n

    # ---- when and to what size -----------------------------------------------------------------
    def target_length(self, n: int) -> int | None:
        """Decode-time rule: size to compress to before the next decode step, or None.

        Default (amortised, R-KV §3.1 style): once n >= budget + buffer, trim to budget, so the
        cache oscillates between budget and budget + buffer and a compression runs every
        ``buffer`` steps instead of every step.
        """
        p = self.params
        if n >= p.budget + p.buffer and n > p.budget:
            return p.budget
        return None

    def prefill_target_length(self, n: int) -> int | None:
        """Size to compress to right after prefill, or None."""
        if self.compress_after_prefill and n > self.params.budget:
            return self.params.budget
        return None

    # ---- selection -----------------------------------------------------------------------------
    def combined_score(self, views: Sequence[LayerView]) -> Tensor:
        """Float32 [n]: mean over KV heads (R-KV Alg. 1 line 44), then mean over layers."""
        if len(views) == 0:
            raise ValueError("select needs at least one LayerView")
        n = views[0].n
        total: Tensor | None = None
        for view in views:
            if view.n != n:
                raise ValueError(f"all layers must hold the same tokens: {view.n} != {n}")
            per_layer = self.score(view).mean(dim=0)
            total = per_layer if total is None else total + per_layer
        assert total is not None
        return total / len(views)

    def select(
        self,
        views: Sequence[LayerView],
        keep: int,
        reduce: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Sorted int64 indices (into 0..n-1) of the ``min(keep, n)`` tokens to keep.

        Protected tokens (union over layers) come first; if there are more of them than ``keep``,
        the most recent ``keep`` protected tokens are kept. The remaining slots go to the highest
        combined scores; ties go to the lower index (stable sort). NaN scores rank last.
        ``reduce`` maps the combined [n] score before choosing: with tensor parallelism, the mean
        over the ranks' head shards, so that all ranks choose the same tokens.
        """
        combined = self.combined_score(views)
        if reduce is not None:
            combined = reduce(combined)
        return self.choose(views, combined, keep)

    def choose(self, views: Sequence[LayerView], combined: Tensor, keep: int) -> Tensor:
        """`select`'s choice from a combined [n] score already computed (and reduced)."""
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        n = combined.shape[0]
        device = combined.device
        keep = min(keep, n)
        prot = torch.zeros(n, dtype=torch.bool, device=device)
        for view in views:
            prot |= self.protected(view)
        prot_idx = torch.nonzero(prot).flatten()
        if prot_idx.numel() >= keep:
            chosen = prot_idx[prot_idx.numel() - keep:]
        else:
            cand_idx = torch.nonzero(~prot).flatten()
            cand = torch.nan_to_num(combined[cand_idx], nan=-math.inf)
            order = torch.sort(-cand, stable=True).indices
            chosen = torch.cat([prot_idx, cand_idx[order[: keep - prot_idx.numel()]]])
        return torch.sort(chosen).values
