"""The default model: SmolLM2-135M-Instruct converted from the packaged GGUF once, then reused."""

from __future__ import annotations

import json

from sgl_kvc.model import SMOLLM2_MODEL_NAME, ensure_smollm2, smollm2_gguf_path


def test_gguf_ships_with_the_package() -> None:
    assert smollm2_gguf_path().stat().st_size > 50_000_000


def test_converted_checkpoint_is_a_plain_bf16_llama_and_reused() -> None:
    folder = ensure_smollm2()  # the shared cache folder: converted by `make install` already
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert config["max_position_embeddings"] == 8192
    # SGLang would look for GGUF kernels if the quantizer's trace were left in the config.
    assert "quantization_config" not in config
    assert "im_start" in (folder / "chat_template.jinja").read_text()
    assert json.loads((folder / "sgl_kvc_model.json").read_text())["name"] == SMOLLM2_MODEL_NAME
    mtime = (folder / "model.safetensors").stat().st_mtime
    assert ensure_smollm2() == folder and (folder / "model.safetensors").stat().st_mtime == mtime


def test_chat_template_and_tokenizer_round_trip() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_smollm2())
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
