"""What a policy sees of one request: `LayerView`s read from the KV pool.

A request's keys are read through its row (`req_to_token[row, :n]`, every KV head of an entry
in one slot), or, on the unit pool, one KV head at a time through its per-head table (heads of
a packed request hold different numbers of entries); values likewise, only for a policy that
reads them. Queries are the observation window the store recorded; statistics and logical positions
come from the request's state.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from sgl_kvc.core.request_state import ReqKvState, RequestTables
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import LayerView, Policy

def request_view(
    store: KvcStore, row: int, layer: int, state: ReqKvState, *, n: int | None = None,
    positions: Tensor | None = None, tables: RequestTables | None = None, head: int | None = None,
    queries: Tensor | None, values: bool = False,
    moments: tuple[Tensor | None, Tensor | None] = (None, None), reconstruction: Tensor | None = None,
) -> LayerView:
    """Layer id `layer` of request `row`.

    Through the row: its first n entries, every KV head, at `positions` ([n], or [L, H_kv, n]
    over this rank's layers after a per-head compaction). Through `tables` (the unit pool): KV
    head `head` alone, its own entries at their positions. `queries`: the layer's window queries
    (`KvcStore.window_queries`, taken when a staged pass began); with `head`, its query group.
    `values`: read the values too (for a policy that reads them, `Policy.uses_values`).
    `moments`: the layer's (mean, covariance) of the prompt's pre-RoPE queries
    (`QueryMoments.statistics`), for a prompt policy that reads them; with `head`, its query group.
    `reconstruction`: the layer's reconstruction scores [H_kv, W] (`ReqKvState.reconstruction`),
    for a prompt policy that reads them; its first n columns (with `head`, that head's)."""
    v = None
    if tables is None:
        slots = store.req_to_token[row, :n].long()
        keys = store.kv_pool.get_key_buffer(layer)[slots]  # [n, H_kv, d]
        if values:
            v = store.kv_pool.get_value_buffer(layer)[slots]  # [n, H_kv, d_v]
        if positions is not None and positions.dim() > 1:  # per head: [L, H_kv, n]
            positions = positions[layer - store.first_layer]
    else:
        local = layer - store.first_layer
        n = tables.host_lens[local][head]
        k_units, v_units = store.unit_pools
        units = tables.units[local, head, :n]
        keys = k_units[units].unsqueeze(1)  # [n, 1, d]
        if values:
            v = v_units[units].unsqueeze(1)  # [n, 1, d_v]
        positions = tables.positions[local, head, :n][None]
    stats = state.stats[layer] if layer < len(state.stats) else None
    if stats is not None:
        stats = stats[:, :n]  # a staged pass scores the entries it began with
    if head is not None:
        if queries is not None:
            group = queries.shape[1] // store.kv_heads
            queries = queries[-n:, head * group : (head + 1) * group]
        if stats is not None:
            stats = stats[head : head + 1]
    mean, cov = moments
    if head is not None and mean is not None:
        group = mean.shape[0] // store.kv_heads
        mean = mean[head * group : (head + 1) * group]
        cov = None if cov is None else cov[head * group : (head + 1) * group]
    if reconstruction is not None:
        reconstruction = reconstruction[head : head + 1] if head is not None else reconstruction
        reconstruction = reconstruction[:, : keys.shape[0]]
    return LayerView(keys=keys, queries=queries, positions=positions, stats=stats, values=v,
                     query_mean=mean, query_cov=cov, reconstruction=reconstruction,
                     stats_since=state.stats_since)


def layer_views(
    store: KvcStore, row: int, state: ReqKvState, n: int, positions: Tensor, layers: range,
    values: bool = False, moments: list[tuple[Tensor | None, Tensor | None]] | None = None,
    reconstruction: Any = None,
) -> list[LayerView]:
    """Every layer of this rank through the row (one layer's keys, and `values` its values, held per
    view); `moments`: each layer's query moments (`prompt_moments`), or None; `reconstruction`: each
    layer's reconstruction scores (`prompt_reconstruction`), or None."""
    queries = store.window_queries(row, n)
    return [
        request_view(store, row, layer, state, n=n, positions=positions,
                     queries=queries[layer - store.first_layer], values=values,
                     moments=(None, None) if moments is None else moments[layer - store.first_layer],
                     reconstruction=None if reconstruction is None else reconstruction.layers[layer - store.first_layer])
        for layer in layers
    ]


def prompt_moments(
    store: KvcStore, state: ReqKvState, policy: Policy, moment: str,
) -> list[tuple[Tensor | None, Tensor | None]] | None:
    """The request's whole-prompt query moments, per layer of this rank, for a pass at `moment`
    by `policy`: only a prompt moment (prefill, chunk) of a policy that reads them; None
    otherwise (a decode-time pass scores with the window's queries)."""
    moments = state.query_moments
    if moments is None or moment not in ReqKvState.PROMPT_MOMENTS or not policy.uses_query_moments:
        return None
    return moments.snapshot(range(store.first_layer, store.num_layers))


def prompt_reconstruction(state: ReqKvState, policy: Policy, moment: str) -> Any:
    """The request's reconstruction scores (`PassScores`, per layer of this rank) for a pass at
    `moment` by `policy`: a prompt moment of a policy that reads them (taken: a later pass needs a
    new reconstruction); None otherwise. A policy that reads them and finds none fails the request
    (`KVzipPolicy`)."""
    if moment not in ReqKvState.PROMPT_MOMENTS or not policy.uses_reconstruction:
        return None
    scores, state.reconstruction = state.reconstruction, None
    return scores


def with_gaps(first_layer: int, items: list[Any]) -> list[Any]:
    """Per-layer items of this rank padded to global layer ids (pipeline stages start later)."""
    return [None] * first_layer + list(items)
