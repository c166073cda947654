"""The served model's RoPE: its parameters, for the policies that move queries in position (Expected
Attention advances its observation queries to future positions: `PolicyParams.rope_*`), and the
per-token offsets of the rows whose tokens sit at logical positions (`extend_position_offsets`,
`decode_position_offsets`: a row compacted between chunks, or started from a shared document)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sgl_kvc.core.store import KvcStore

logger = logging.getLogger(__name__)


def rope_params(model_runner: ModelRunner) -> dict[str, Any]:
    """`PolicyParams` fields for the model's rotary embedding (SGLang's `RotaryEmbedding`, the first
    one among its modules; a model whose layers rotate with different bases gets the first
    layer's): base, rotary dimensions, layout. Empty (the defaults) when the runner has no model
    (a stand-in) or the model none of SGLang's rotary embeddings."""
    model = getattr(model_runner, "model", None)
    if model is None or not hasattr(model, "modules"):
        return {}
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            rotary = int(module.rotary_dim)
            if type(module) is not RotaryEmbedding:
                logger.warning(
                    "sgl-kvc: %s scales its RoPE frequencies; Expected Attention advances queries "
                    "with the unscaled ones (base %s)", type(module).__name__, module.base,
                )
            return {
                "rope_theta": float(module.base),
                "rope_dim": 0 if rotary == int(module.head_size) else rotary,
                "rope_neox": bool(module.is_neox_style),
            }
    logger.warning(
        "sgl-kvc: %s has no SGLang RotaryEmbedding; Expected Attention assumes RoPE with base "
        "10000 over the whole head", type(model).__name__,
    )
    return {}


def extend_position_offsets(store: KvcStore, batch: ScheduleBatch, fb: ForwardBatch) -> Any:
    """Per-token RoPE offsets of an extend batch (on the device), or None if all are 0: the
    chunks after a compaction between chunks continue at logical positions."""
    if not store.offset_rows or not any(r.kv.req_pool_idx in store.offset_rows for r in batch.reqs):
        return None
    per_request = store.offsets[fb.req_pool_indices]
    return torch.repeat_interleave(per_request, fb.extend_seq_lens, output_size=int(fb.positions.numel()))


def decode_position_offsets(store: KvcStore, req_pool_indices: Any) -> Any:
    """Per-request RoPE offsets of a decode batch (on the device), or None if all are 0."""
    if not store.offset_rows:
        return None
    return store.offsets[req_pool_indices]
