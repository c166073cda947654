"""What a KVzip request reserves for its reconstruction forward, and the ids it is asked with
(`sgl_kvc/adapter/kvzip/`), without a server."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sgl_kvc.adapter.kvzip import forwards as forwards_module
from sgl_kvc.adapter.kvzip import limits, planning, reconstruction
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import ReconstructionPrompt, instruction_tokens
from sgl_kvc.request_settings import CUSTOM_PARAMS_KEY, RequestSettingError, parse_kv_compression


def _req(prompt: int, **settings) -> SimpleNamespace:
    return SimpleNamespace(
        origin_input_ids=list(range(prompt)), output_ids=[], return_logprob=False, logprob_start_len=-1,
        multimodal_inputs=None,
        sampling_params=SimpleNamespace(max_new_tokens=16, custom_params={CUSTOM_PARAMS_KEY: settings}),
    )


def test_a_kvzip_request_reserves_one_reconstruction_forward() -> None:
    """One chunk of its context and its instruction; a prompt policy that reads its observation
    window, the forward of its question at a cut between chunks (the prompt's last 64 tokens, or
    `--kv-window` if more); others nothing."""
    config = KvcConfig(policy="snapkv", prompt_policy="kvzip", kvzip_chunk=2048)
    head = limits.RESERVE_HEAD
    assert limits.reserve_tokens(config, _req(5000)) == 2048 + head
    assert limits.reserve_tokens(config, _req(300)) == 300 + head
    assert limits.reserve_tokens(config, _req(5000, prompt_policy="snapkv")) == 64
    assert limits.reserve_tokens(config, _req(40, prompt_policy="snapkv")) == 40
    assert limits.reserve_tokens(config, _req(5000, prompt_policy="streamingllm")) == 0
    plain = KvcConfig(policy="snapkv", kvzip_chunk=512, kv_window=100)
    assert limits.reserve_tokens(plain, _req(5000)) == 100
    assert limits.reserve_tokens(plain, _req(5000, prompt_policy="kvzip")) == 512 + head
    chunk = KvcConfig(policy="snapkv", kv_chunk_window="chunk")
    assert limits.reserve_tokens(chunk, _req(5000)) == 0
    assert limits.reserve_tokens(KvcConfig(policy="none"), _req(5000)) == 0


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
    prompt = planning.prompt_from_tokenizer(tok)
    message = tok.encode("Hello there.", add_special_tokens=False)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there."}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids == [*prompt.system, *message, *prompt.suffix]
    assert tok.decode(list(prompt.first)) == "\n\nRepeat the previous context exactly."
    assert tok.decode(list(prompt.later)).endswith("starting with")
    with pytest.raises(RuntimeError, match="tokenizer"):
        planning.prompt_from_tokenizer(None)


def test_a_prompt_must_leave_its_reconstruction_positions_before_the_model_s_last() -> None:
    """The forward reads its instruction and the context after the context: the model's positions
    are its rotary tables' (the shortest); a prompt whose smallest forward (instruction and one
    token) would run past them is refused, with what to do."""
    import torch

    prompt = ReconstructionPrompt(system=(1, 2), suffix=(8, 9), first=(50, 51), later=(60, 61, 62))
    need = instruction_tokens(prompt) + 1  # 3 + 8 quoted + 2 of the template, + 1
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


# --- requests a reconstruction cannot score: multimodal prompts, LoRA adapters ---------------------


def _sglang_req(prompt: list[int], settings: dict | None = None, image: bool = False, lora_id: str | None = None):
    """SGLang's own `Req` as its scheduler makes it for a request; with `image`, the multimodal
    inputs its processor gave (the pad value its image's placeholder tokens carry in the prompt)."""
    from sglang.srt.managers.schedule_batch import (
        Modality, MultimodalDataItem, MultimodalInputs, Req,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams

    custom = {CUSTOM_PARAMS_KEY: settings} if settings is not None else None
    req = Req(rid="r", origin_input_text="", origin_input_ids=prompt, vocab_size=2048, lora_id=lora_id,
              sampling_params=SamplingParams(max_new_tokens=8, custom_params=custom))
    if image:
        pad = 1 << 30  # far outside the vocabulary, as a processor's pad values are
        req.extend_image_inputs(MultimodalInputs(mm_items=[
            MultimodalDataItem(modality=Modality.IMAGE, pad_value=pad, offsets=[(2, 5)])]))
        req.origin_input_ids = [*prompt[:2], pad, pad, pad, pad, *prompt[6:]]
    return req


@pytest.mark.parametrize("server_prompt, settings, refused", [
    ("kvzip", None, "the server's prompt policy"),  # the server's --prompt-policy
    ("auto", {"prompt_policy": "kvzip"}, "this request's prompt_policy"),
    ("kvzip", {"prompt_policy": "snapkv"}, None),  # another prompt policy sent with it is served
    ("auto", {"policy": "rkv"}, None),
])
def test_a_multimodal_prompt_is_never_scored_by_kvzip(server_prompt: str, settings, refused) -> None:
    """KVzip repeats a prompt as text: with an image in it, the processor's pad values would reach
    the embedding. Such a request is a 400 when it enters the scheduler's queue, naming the
    prompt policy's field, whether KVzip is its own prompt policy or the server's; the same
    prompt without the image is admitted; and a reconstruction never plans it (nothing of it
    reaches a forward)."""
    from sglang.srt.runtime_context import get_parallel

    from sgl_kvc.adapter.kvc_req import admit

    config = KvcConfig(policy="snapkv", prompt_policy=server_prompt)
    req = _sglang_req(list(range(10, 30)), settings, image=True)
    with get_parallel().override(tp_rank=0):  # SGLang's abort logs on rank 0
        assert admit(req, config) is (refused is not None)
    if refused is None:
        assert req.to_finish is None
        return
    assert req.to_finish is not None and req.to_finish.status_code == 400
    message = req.to_finish.message
    assert message.startswith("Invalid custom_params.sgl_kvc.prompt_policy:") and refused in message, message
    assert "images, video or audio" in message
    text = _sglang_req(list(range(10, 30)), settings)
    assert admit(text, config) is False and text.to_finish is None
    # the reconstruction's own guard, should one reach it
    assert limits.unscorable(_sglang_req(list(range(10, 30)), image=True)) is not None
    assert limits.unscorable(text) is None


def test_a_multimodal_request_that_reached_a_reconstruction_fails_before_any_forward() -> None:
    """Past admission (it cannot be, but a bug could): its plan fails it alone, and no forward is
    built for it."""
    import torch

    config = KvcConfig(policy="snapkv", prompt_policy="kvzip")
    prompt = ReconstructionPrompt(system=(), suffix=(9,), first=(50, 51), later=(60, 61))
    store = SimpleNamespace(req_to_token=torch.zeros(4, 256, dtype=torch.int32))
    rec = reconstruction.Reconstructor(config, store=store, _prompt=prompt)
    forwards = []
    rec._forward = lambda scheduler, items, k: forwards.append(items)  # type: ignore[method-assign]
    req = _sglang_req(list(range(10, 30)), image=True)
    batch = SimpleNamespace(reqs=[req], seq_lens_cpu=torch.tensor([20]))
    failed = []
    rec.run(SimpleNamespace(chunked_prefill_size=128, max_prefill_tokens=16384), batch,
            [(0, object(), "prefill")], lambda r, e: failed.append((r, e)))
    assert [r for r, _ in failed] == [req] and "multimodal" in str(failed[0][1])
    assert forwards == []


def test_the_http_layer_names_the_prompt_policy_of_a_multimodal_kvzip_request(monkeypatch) -> None:
    """On a server whose model has a multimodal processor, a chat message with an image (or
    `/generate` with `image_data`) compressed by KVzip is an OpenAI-style 400 naming the field to
    change; another prompt policy, or a text model's server (which ignores the image), serves it."""
    from sgl_kvc.server import body_guard
    from sgl_kvc.server.body_guard import CHAT, GENERATE, BodyError, inspect_body

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    chat = {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]}
    kvzip_server = KvcConfig(policy="snapkv", prompt_policy="kvzip")

    def refused(route: str, body: dict, config: KvcConfig) -> BodyError:
        with pytest.raises(BodyError) as info:
            inspect_body(route, json.dumps(body).encode(), config)
        assert info.value.status == 400
        return info.value

    monkeypatch.setattr(body_guard, "_multimodal", lambda: True)
    e = refused(CHAT, chat, kvzip_server)
    assert e.param == "kv_compression.prompt_policy" and "server's prompt policy" in e.message, e.message
    e = refused(CHAT, {**chat, "kv_compression": {"prompt_policy": "kvzip"}}, KvcConfig(policy="snapkv"))
    assert e.param == "kv_compression.prompt_policy" and "this request's" in e.message, e.message
    e = refused(CHAT, {**chat, "custom_params": {"sgl_kvc": {"prompt_policy": "kvzip"}}}, KvcConfig(policy="snapkv"))
    assert e.param == "custom_params.sgl_kvc.prompt_policy", e.param
    e = refused(GENERATE, {"text": "What is this? <image>", "image_data": "data:image/png;base64,AAAA",
                           "sampling_params": {"max_new_tokens": 4}}, kvzip_server)
    assert e.param == "sampling_params.custom_params.sgl_kvc.prompt_policy", e.param
    # served: another prompt policy with it, a text-only request, a text model's server
    inspect_body(CHAT, json.dumps({**chat, "kv_compression": {"prompt_policy": "snapkv"}}).encode(), kvzip_server)
    text = {**chat, "messages": [{"role": "user", "content": "What is this?"}]}
    inspect_body(CHAT, json.dumps(text).encode(), kvzip_server)
    monkeypatch.setattr(body_guard, "_multimodal", lambda: False)
    inspect_body(CHAT, json.dumps(chat).encode(), kvzip_server)


def test_a_lora_request_s_reconstruction_runs_with_its_adapter() -> None:
    """The forward's short-lived request carries the request's LoRA adapter (SGLang's
    `ForwardBatch.init_new` hands each request's `lora_id` to its LoRA manager), so KVzip scores
    the request with the model that answers it, not the base model alone."""
    import torch

    req = _sglang_req(list(range(10, 30)), lora_id="adapter-7")
    shadow = forwards_module.shadow_request(req, row=3, prefix=12, ids=(50, 51, 9, 15, 16), vocab_size=2048)
    assert shadow.lora_id == "adapter-7"
    assert list(shadow.origin_input_ids) == [0] * 12 + [50, 51, 9, 15, 16]
    assert (shadow.prefix_len, shadow.extend_end) == (12, 17)
    assert shadow.kv.req_pool_idx == 3 and forwards_module.is_reconstruction(shadow)
    assert forwards_module.shadow_request(_sglang_req([1, 2]), 0, 0, (5,), 2048).lora_id is None
