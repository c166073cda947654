"""sgl-kvc's own buffers, sized inside the KV memory SGLang profiles.

A compressing server keeps, besides SGLang's KV pool:
* the observation-window queries: `window` queries of every layer and query head per request
  (a ring buffer that grows to the peak number of requests in flight, at most SGLang's
  request slots);
* attention statistics (H2O, Batch-Max, KV-Compress): one float32 per layer and KV head per
  cached token, at most one per pool token, twice while a decode step moves them from the
  previous step's slab to its own (`core/stat_slab.py`);
* on the unit pool (variable and layer budgets), what a packed request holds per entry (its unit
  and logical position, an int32 each) and two int64 columns of its decode steps' per-head tables,
  each layer as wide as its widest head: `PACKED_ENTRY_BYTES` per pool token, layer and KV head
  (`core/request_state.py`);
* with decode steps from CUDA graphs on the unit pool (`--kv-decode-graphs on`), the packed rows'
  layout those steps read (`core/packed_rows.py`): an int32 arena of one unit per pool token, layer
  and KV head (a packed request's table, each head's own entries only), and per request row each
  (layer, KV head)'s first entry and count there, int32;
* on CUDA, what one layer's decode call allocates, whatever the lengths in the batch: the fused
  plan's bound, `FUSED_BLOCK_BYTES` or `MAX_DECODE_SHARE` of the memory if less (`core/decode.py`;
  the store plans its blocks within what was reserved, `DECODE_BYTES_ATTR`; on a CPU the padded
  plan's blocks are bounded by `DECODE_BLOCK_ELEMS` and come out of the host's memory);
* the moments of a prompt's queries that Expected Attention reads (`core/query_moments.py`: a
  float32 mean [H_q, d] and scatter [H_q, d, d] per layer, one layer's merge beside them), for at
  most `moment_slots` requests at a time: a tenant's `prompt_policy` switches them on, and any
  request beyond those slots is scored from its observation window instead (the policy's own
  fallback, counted as `moments_declined` in the stats);
* room at the end of every request row of SGLang's `req_to_token` (an int32 per entry) for a KVzip
  reconstruction forward, which writes its chunk past the request's prompt: SGLang sizes a row to
  the context length, and where that is shorter than the model's positions a prompt near it would
  leave a forward a few tokens (`forward_room`). Any tenant can switch KVzip on (`prompt_policy`),
  so every compressing server widens its rows;
* the keys a reconstruction forward holds beyond SGLang's own prefill: on a CPU its attention
  hands each row's gathered keys to the layer's fold, so one layer's keys of every row of the
  forward are alive at once (its prefixes may be far longer than its tokens: 32 requests over a
  cached 16K prefix attend to 512K entries). A forward attends to at most `forward_entries` (the
  widest row: the context and a forward's room; `adapter/kvzip/limits.forward_groups` cuts a
  round's requests to fit), whose keys are reserved once (`FORWARD_ENTRIES_ATTR`);
* the metadata of the shared documents resident in the prefix cache (`adapter/documents/__init__.py`,
  `Document.compact`: which token each kept entry holds, an int32 per entry, and compressed by
  KVzip its reconstruction score, a float32, at most one entry per (slot, layer, KV head) of the
  document; packed, each head's int32 length too), charged per pool
  token: a document's slots are pool tokens, so documents that fill the pool fit their
  reservation (`per_document_token`, `DOCUMENT_BYTES_ATTR`). Any tenant can declare a document
  on a server with sgl-kvc's prefix cache. The registry keeps the documents' metadata within it
  whatever they are (a packed document's lengths are one slot's share more): before it publishes
  a document that would not fit, it evicts documents by the tree's eviction policy
  (`KvcRadixCache.make_document_room`), or does not publish it.

SGLang sizes its pool from a number of bytes, its KV memory (`KVCacheConfigurator._profile_available_bytes`:
free memory after weights, minus the activation slack of `--mem-fraction-static`; or
`--kv-cache-memory-gb`). Left outside, these buffers would be taken from the activation slack
(an 8B model's queries for 2,048 request slots are 4 GiB). So after SGLang resolves its pool
(`_resolve_memory_pool_config`), this hook charges them to the same memory: the pool gets
`(memory - fixed - slots x per_request - moment_slots x per_moment) / (cell + per_token)` tokens
when that is fewer than SGLang chose; the request slots are capped so the queries take at most
`MAX_QUERY_SHARE` of the memory (SGLang's default of 2,048+ slots would otherwise eat a small pool
whole), and the moment slots so the moments take at most `MAX_MOMENT_SHARE`.

Transient work of a pass (one layer's keys while it scores it) is activation memory, like
SGLang's own, and stays in its slack; so do a reconstruction forward's activations, which it keeps
within SGLang's tokens per prefill forward (`kvzip/limits.forward_limit`). Not reserved yet: the
scores a KVzip reconstruction gives a request's entries (a float32 per entry, layer and KV head of
its row), held from its reconstruction to the end of its pass (over several steps when the pass is
staged), for every request whose pass is due, and by a conversation's request (a document declared
on a server that extends them) until it finishes, for the reply it may keep
(`adapter/documents/turns.py`); bounded by their rows, not by a reservation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from sgl_kvc.adapter.sglang_api import Hook
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.decode import FUSED_BLOCK_BYTES
from sgl_kvc.core.request_state import PACKED_ENTRY_BYTES

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
MAX_QUERY_SHARE = 0.1  # of the KV memory, for the observation queries of all request slots
MAX_MOMENT_SHARE = 0.05  # of the KV memory, for Expected Attention's prompt moments
STATS_BYTES = 4  # float32 statistic per (token, layer, KV head)
MAX_DECODE_SHARE = 0.02  # of the KV memory, at most, for one decode call's allocations (CUDA)
MOMENT_SLOTS_ATTR = "kvc_moment_slots"  # on SGLang's MemoryPoolConfig: read by the compressor
DECODE_BYTES_ATTR = "kvc_decode_block_bytes"  # the same: the fused plan's block bound
FORWARD_ENTRIES_ATTR = "kvc_forward_entries"  # the same: entries a reconstruction forward attends to
ROW_ENTRY_BYTES = 4  # an int32 slot index of SGLang's req_to_token
LAYOUT_BYTES = 4  # an int32 of the graph steps' packed rows' layout (`core/packed_rows.py`)
DOCUMENT_ENTRY_BYTES = 8  # a shared document's int32 position and float32 KVzip score per (slot, layer, KV head)
DOCUMENT_BYTES_ATTR = "kvc_document_bytes"  # on SGLang's MemoryPoolConfig: the documents' metadata budget


@dataclass(frozen=True)
class Reservation:
    """Bytes sgl-kvc keeps per request slot, per pool token, per moment slot and in all;
    `per_document_token` of each pool token are the shared documents' metadata's."""

    per_request: int
    per_token: int
    per_moment: int = 0
    fixed: int = 0
    per_document_token: int = 0

    @classmethod
    def for_model(
        cls, window: int, num_layers: int, q_heads: int, kv_heads: int, head_dim: int, q_bytes: int,
        unit_tables: bool = False, decode_bytes: int = 0, row_room: int = 0, forward_entries: int = 0,
        documents: bool = False, graph_layout: bool = False,
    ) -> "Reservation":
        # a statistic twice (two steps' slabs); on the unit pool a packed entry's unit and position and
        # its columns of a step's tables; the graph steps' packed rows' arena, a unit each
        per_token = num_layers * kv_heads * (2 * STATS_BYTES + (PACKED_ENTRY_BYTES if unit_tables else 0)
                                             + (LAYOUT_BYTES if graph_layout else 0))
        # a graph step's layout of the request's row: each head's first entry and count, its packed slots
        per_row = (2 * num_layers * kv_heads + 1) * LAYOUT_BYTES if graph_layout else 0
        # a document's position and KVzip score per entry (a packed one's lengths: within the registry's budget,
        # `KvcRadixCache.make_document_room`)
        per_document_token = num_layers * kv_heads * DOCUMENT_ENTRY_BYTES
        layer_moments = q_heads * head_dim * (head_dim + 1) * 4  # float32 mean and scatter
        return cls(
            per_request=window * num_layers * q_heads * head_dim * q_bytes + row_room * ROW_ENTRY_BYTES + per_row,
            per_token=per_token,
            per_moment=num_layers * layer_moments + 2 * layer_moments,  # + one layer's merge
            # a decode call; one layer's keys of a reconstruction forward's rows (model dtype)
            fixed=decode_bytes + forward_entries * kv_heads * head_dim * q_bytes,
            per_document_token=per_document_token if documents else 0,
        )


@dataclass(frozen=True)
class PoolFit:
    tokens: int
    requests: int
    reserved_bytes: int
    moment_slots: int = 0
    document_bytes: int = 0  # of reserved_bytes: the shared documents' metadata


def fit_pool(memory: int, cell: int, tokens: int, requests: int, r: Reservation) -> PoolFit:
    """Tokens, request slots and moment slots such that pool + sgl-kvc's buffers fit in `memory`
    bytes.

    `cell`: SGLang's bytes per pool token; `tokens`, `requests`: what SGLang chose alone (its
    token count may already be below what the memory allows, e.g. `--max-total-tokens`)."""
    if r.per_request:
        requests = min(requests, max(1, int(MAX_QUERY_SHARE * memory) // r.per_request))
    moments = min(requests, int(MAX_MOMENT_SHARE * memory) // r.per_moment) if r.per_moment else 0
    held = r.fixed + requests * r.per_request + moments * r.per_moment
    fit = (memory - held) // (cell + r.per_token + r.per_document_token)
    tokens = max(1, min(tokens, fit))
    documents = tokens * r.per_document_token
    return PoolFit(tokens, requests, held + tokens * r.per_token + documents, moments, documents)


def hook_table(config: KvcConfig) -> list[Hook]:
    if not config.compressing:  # --policy none keeps no buffers: SGLang's sizing, untouched
        return []
    probe = _MemoryProbe()  # the configurator has __slots__: the memory travels here
    return [
        Hook(f"{_CONFIGURATOR}._profile_available_bytes", probe.after_profile, "AFTER", (),
             "the KV memory (bytes) SGLang profiled"),
        Hook(f"{_CONFIGURATOR}._build_req_to_token_pool", _after_req_pool(config), "AFTER", (),
             "request rows with room for a reconstruction forward"),
        Hook(f"{_CONFIGURATOR}._resolve_memory_pool_config", _around_resolve(config, probe), "AROUND", (),
             "sgl-kvc's buffers charged to that memory"),
    ]


RESERVED_ATTR = "kvc_reserved_bytes"  # on SGLang's MemoryPoolConfig (model_runner.memory_pool_config)


class _MemoryProbe:
    """The KV memory (bytes) SGLang profiled, from `_profile_available_bytes` (registered after
    `--kv-cache-memory-gb`'s hook, so it sees a fixed size too) to the resolve hook."""

    def __init__(self) -> None:
        self.memory: int | None = None

    def after_profile(self, result: int, kvc: Any, *args: Any, **kwargs: Any) -> int:
        self.memory = int(result)
        return result


def _around_resolve(config: KvcConfig, probe: _MemoryProbe) -> Callable[..., Any]:
    def hook(original: Callable[..., Any], kvc: Any, *args: Any, **kwargs: Any) -> Any:
        probe.memory = None
        pool = original(kvc, *args, **kwargs)
        memory = probe.memory
        if memory is None or kvc.is_draft_worker or pool.max_running_requests is None:
            return pool
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
        from sglang.srt.runtime_context import get_parallel, get_schedule

        configurator = create_memory_pool_configurator(kvc)
        mc = kvc.model_config
        tp = get_parallel().attn_tp_size
        # the fused plan's decode call (CUDA), within a share of the memory
        decode_bytes = min(FUSED_BLOCK_BYTES, int(MAX_DECODE_SHARE * memory)) if _on_cuda(kvc) else 0
        r = Reservation.for_model(
            window=config.kv_window,
            num_layers=int(mc.num_hidden_layers),
            q_heads=max(1, int(mc.num_attention_heads) // tp),
            kv_heads=int(mc.get_num_kv_heads(tp, get_parallel().attn_dcp_size)),
            head_dim=int(mc.head_dim),
            q_bytes=int(mc.dtype.itemsize),
            unit_tables=config.variable_budget,
            decode_bytes=decode_bytes,
            row_room=forward_room(config),
            forward_entries=forward_entries(config, int(mc.context_len)),
            documents=documents_possible(kvc),
            graph_layout=config.decode_graphs and config.variable_budget,
        )
        cell = getattr(configurator, "_cell_size", None)  # SGLang's bytes per token (FP8 included)
        if not cell:  # a pool layout without one cost per token (hybrid, MLA...)
            logger.warning("sgl-kvc: %s has no per-token cost; its buffers are not reserved in "
                           "the KV memory", type(configurator).__name__)
            return pool
        fit = fit_pool(memory, int(cell), pool.max_total_num_tokens, pool.max_running_requests, r)
        if fit.tokens < pool.max_total_num_tokens:
            resized = configurator.calculate_pool_sizes_from_max_tokens(
                fit.tokens, get_schedule().page_size
            )
            resized.max_running_requests = min(fit.requests, kvc.resolve_max_num_reqs(fit.tokens))
            resized.mem_fraction_static = pool.mem_fraction_static
            pool = configurator.finalize_with_max_running_requests(resized)
        else:
            pool.max_running_requests = fit.requests
        setattr(pool, RESERVED_ATTR, fit.reserved_bytes)  # read by /v1/kvc/stats
        setattr(pool, MOMENT_SLOTS_ATTR, fit.moment_slots)
        setattr(pool, DECODE_BYTES_ATTR, decode_bytes)
        setattr(pool, FORWARD_ENTRIES_ATTR, forward_entries(config, int(mc.context_len)))
        # the documents' metadata, for the tokens the pool got (`KvcRadixCache.make_document_room`)
        setattr(pool, DOCUMENT_BYTES_ATTR, int(pool.max_total_num_tokens) * r.per_document_token)
        logger.info(
            "sgl-kvc: %.1f MB of the %.1f MB KV memory reserved for observation queries (%d request "
            "slots x %d B), attention statistics and decode tables (%d B per token), shared documents' "
            "metadata (%d B per token), a decode call and a reconstruction forward's keys (%d B) and "
            "prompt moments (%d slots x %d B): pool %d tokens, %d requests",
            fit.reserved_bytes / 1e6, memory / 1e6, pool.max_running_requests, r.per_request,
            r.per_token, r.per_document_token, r.fixed, fit.moment_slots, r.per_moment,
            pool.max_total_num_tokens, pool.max_running_requests,
        )
        return pool

    return hook


def forward_room(config: KvcConfig) -> int:
    """Entries added at the end of every request row: the most a reconstruction forward writes
    past a request's entries (one `--kvzip-chunk` and its instruction)."""
    from sgl_kvc.adapter.kvzip.limits import RESERVE_HEAD

    return config.kvzip_chunk + RESERVE_HEAD if config.compressing else 0


def forward_entries(config: KvcConfig, context_len: int) -> int:
    """Entries one reconstruction forward attends to at most, its rows' prefixes and chunks in
    all (0 without compression): the widest row, a context and a forward's room. A row alone
    never exceeds it, so every forward can run; more rows share a forward while they fit."""
    return context_len + forward_room(config) if config.compressing else 0


def widen_rows(pool: Any, room: int) -> None:
    """Give each row of SGLang's `pool` (a ReqToTokenPool, just built: nothing holds its table
    yet) `room` more entries."""
    if room <= 0:
        return
    old = pool.req_to_token
    wider = old.new_zeros((old.shape[0], old.shape[1] + room))
    wider[:, : old.shape[1]] = old
    pool.req_to_token = wider
    pool.max_context_len += room


def _after_req_pool(config: KvcConfig) -> Callable[..., Any]:
    def hook(pool: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
        widen_rows(pool, forward_room(config))
        return pool

    return hook


def documents_possible(kvc: Any) -> bool:
    """Whether the server may hold shared documents: they live in sgl-kvc's prefix cache, which
    SGLang's radix cache must be on for, and not the hierarchical cache (`radix_cache.create`)."""
    args = getattr(kvc, "server_args", None)
    return not (getattr(args, "disable_radix_cache", False) or getattr(args, "enable_hierarchical_cache", False))


def _on_cuda(kvc: Any) -> bool:
    return str(getattr(kvc, "device", "cpu")).startswith("cuda")
