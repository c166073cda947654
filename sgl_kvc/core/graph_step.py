"""A decode step a CUDA graph can hold, and when a step can be one.

sgl-kvc's part of a captured decode forward is, per layer, the attention over its requests' rows
(where sgl-kvc's kernel attends: the unit pool, the FP8 pool, the CPU backend) and the
observation ring's write (`KvcStore.record_decode`). Both read only buffers: SGLang's static
inputs (the batch's rows `req_pool_indices` and lengths `seq_lens`, copied in before each
replay, and `req_to_token`, rewritten by compactions between steps), the observation ring
(reserved for every row before the capture) and the packed rows' layout (`core/packed_rows.py`,
written when a row's layout changes). So what a step holds (which requests are packed, how long
each is, a compaction since the last step, a request that started from a shared document) is in
those buffers, never in the Python that ran at capture time, and a graph of one batch size
replays every later batch of that size (`tests/core/test_graph_replay.py` proves it on a CPU).

What a step cannot hold yet decodes eagerly, decided once per step here (`eager_reason`): a
request whose policy keeps attention statistics (H2O, Batch-Max, KV-Compress: a step adds to a
statistic whose columns grow with the request and move when it is compacted, which the step
plans on the host), and a packed row whose table did not fit the layout's arena.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import Tensor

from sgl_kvc.core.packed_rows import PackedRows, graph_width
from sgl_kvc.kernels.per_head_attention import flat_heads
from sgl_kvc.kernels.row_decode import PackedLayer, row_decode

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState

logger = logging.getLogger(__name__)

# Why a step decodes eagerly (`eager_reason`), as the log names it.
STATISTICS = "statistics"
ARENA = "arena"
_WHY = {STATISTICS: "its policy keeps attention statistics", ARENA: "its packed table is not in the decode layout's arena"}


@dataclass(frozen=True)
class GraphStep:
    """One decode step read from buffers (module doc). `width`: the columns the torch kernel pads
    each head to (the Triton kernel needs none); `attends`: sgl-kvc's kernel computes the step's
    attention (else SGLang's does, and sgl-kvc only observes)."""

    size: int
    width: int
    attends: bool

    has_stats = False  # the eager plan's question (`DecodeStep.has_stats`): never, here


@dataclass
class GraphSteps:
    """A store's decode steps from buffers, once enabled (`KvcStore.enable_graphs`): the packed
    rows' layout on the unit pool (`packed`, None on a slot pool), what each row's layout was
    installed from, and the counts `/v1/kvc/stats` reports: steps planned as `GraphStep`s, those
    of them SGLang replayed from its graphs (`adapter/decode_graphs.py`), and the eager ones by
    reason (each reason logged once)."""

    packed: PackedRows | None = None
    steps: int = 0
    replays: int = 0
    eager: dict[str, int] = field(default_factory=dict)
    _installed: dict[int, tuple[Any, int]] = field(default_factory=dict)  # row -> (packed entries, packed slots)
    _logged: set[str] = field(default_factory=set)

    def plan(self, rows: list[int], lens: list[int], states: Mapping[int, "ReqKvState"], attends: bool) -> GraphStep | None:
        """This step as a `GraphStep`, or None where it must decode eagerly (the reason counted)."""
        if self.packed is not None:
            self._install(rows, states)
        why = eager_reason(rows, states, self.packed)
        if why is not None:
            reason, name = why
            self.eager[reason] = self.eager.get(reason, 0) + 1
            key = f"{reason}:{name}" if reason == STATISTICS else reason
            if key not in self._logged:
                self._logged.add(key)
                logger.warning("sgl-kvc: decode steps holding %s decode eagerly, not from a CUDA graph (%s)",
                               name, _WHY[reason])
            return None
        self.steps += 1
        return GraphStep(size=len(rows), width=step_width(rows, lens, states, self.packed), attends=attends)

    def release(self, row: int) -> None:
        """Row `row` was given back: its layout goes with it."""
        if self._installed.pop(row, None) is not None and self.packed is not None:
            self.packed.clear(row)

    def _install(self, rows: list[int], states: Mapping[int, "ReqKvState"]) -> None:
        """The layout of every row whose state changed since it was installed (a compaction, a start
        from a shared document): between steps, never inside one."""
        for row in rows:
            state = states.get(row)
            now = (None, 0) if state is None else (state.packed_entries, state.packed)
            was = self._installed.get(row)
            if was is not None and was[0] is now[0] and was[1] == now[1]:
                continue
            self._installed[row] = now
            try:
                self.packed.install(row, state)
            except Exception:  # noqa: BLE001 - that row alone decodes eagerly (`eager_reason`)
                logger.exception("sgl-kvc: row %s's packed layout was not installed; its steps decode eagerly", row)
                self.packed.refuse(row)


def eager_reason(rows: Sequence[int], states: Mapping[int, "ReqKvState"], packed: PackedRows | None) -> tuple[str, str] | None:
    """Why a step of these rows cannot be a `GraphStep`: (the reason, what it names), or None."""
    for row in rows:
        state = states.get(row)
        if state is not None and state.policy.uses_stats:
            return STATISTICS, state.policy.name
        if packed is not None and not packed.installed(row):
            return ARENA, f"row {row}"
    return None


def step_width(rows: Sequence[int], lens: Sequence[int], states: Mapping[int, "ReqKvState"],
               packed: PackedRows | None) -> int:
    """The torch kernel's columns for a step: each row's widest head, its packed entries and its
    tail, bucketed (`graph_width`)."""
    widths = []
    for row, n in zip(rows, lens):
        state = states.get(row)
        if packed is not None and state is not None and state.packed_entries is not None:
            widths.append(packed.width(row) + n - int(state.packed))
        else:
            widths.append(n)
    return graph_width(widths)


def attend(step: GraphStep, local_layer: int, q: Tensor, k_cache: Any, v_cache: Any, scale: float, out: Tensor,
           rows: Tensor, seq_lens: Tensor, req_to_token: Tensor, kv_heads: int,
           unit_pools: tuple[Any, Any] | None, packed: PackedRows | None) -> None:
    """The step's attention of one layer into `out`: over the unit pool's flat K and V
    (`unit_pools`, whose rows' packed tables are `packed`), else over this layer's slot cache
    viewed as units (`flat_heads`). The Triton kernel on CUDA, the torch one elsewhere."""
    layer = None
    if unit_pools is not None:
        k_units, v_units = unit_pools
        slot_units, layer_units = packed.layers * kv_heads, local_layer * kv_heads
        layer = PackedLayer(table=packed.table, start=packed.start[:, local_layer], lens=packed.lens[:, local_layer],
                            packed=packed.packed)
    else:
        k_units, v_units = flat_heads(k_cache), flat_heads(v_cache)
        slot_units, layer_units = kv_heads, 0
    kernel = _triton(q.device, q.shape[-1], k_units, v_units)
    if kernel is not None:
        kernel.triton_row_decode(q, k_units, v_units, req_to_token, rows, seq_lens, scale, out, heads=kv_heads,
                                 slot_units=slot_units, layer_units=layer_units, packed=layer)
        return
    row_decode(q, k_units, v_units, req_to_token, rows, seq_lens, scale, out, heads=kv_heads, width=step.width,
               slot_units=slot_units, layer_units=layer_units, packed=layer)


def _triton(device: Any, head_dim: int, k_units: Any, v_units: Any) -> Any:
    """The Triton kernel's module where it serves these operands (CUDA), else None."""
    if device.type != "cuda":
        return None
    try:
        from sgl_kvc.kernels import triton_row_decode
    except ImportError:  # no triton: the torch version serves
        return None
    return triton_row_decode if triton_row_decode.supports(head_dim, k_units, v_units) else None
