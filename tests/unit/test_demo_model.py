"""The built-in model: deterministic, loadable by transformers, long context, reused."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from sgl_kvc.model import DEMO_MODEL_NAME, ensure_demo_model


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_demo_model_is_deterministic_and_reused(tmp_path: Path) -> None:
    t0 = time.monotonic()
    a = ensure_demo_model(tmp_path / "a")
    created_s = time.monotonic() - t0
    b = ensure_demo_model(tmp_path / "b")
    assert _digest(a) == _digest(b)
    mtime = (a / "model.safetensors").stat().st_mtime
    assert ensure_demo_model(tmp_path / "a") == a  # second use: same folder, not rewritten
    assert (a / "model.safetensors").stat().st_mtime == mtime
    assert created_s < 60, f"creating the demo model took {created_s:.1f}s"


def test_demo_model_loads_with_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = ensure_demo_model(tmp_path)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert config.max_position_embeddings >= 8192
    assert config.num_key_value_heads < config.num_attention_heads  # GQA, like real models
    tok = AutoTokenizer.from_pretrained(path)
    assert 2000 <= len(tok) <= 8192
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|user|>" in text and text.rstrip().endswith("<|assistant|>")
    ids = tok("The KV cache holds keys and values.", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "The KV cache holds keys and values."
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert json.loads((path / "sgl_kvc_demo.json").read_text())["name"] == DEMO_MODEL_NAME
