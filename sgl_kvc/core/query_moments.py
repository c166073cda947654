"""Running moments of one request's pre-RoPE queries over its whole prompt, per layer and query head.

Expected Attention models the queries to come as a Gaussian fitted to the queries read so far:
kvpress's `ExpectedAttentionPress.get_query_statistics` (its docstring's step 1, "Compute the mean
and covariance matrix of the queries before RoPE") takes every pre-RoPE query of the context but
the first ``n_sink``, per query head:

    mu = (1/N) sum_s q~_s,    Sigma = (1/N) sum_s (q~_s - mu)(q~_s - mu)^T

(``mu = query_states.mean(dim=2)``, ``cov = einsum(centered, centered) / h.shape[1]``: divided by
N, not N - 1). A prompt read in chunks never holds all its queries at once, so they are folded in
chunk by chunk: each chunk's mean and scatter (sum of centred outer products) merge with the
running ones by the pairwise update of Chan, Golub and LeVeque (1979),

    n = n_a + n_b,  delta = mu_b - mu_a,  mu = mu_a + delta n_b / n,
    M = M_a + M_b + delta delta^T n_a n_b / n,

which is exact (the same mean and scatter as one pass over all the queries) and, unlike a running
sum of outer products minus N mu mu^T, does not cancel in float32.

Which queries count: those the request computed itself, at logical positions >= ``sink_tokens``.
A request that reused a cached prefix (the radix tree) never computed that prefix's queries, and
SGLang does not keep them: its moments cover the rest of the prompt (at least its last token,
which SGLang always recomputes). A layer with no query counted yet (a prompt no longer than the
sinks) has no moments, and the policy falls back to the observation window's queries.

Plain torch, no SGLang: the caller (the attention backend's observation, `adapter/attention.py`)
hands each layer's queries of a chunk, after RoPE, with their logical positions; the policy undoes
RoPE (`Policy.prerope_queries`). All sizes are host integers: no device sync. Every update makes
new tensors, never writing the old ones, so a staged pass that took the moments when it began keeps
them as they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class QueryMoments:
    """Per layer: the number of pre-RoPE queries counted, their mean [H_q, d] and (with
    ``covariance``) their scatter [H_q, d, d], float32."""

    def __init__(
        self, num_layers: int, sinks: int, covariance: bool, prerope: Callable[[Tensor, Tensor], Tensor],
    ) -> None:
        self.sinks = sinks
        self.covariance = covariance
        self.prerope = prerope  # (queries after RoPE [e, H_q, d], positions [e]) -> before RoPE
        self.counts = [0] * num_layers
        self.means: list[Tensor | None] = [None] * num_layers
        self.scatters: list[Tensor | None] = [None] * num_layers

    def add(self, layer: int, queries: Tensor, positions: Tensor, first: int) -> None:
        """Fold in one chunk's queries [e, H_q, d] of `layer`, after RoPE, at logical `positions`
        [e] (a device tensor), the first of which is `first` (the same, on the host)."""
        skip = max(0, self.sinks - first)  # kvpress: hidden_states[:, n_sink:]
        e = int(queries.shape[0]) - skip
        if e <= 0:
            return
        pre = self.prerope(queries[skip:], positions[skip:]).float()  # [e, H_q, d]
        mean_b = pre.mean(dim=0)
        scatter_b = None
        if self.covariance:
            centred = (pre - mean_b).transpose(0, 1)  # [H_q, e, d]
            scatter_b = centred.transpose(1, 2) @ centred  # sum_s c_s c_s^T: [H_q, d, d]
        n_a = self.counts[layer]
        if n_a == 0:
            mean, scatter = mean_b, scatter_b
        else:  # Chan et al.'s pairwise update
            n = n_a + e
            mean_a = self.means[layer]
            delta = mean_b - mean_a
            mean = mean_a + delta * (e / n)
            scatter = None
            if scatter_b is not None:
                outer = delta[:, :, None] * delta[:, None, :]
                scatter = self.scatters[layer] + scatter_b + outer * (n_a * e / n)
        self.counts[layer] = n_a + e
        self.means[layer], self.scatters[layer] = mean, scatter

    def statistics(self, layer: int) -> tuple[Tensor | None, Tensor | None]:
        """(mean [H_q, d], covariance [H_q, d, d] or None) of `layer`, or (None, None) while it
        has counted no query."""
        n = self.counts[layer]
        if n == 0:
            return None, None
        scatter = self.scatters[layer]
        return self.means[layer], None if scatter is None else scatter / n

    def snapshot(self, layers: range) -> list[tuple[Tensor | None, Tensor | None]]:
        """`statistics` of each layer in `layers`, as they are now (a staged pass's)."""
        return [self.statistics(layer) for layer in layers]

    def tensors(self) -> list[Tensor]:
        """What it holds (for the store's byte count)."""
        return [t for t in (*self.means, *self.scatters) if t is not None]
