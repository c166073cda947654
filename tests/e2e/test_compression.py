"""Eviction inside SGLang: positions, the three moments, the radix rule, request settings.

One server per module (start-up is the slow part): R-KV with a small budget so that short
requests compress, a trace file that records every compaction's kept logical positions. Its
`--kv-pass-work` is below one KV head of these prompts, so every per-head pass is staged over
four scheduler steps (one KV head per step: 2 layers x 2 KV heads of the demo model): the dense
reference shows that staging is exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvc_reference import generate as _generate
from kvc_reference import REASONING_PROMPT as PROMPT
from kvc_reference import assert_pool_whole, complete_concurrently, kept_count, logprob_error, trace_events as _events
from loadtest.server import ServerProcess
from sgl_kvc.policies import prompt_policy_name

pytestmark = pytest.mark.e2e

BUDGET, BUFFER, WINDOW = 24, 8, 4
PASS_WORK = 16  # less than one KV head of any pass here: one head per step


@pytest.fixture(scope="module")
def rkv_server(trace: Path):
    # bfloat16 (the demo model's dtype) on every CPU: the accuracy thresholds were measured in it
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--dtype", "bfloat16", "--policy", "rkv",
        "--kv-budget", str(BUDGET), "--kv-buffer", str(BUFFER), "--kv-window", str(WINDOW),
        "--kv-pass-work", str(PASS_WORK),
    ]
    with ServerProcess.launch(cmd, env={"SGLKVC_TRACE": str(trace), "SGLKVC_CHECK": "1"}) as server:
        yield server


@pytest.mark.parametrize("selection", ["per-head", "shared"])
def test_logits_after_compaction_match_dense_reference(
    rkv_server, trace, demo_model_path, selection: str
) -> None:
    """Per head, each (layer, KV head) keeps its own tokens in slots shared with the others'
    kept tokens: the served log-probs equal a dense forward where each layer's query heads see
    exactly their KV head's kept keys, at their logical positions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_path)
    prompt_ids = tok(PROMPT).input_ids
    n_new = 48
    settings = {"custom_params": {"sgl_kvc": {"selection": selection}}}
    out = _generate(rkv_server, prompt_ids, n_new, sampling=settings)
    rid = out["meta_info"]["id"]
    events = _events(trace, rid)
    assert len(events) >= 3, "the request should have been compacted several times"
    assert any(e["moment"] == "prefill" for e in events)  # prompt over budget
    assert any(e["moment"] == "decode" for e in events)
    assert {e["selection"] for e in events} == {selection}
    if selection == "per-head":  # staged: the pass scored `began_at` entries, the tail is kept
        assert any(e["physical_len"] > e["began_at"] for e in events)
        assert all(kept_count(e) == BUDGET + e["physical_len"] - e["began_at"] for e in events)
    else:
        assert all(kept_count(e) == BUDGET for e in events)
    if selection == "per-head":  # the heads really differ, or this would test nothing new
        kept = [sorted(map(tuple, (h for layer in e["kept_positions"] for h in layer))) for e in events]
        assert any(len(set(k)) > 1 for k in kept)

    error = logprob_error(demo_model_path, prompt_ids, out, events)

    kernel = rkv_server.stats()["decode_attention"]
    if torch.cuda.is_available():  # SGLang's Triton decode kernel over the compacted rows
        assert kernel["kernel"] == "sglang", kernel
    else:  # sgl-kvc's batched kernel on CPU
        assert kernel["kernel"] == "sgl-kvc batched" and kernel["layers"] > 0, kernel  # it served this decode
    err = error()
    print(f"max |logprob error|: {err:.4f}; without eviction {error(evict=False):.3f}; "
          f"physical positions {error(logical=False):.3f}")
    # bf16 serving against a float32 reference: small differences only (measured 0.020-0.023).
    assert err < 0.05, f"served logprobs differ from the dense reference by {err}"
    # The test can fail: ignoring the evictions, or using physical positions, is far off.
    assert error(evict=False) > 3 * max(err, 0.05)
    assert error(logical=False) > 3 * max(err, 0.05)
    if selection == "per-head":  # one head's set replayed for every head is far off too
        one_set = [{**e, "kept_positions": e["kept_positions"][0][0]} for e in events]
        wrong = error(events=one_set)
        print(f"layer 0 head 0's kept set for every head: {wrong:.3f}")
        assert wrong > 3 * max(err, 0.05)


def test_shared_prefix_hits_while_compressing(rkv_server, demo_model_path) -> None:
    """A compressed request gives up its hold on the tree but the tree keeps the full prompt:
    a later request with the same prompt is served from it."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(demo_model_path)(PROMPT * 2).input_ids
    before = rkv_server.stats()
    first = _generate(rkv_server, prompt, 40)
    mid = rkv_server.stats()
    assert mid["compression"]["prefill_passes"] > before["compression"]["prefill_passes"]
    second = _generate(rkv_server, prompt, 40)
    after = rkv_server.wait_idle()
    # All but the observation window, which a compressing request recomputes for its queries.
    assert second["meta_info"]["cached_tokens"] == len(prompt) - WINDOW
    assert after["prefix_cache"]["hit_tokens"] - mid["prefix_cache"]["hit_tokens"] == len(prompt) - WINDOW
    # Same prompt, same compression decisions: the cached prefix is exact, the answer identical.
    assert first["output_ids"] == second["output_ids"]
    assert_pool_whole(after)


@pytest.mark.parametrize("policy", ["h2o", "batchmax"])
def test_prefill_statistics_policies_compute_their_whole_prompt(rkv_server, trace, policy) -> None:
    """H2O and Batch-Max score tokens by the attention of every prompt query, which a prefix
    served from the tree never paid: such requests take no prefix hit, so a repeated prompt
    gets the same kept set and the same answer."""
    prompt = [(31 * i) % 1900 + 10 for i in range(120)]
    settings = {"custom_params": {"sgl_kvc": {"policy": policy}}}
    outs = [_generate(rkv_server, prompt, 24, sampling=settings) for _ in range(2)]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    first, second = (_events(trace, o["meta_info"]["id"]) for o in outs)
    assert first and [e["kept_positions"] for e in first] == [e["kept_positions"] for e in second]


@pytest.mark.parametrize("policy", ["rkv", "h2o", "snapkv", "streamingllm", "batchmax", "kvcompress"])
def test_every_policy_compresses_per_request(rkv_server, trace, policy: str) -> None:
    r = rkv_server.post(
        "/v1/completions",
        json={
            "model": "m", "prompt": PROMPT, "max_tokens": 64, "temperature": 0.0,
            "ignore_eos": True, "kv_compression": {"policy": policy, "budget": 16},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    events = _events(trace, r.json()["id"])
    # The prompt is compressed by the policy's prompt policy (R-KV's: SnapKV), the rest by it.
    prompt_policy = prompt_policy_name(policy)
    assert events and {(e["moment"], e["policy"]) for e in events} == {("prefill", prompt_policy), ("decode", policy)}
    assert max(e["physical_len"] for e in events) <= 16 + BUFFER + len(PROMPT)  # bounded
    assert all(kept_count(e) - (e["physical_len"] - e["began_at"]) <= 16 for e in events)


@pytest.mark.parametrize(
    "policy, prompt_policy",
    [("rkv", "rkv"), ("rkv", "kvcompress"), ("h2o", "snapkv"), ("kvcompress", "streamingllm"), ("snapkv", "rkv")],
)
def test_request_chooses_its_prompt_policy(rkv_server, trace, policy: str, prompt_policy: str) -> None:
    """`prompt_policy` compresses the prompt and `policy` what is generated, also when the decode
    policy keeps an attention statistic the prompt policy does not (H2O, KV-Compress): the
    statistic is the decode policy's, carried over the prompt's compaction."""
    r = rkv_server.post(
        "/v1/completions",
        json={"model": "m", "prompt": PROMPT, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True,
              "kv_compression": {"policy": policy, "prompt_policy": prompt_policy, "budget": 16}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 64
    events = _events(trace, r.json()["id"])
    assert {(e["moment"], e["policy"]) for e in events} == {("prefill", prompt_policy), ("decode", policy)}
    assert all(kept_count(e) - (e["physical_len"] - e["began_at"]) <= 16 for e in events)


def test_statistics_prompt_policy_needs_its_own_decode_policy(rkv_server) -> None:
    r = rkv_server.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 4, "kv_compression": {"prompt_policy": "h2o"}},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_compression.prompt_policy" and "use it with policy 'h2o'" in error["message"]
    ok = rkv_server.post(
        "/v1/completions",
        json={"model": "m", "prompt": "hi", "max_tokens": 4,
              "kv_compression": {"policy": "h2o", "prompt_policy": "h2o"}},
    )
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("policy", ["rkv", "h2o", "snapkv", "streamingllm", "batchmax", "kvcompress"])
def test_budget_above_length_gives_same_tokens_as_none(rkv_server, policy: str) -> None:
    def greedy(settings: dict) -> str:
        r = rkv_server.post(
            "/v1/completions",
            json={"model": "m", "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0,
                  "ignore_eos": True, "kv_compression": settings},
        )
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    assert greedy({"policy": policy, "budget": 100000}) == greedy({"policy": "none"})


def test_concurrent_compressing_requests_complete_and_free_everything(rkv_server) -> None:
    """A load of every policy and both selections, staged passes under way and a client that
    disconnects mid-stream: once idle, every slot is free or cached and no request state is
    left in the store (statistics, staged passes' query copies, tables)."""
    policies = ["rkv", "h2o", "snapkv", "streamingllm", "batchmax", "kvcompress", "rkv", "h2o"]

    def settings(i: int) -> dict:
        return {"kv_compression": {"policy": policies[i], "selection": "shared" if i % 3 == 2 else "per-head"}}

    with rkv_server.post("/v1/completions", stream=True, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True,
        "kv_compression": {"policy": "kvcompress"},
    }) as gone:
        next(gone.iter_lines())  # the client leaves after its first chunk
    assert complete_concurrently(rkv_server, 8, 80, settings) == [80] * 8
    s = rkv_server.wait_idle()
    assert_pool_whole(s)
    assert s["compression"]["decode_passes"] > 0 and s["compression"]["staged_passes"] > 0
    assert s["pool"]["request_state_bytes"] == 0
    assert s["prefix_cache"]["backend"] == "KvcRadixCache"  # SGLang's RadixCache, which compaction is written for


@pytest.mark.parametrize(
    "settings, param",
    [
        ({"policy": "bogus"}, "kv_compression.policy"),
        ({"budget": 0}, "kv_compression.budget"),
        ({"budget": "many"}, "kv_compression.budget"),
        ({"budget": 12.5}, "kv_compression.budget"),
        ({"policy": "rkv", "ratio": 2}, "kv_compression.ratio"),
        ("rkv", "kv_compression"),
    ],
)
def test_bad_kv_compression_is_openai_400_naming_the_field(rkv_server, settings, param) -> None:
    for route, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ]:
        r = rkv_server.post(route, json={"model": "m", "max_tokens": 4, **body, "kv_compression": settings})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and param.split(".")[-1] in err["message"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
    ok = rkv_server.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_client_extra_body(rkv_server) -> None:
    import openai

    client = openai.OpenAI(base_url=rkv_server.url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=40,
        extra_body={"kv_compression": {"policy": "snapkv", "budget": 20}, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 40
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"kv_compression": {"policy": "nope"}},
        )
    assert "nope" in info.value.message
