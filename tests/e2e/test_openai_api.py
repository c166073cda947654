"""The OpenAI-compatible API of `python -m sgl_kvc.launch`, through the official client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

pytestmark = pytest.mark.e2e

GREEDY = {"temperature": 0.0}
LONG_PROMPT = (
    "You are a careful assistant. Read the following notes and answer briefly. "
    "The valley had mild weather in spring, farmers planted barley and beans along the river, "
    "and the baker sold warm bread with honey in the evening. " * 6
)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_demo_model(openai_client: openai.OpenAI) -> None:
    models = openai_client.models.list().data
    assert len(models) == 1
    assert "demo" in models[0].id and "random-weights" in models[0].id


def test_chat_completion(openai_client: openai.OpenAI) -> None:
    r = openai_client.chat.completions.create(
        model=_model(openai_client),
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        **GREEDY,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 16


def test_streamed_chat_concatenates_to_full_text(openai_client: openai.OpenAI) -> None:
    kwargs = dict(
        model=_model(openai_client),
        messages=[{"role": "user", "content": "Tell me about the orchestra."}],
        max_tokens=24,
        **GREEDY,
    )
    full = openai_client.chat.completions.create(**kwargs)
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is [c for c in chunks if c.choices][-1]
    assert finishing[0].choices[0].finish_reason == full.choices[0].finish_reason


def test_completions_endpoint(openai_client: openai.OpenAI) -> None:
    r = openai_client.completions.create(
        model=_model(openai_client), prompt="Seven times eight is", max_tokens=8, **GREEDY
    )
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert 0 < r.usage.completion_tokens <= 8


@pytest.mark.parametrize("max_tokens", [1, 5, 33])
def test_max_tokens_honoured(openai_client: openai.OpenAI, max_tokens: int) -> None:
    r = openai_client.chat.completions.create(
        model=_model(openai_client),
        messages=[{"role": "user", "content": "Count slowly."}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    assert r.usage.completion_tokens == max_tokens
    assert r.choices[0].finish_reason == "length"


def test_repeated_long_prompt_hits_prefix_cache(openai_client: openai.OpenAI, kvc_server) -> None:
    model = _model(openai_client)
    before = kvc_server.stats()["prefix_cache"]
    first = openai_client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=4, **GREEDY)
    prompt_len = first.usage.prompt_tokens
    assert prompt_len > 150
    openai_client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=4, **GREEDY)
    after = kvc_server.stats()["prefix_cache"]
    assert after["prompt_tokens"] - before["prompt_tokens"] == 2 * prompt_len
    # The second request reuses (almost) the whole prompt: all but the last token.
    assert after["hit_tokens"] - before["hit_tokens"] >= prompt_len - 1


def test_eight_concurrent_requests(openai_client: openai.OpenAI, kvc_server) -> None:
    model = _model(openai_client)

    def one(i: int) -> int:
        r = openai_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Question number {i}: what is twelve squared?"}],
            max_tokens=32,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [32] * 8
    assert kvc_server.stats()["requests"]["max_running"] >= 2


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": "not a list"},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
        {"model": "m"},
    ],
)
def test_malformed_request_gets_openai_error_and_server_keeps_serving(kvc_server, body) -> None:
    r = kvc_server.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]  # OpenAI's envelope: {"error": {"message", "type", "param", "code"}}
    assert isinstance(err["message"], str) and err["message"]
    assert "File " not in err["message"]  # no server internals leak into the message
    assert err["code"] == r.status_code and "type" in err and "param" in err
    ok = kvc_server.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_invalid_json_body_is_4xx(kvc_server) -> None:
    import requests

    r = requests.post(
        kvc_server.url + "/v1/chat/completions",
        data=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_bad_request_with_message(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=_model(openai_client), messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )
    assert "max_new_tokens" in info.value.message or "max_tokens" in info.value.message
