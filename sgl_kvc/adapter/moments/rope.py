"""The served model's RoPE parameters, for the policies that move queries in position (Expected
Attention advances its observation queries to future positions: `PolicyParams.rope_*`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner

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
