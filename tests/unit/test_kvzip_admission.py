"""What a KVzip request reserves for its reconstruction forward, and the ids it is asked with
(`sgl_kvc/adapter/reconstruction.py`), without a server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_kvc.adapter import reconstruction
from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY, RequestSettingError, parse_kv_compression


def _req(prompt: int, **settings) -> SimpleNamespace:
    return SimpleNamespace(
        origin_input_ids=list(range(prompt)), output_ids=[], return_logprob=False, logprob_start_len=-1,
        multimodal_inputs=None,
        sampling_params=SimpleNamespace(max_new_tokens=16, custom_params={CUSTOM_PARAMS_KEY: settings}),
    )


def test_a_kvzip_request_reserves_one_reconstruction_forward() -> None:
    """One chunk of its context and its instruction; other prompt policies nothing."""
    config = KvcConfig(policy="snapkv", prompt_policy="kvzip", kvzip_chunk=2048)
    head = reconstruction.RESERVE_HEAD
    assert reconstruction.reserve_tokens(config, _req(5000)) == 2048 + head
    assert reconstruction.reserve_tokens(config, _req(300)) == 300 + head
    assert reconstruction.reserve_tokens(config, _req(5000, prompt_policy="snapkv")) == 0
    plain = KvcConfig(policy="snapkv", kvzip_chunk=512)
    assert reconstruction.reserve_tokens(plain, _req(5000)) == 0
    assert reconstruction.reserve_tokens(plain, _req(5000, prompt_policy="kvzip")) == 512 + head


def test_kvzip_is_a_prompt_policy_only() -> None:
    assert parse_kv_compression({"prompt_policy": "kvzip"}).prompt_policy == "kvzip"
    with pytest.raises(RequestSettingError) as info:
        parse_kv_compression({"policy": "kvzip"})
    assert info.value.param == "kv_compression.policy" and "prompt policy" in str(info.value)
    with pytest.raises(ValueError, match="prompt policy"):
        KvcConfig(policy="kvzip")
    assert KvcConfig(policy="rkv", prompt_policy="kvzip").prompt_policy_name == "kvzip"
    with pytest.raises(ValueError, match="kvzip-chunk"):
        KvcConfig(policy="rkv", kvzip_chunk=0)


def test_the_instruction_and_the_template_around_a_message(demo_model_path: str) -> None:
    """kvpress's split: the template's text before a user message (the system prompt) and after
    it (the opening of the answer), and the two instructions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_path)
    prompt = reconstruction.prompt_from_tokenizer(tok)
    message = tok.encode("Hello there.", add_special_tokens=False)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there."}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == [*prompt.system, *message, *prompt.suffix]
    assert tok.decode(list(prompt.first)) == "\n\nRepeat the previous context exactly."
    assert tok.decode(list(prompt.later)).endswith("starting with")
    with pytest.raises(RuntimeError, match="tokenizer"):
        reconstruction.prompt_from_tokenizer(None)


def test_a_prompt_must_leave_its_reconstruction_positions_before_the_model_s_last() -> None:
    """The forward reads its instruction and the context after the context: the model's positions
    are its rotary tables' (the shortest); a prompt whose smallest forward (instruction and one
    token) would run past them is refused, with what to do."""
    import torch

    prompt = reconstruction.ReconstructionPrompt(system=(1, 2), suffix=(8, 9), first=(50, 51), later=(60, 61, 62))
    need = reconstruction.instruction_tokens(prompt) + 1  # 3 + 8 quoted + 2 of the template, + 1
    rope = [SimpleNamespace(cos_sin_cache=torch.zeros(n, 4)) for n in (120, 100)]
    model = SimpleNamespace(modules=lambda: [SimpleNamespace(), *rope])
    scheduler = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
                                model_config=SimpleNamespace(context_len=4096))
    rec = reconstruction.Reconstructor(KvcConfig(policy="snapkv", prompt_policy="kvzip"), store=None,
                                       _prompt=prompt)
    assert rec.positions(scheduler) == 100
    fits = [1, 2, *range(100, 100 + 100 - need - 2), 8, 9]  # the context ends `need` before 100
    assert rec.refusal(scheduler, fits) is None
    short = rec.refusal(scheduler, [1, 2, *fits[2:-2], 7, 8, 9])  # one more context token
    assert short is not None and "prompt_policy 'kvzip'" in short and "by at least 1 token," in short
    # a model without rotary tables: its context length
    bare = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(
        model=SimpleNamespace(modules=lambda: []))), model_config=SimpleNamespace(context_len=4096))
    assert reconstruction.Reconstructor(KvcConfig(policy="snapkv"), store=None).positions(bare) == 4096
