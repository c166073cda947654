"""KVzip as a prompt policy on a live server: the reconstruction pass runs as SGLang work inside the
scheduler, keeps what a float64 reference of its score keeps, leaves nothing allocated, and a
failure inside it fails only its request.

One server (demo model, float32, uniform head budgets; the unit pool's one sort over every head:
test_documents.py, test_variable_budget_serving.py): SnapKV for decoding, KVzip for prompts, a budget of 16 entries
per (layer, KV head), reconstruction chunks of 24 tokens (a short prompt is repeated in several
forwards), prompts read in chunks of 128 and compressed after every chunk.
"""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvc_reference import assert_pool_whole, generate, logprob_error, trace_events, window_scores
from kvzip_reference import kvzip_scores, token_choice
from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

BUDGET, WINDOW, RECON_CHUNK, CHUNK = 16, 4, 24, 128
# Scores are softmax probabilities (<= 1): the server's float32 forward and score against the
# float64 reference differ by a few hundred float32 roundings at most; a head whose choice is
# closer to a tie than this is not decided by the score and is left out of the comparison.
TIE = 1000 * torch.finfo(torch.float32).eps
RESERVE_HEAD = 64  # tokens of a reconstruction forward besides its chunk (adapter/kvzip/limits.py)
QUESTION_TOKENS = 64  # of a prompt's end a cut's question forward reads (core/reconstruction.py)


@pytest.fixture(scope="module")
def kvzip_server(trace: Path):
    cmd = [
        sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--dtype", "float32",
        "--policy", "snapkv", "--prompt-policy", "kvzip", "--kv-budget", str(BUDGET), "--kv-window", str(WINDOW),
        "--kvzip-chunk", str(RECON_CHUNK), "--chunked-prefill-size", str(CHUNK),
        "--compress-on", "chunk-always,prefill,decode,preempt", "--kv-head-budget", "uniform",
    ]
    env = {"SGLKVC_TRACE": str(trace), "SGLKVC_CHECK": "1", "SGLKVC_FAILPOINTS": "reconstruct_raise"}
    with ServerProcess.launch(cmd, env=env) as server:
        yield server


def _chat_prompt(model_path: str, n_content: int, seed: int) -> list[int]:
    """A chat prompt whose user message is `n_content` random token ids (the template's system
    prompt before it, its opening of the answer after)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "@@"}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    marker = tok.encode("@@", add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker)
    rng = random.Random(seed)
    return ids[:at] + [rng.randrange(10, 2000) for _ in range(n_content)] + ids[at + len(marker):]


def test_kept_entries_are_the_float64_reference_choice(kvzip_server, trace: Path, demo_model_path: str) -> None:
    """A prompt read whole, repeated in four reconstruction forwards, on uniform head budgets: every
    (layer, KV head) keeps the same tokens, those a float64 rewrite of KVzip's score (kvpress's)
    ranks highest by their mean over every layer and head (up to ties); the same rewrite with a mean
    over the query group instead of the largest chooses others, so the test can fail."""
    prompt = _chat_prompt(demo_model_path, 80, seed=1)
    before = kvzip_server.stats()["compression"]["reconstruction"]
    out = generate(kvzip_server, prompt, 4)
    events = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "prefill"]
    assert len(events) == 1 and events[0]["policy"] == "kvzip", events
    served = [[set(h) for h in layer] for layer in events[0]["kept_positions"]]
    assert all(head == served[0][0] for layer in served for head in layer), "every head keeps the same tokens"

    ref = kvzip_scores(demo_model_path, prompt, chunk=RECON_CHUNK)
    chosen, mean = token_choice(ref, BUDGET, WINDOW)
    cut = min(mean[j] for j in chosen)
    near = {j for j, m in enumerate(mean) if abs(m - cut) <= TIE}  # a tie at the cut: either side
    print(f"cut {cut:.6f}; tokens within a tie of it: {sorted(near)}")
    assert len(near) <= 2, "the prompt should decide the choice"
    assert served[0][0] ^ chosen <= near, sorted(served[0][0] ^ chosen)
    wrong, _ = token_choice(kvzip_scores(demo_model_path, prompt, chunk=RECON_CHUNK, reduce="mean"), BUDGET, WINDOW)
    assert not served[0][0] ^ wrong <= near

    after = kvzip_server.wait_idle()
    rec = after["compression"]["reconstruction"]
    context = ref.end - ref.start
    assert rec["forwards"] - before["forwards"] == -(-context // RECON_CHUNK)
    assert rec["context_tokens"] - before["context_tokens"] == context
    # on this CPU server every layer's score normalizer came from the forward's own attention
    # (`scored_extend_attention`), the path the comparison above checked
    forwards = rec["forwards"] - before["forwards"]
    assert rec["forward_normalizers"] - before["forward_normalizers"] == forwards * len(served)


def test_the_reconstruction_leaves_nothing_allocated(kvzip_server, demo_model_path: str) -> None:
    """Several requests at once: their reconstruction forwards take new slots from SGLang's
    allocator and give them all back; once idle the pool adds up and no request state is left.
    A forward never holds more than admission reserved for it."""
    prompts = [_chat_prompt(demo_model_path, 60 + 7 * k, seed=10 + k) for k in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: generate(kvzip_server, p, 8), prompts))
    assert all(len(o["output_ids"]) == 8 for o in outs)
    stats = kvzip_server.wait_idle()
    assert_pool_whole(stats)
    assert stats["pool"]["request_state_bytes"] == 0, stats["pool"]
    rec = stats["compression"]["reconstruction"]
    assert 0 < rec["max_held_slots"] <= 4 * (RECON_CHUNK + RESERVE_HEAD), rec


def test_prompts_read_in_chunks_repeat_their_whole_context_at_each_pass(kvzip_server, trace: Path,
                                                                        demo_model_path: str) -> None:
    """Compressed after every chunk, each of a prompt's passes repeats its whole context read so
    far (what earlier cuts kept is scored again beside what was read since, in one softmax), and
    the served log-probabilities equal a dense forward over exactly what each head kept at its
    logical positions."""
    prompt = _chat_prompt(demo_model_path, 3 * CHUNK + 40, seed=3)
    before = kvzip_server.stats()["compression"]
    out = generate(kvzip_server, prompt, 12)
    events = trace_events(trace, out["meta_info"]["id"])
    assert [e["moment"] for e in events][:4] == ["chunk"] * 3 + ["prefill"], [e["moment"] for e in events]
    assert {e["policy"] for e in events if e["moment"] in ("chunk", "prefill")} == {"kvzip"}
    # the usage counts what the tree gave it (at most the template's text before the message),
    # not minus every entry a compaction between chunks dropped
    assert 0 <= out["meta_info"]["cached_tokens"] <= 3, out["meta_info"]["cached_tokens"]
    after = kvzip_server.wait_idle()["compression"]
    system, suffix = 3, 4  # the demo template's text before and after a user message
    # the context read at each pass: the chunks' (after the tree's cached prefix), then the whole prompt's
    ends = [e["logical_len"] for e in events[:3]] + [len(prompt) - suffix]
    assert after["reconstruction"]["context_tokens"] - before["reconstruction"]["context_tokens"] == sum(
        end - system for end in ends)
    error = logprob_error(demo_model_path, prompt, out, events)
    err = error()
    print(f"max |logprob error| {err:.2e}; without eviction {error(evict=False):.3f}")
    assert err < 1e-3  # float32 serving against a float32 reference
    assert error(evict=False) > 10 * 1e-3


def test_a_failure_inside_the_pass_fails_only_its_request(kvzip_server, demo_model_path: str) -> None:
    """A fault planted while the reconstruction of one request is scored (it shares the forward
    with the others of its moment): that request gets a 500, the others their tokens."""
    before = kvzip_server.stats()["compression"]["failed_requests"]
    prompt = _chat_prompt(demo_model_path, 70, seed=5)

    def one(rid: str):
        return kvzip_server.post("/generate", json={
            "rid": rid, "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        })

    rids = ["failpoint-reconstruct-1", "neighbour-1", "neighbour-2"]
    with ThreadPoolExecutor(3) as pool:
        replies = dict(zip(rids, pool.map(one, rids)))
    assert replies["failpoint-reconstruct-1"].status_code == 500, replies["failpoint-reconstruct-1"].text
    for rid in rids[1:]:
        assert replies[rid].status_code == 200, replies[rid].text[:300]
        assert len(replies[rid].json()["output_ids"]) == 8
    stats = kvzip_server.wait_idle()
    assert stats["compression"]["failed_requests"] == before + 1
    assert_pool_whole(stats)
    assert stats["pool"]["request_state_bytes"] == 0


def test_kvzip_per_request_and_only_for_prompts(kvzip_server, trace: Path, demo_model_path: str) -> None:
    """A request names KVzip as its prompt policy; as its policy (which compresses what is
    generated) it is a 400 naming the field."""
    prompt = _chat_prompt(demo_model_path, 50, seed=7)
    body = {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "kv_compression": {"policy": "rkv", "prompt_policy": "kvzip"}}
    r = kvzip_server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    assert [e["policy"] for e in trace_events(trace, r.json()["id"])] == ["kvzip"]
    r = kvzip_server.post("/v1/completions", json={**body, "kv_compression": {"policy": "kvzip"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_compression.policy", r.text


def test_many_requests_over_one_cached_prefix_never_make_a_forward_above_the_prefill_size(
        kvzip_server, demo_model_path: str) -> None:
    """Sixteen KVzip requests sharing one cached prompt, sent at once: each extends only its last
    few tokens, so SGLang reads many of them in one prefill round, and every one of them repeats
    the whole context. Their reconstruction forwards are cut so that none reads more tokens than
    SGLang's `--chunked-prefill-size` (the activations SGLang's memory slack is sized for): one
    forward of all of them held 16 x (chunk + instruction) slots at once. All complete, with
    SGLKVC_CHECK on, and nothing is left allocated."""
    prompt = _chat_prompt(demo_model_path, 90, seed=21)
    generate(kvzip_server, prompt, 1)  # the prompt, cached in the radix tree
    before = kvzip_server.wait_idle()["compression"]["reconstruction"]
    # each differs from the cached prompt in its last content token only
    prompts = [prompt[:-5] + [1000 + k] + prompt[-4:] for k in range(16)]
    r = kvzip_server.post("/generate", json={
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True},
    })
    assert r.status_code == 200, r.text[:300]
    assert [len(o["output_ids"]) for o in r.json()] == [4] * len(prompts)
    stats = kvzip_server.wait_idle()
    assert_pool_whole(stats)
    assert stats["pool"]["request_state_bytes"] == 0, stats["pool"]
    rec = stats["compression"]["reconstruction"]
    assert rec["passes"] - before["passes"] >= len(prompts), rec
    # several requests read their context in the same rounds, and no forward went past the chunk
    per_pass = -(-(len(prompt) - 3 - 4) // RECON_CHUNK)  # forwards of one request alone
    assert rec["forwards"] - before["forwards"] < len(prompts) * per_pass, (rec, before)
    assert 0 < rec["max_held_slots"] <= CHUNK, rec


def test_a_cut_between_chunks_chooses_by_the_question(kvzip_server, trace: Path, demo_model_path: str) -> None:
    """SnapKV on a prompt cut before its question is read (`--kv-chunk-window question`, the
    default) scores by its question's queries: the prompt's end (its last QUESTION_TOKENS) is read
    once after the entries it holds, and its last --kv-window queries are the window, as after
    the last chunk. The first cut keeps the tokens a float32 reference ranks highest with that
    window (up to ties); with the chunk's own last queries as the window, or the window's tokens
    alone read after the chunk, the reference chooses others, so the test can fail."""
    prompt = _chat_prompt(demo_model_path, 2 * CHUNK + 40, seed=31)
    before = kvzip_server.stats()["compression"]["reconstruction"]
    settings = {"custom_params": {"sgl_kvc": {"prompt_policy": "snapkv", "selection": "shared"}}}
    out = generate(kvzip_server, prompt, 4, sampling=settings)
    cuts = [e for e in trace_events(trace, out["meta_info"]["id"]) if e["moment"] == "chunk"]
    assert len(cuts) == 2 and {e["policy"] for e in cuts} == {"snapkv"}, cuts
    read = cuts[0]["logical_len"]  # one chunk after the template's text the tree may hold
    assert CHUNK <= read <= CHUNK + 3, read
    after = kvzip_server.wait_idle()
    assert after["compression"]["reconstruction"]["questions"] - before["questions"] == len(cuts)
    assert after["compression"]["reconstruction"]["passes"] == before["passes"]  # no KVzip pass ran
    assert_pool_whole(after)

    def choice(scores: list[float]) -> tuple[set[int], set[int]]:
        chosen = set(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:BUDGET])
        cut = min(scores[j] for j in chosen)
        return chosen, {j for j, m in enumerate(scores) if abs(m - cut) <= TIE}

    served = set(cuts[0]["kept_positions"])
    question, near = choice(window_scores(demo_model_path, prompt[:read], WINDOW, prompt[-QUESTION_TOKENS:]))
    print(f"kept {sorted(served)}; tokens within a tie of the cut: {sorted(near)}")
    assert served ^ question <= near, sorted(served ^ question)
    chunk, _ = choice(window_scores(demo_model_path, prompt[:read], WINDOW))
    alone, _ = choice(window_scores(demo_model_path, prompt[:read], WINDOW, prompt[-WINDOW:]))
    print(f"the chunk's window would keep {sorted(chunk)}, the window's tokens alone {sorted(alone)}")
    assert not served ^ chunk <= near and not served ^ alone <= near
