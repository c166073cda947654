"""The built-in real model (SmolLM2-135M-Instruct) served by `python -m sgl_kvc.launch`.

- `--policy none` is plain SGLang: the same prefix-cache class and greedy tokens as
  `python -m sglang.launch_server`;
- a compressing request whose prompt and output fit its budget answers exactly as the full cache
  on the same server, and as plain SGLang (sgl-kvc's batched decode kernel against SGLang's);
- a conversation kept compressed from turn to turn agrees with plain SGLang as often as the same
  turns compressed anew.
Two sgl-kvc servers (`--policy none` and the default) start together once for the module; plain
SGLang runs only during its test (an extra server competing for two cores slows every other one
several-fold). Retrieval on this model: `test_smollm2_pass_keys.py`.
"""

from __future__ import annotations

import math
import os
import re
import sys

import pytest

from loadtest.server import ServerProcess
from smollm2_servers import DTYPE, chat_ids, complete, servers as launched, smollm2_path as model_path

pytestmark = pytest.mark.e2e

PROMPTS = [
    "What is the capital of France?",
    "Write two sentences about the sea.",
    "List three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return model_path()


def _plain_sglang(smollm2_path: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLKVC_")}
    # Same CPU settings the launcher uses, and no plugins at all: this is SGLang alone.
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "__no_plugin__"})
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", smollm2_path,
        "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
        "--grammar-backend", "none", "--max-total-tokens", "16384", "--sleep-on-idle", "--dtype", DTYPE,
    ]  # fmt: skip
    return ServerProcess.launch(cmd, env)


@pytest.fixture(scope="module")
def servers():
    with launched({"none": ["--policy", "none"], "rkv": ["--policy", "rkv"]}) as running:
        yield running


def test_default_model_is_smollm2(servers) -> None:
    models = servers["none"].get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]


def _tree_class(server: ServerProcess) -> str:
    found = re.search(r"Tree cache initialized: .*?impl=(\w+)", server.log_path.read_text(errors="replace"))
    assert found, "SGLang logged no tree cache"
    return found.group(1)


def test_policy_none_is_plain_sglang(servers, smollm2_path: str) -> None:
    prompts = [chat_ids(smollm2_path, text) for text in PROMPTS]
    ours = [complete(servers["none"], ids, 32) for ids in prompts]
    with _plain_sglang(smollm2_path) as plain_server:
        plain = [complete(plain_server, ids, 32) for ids in prompts]
        plain_tree = _tree_class(plain_server)
    assert ours == plain
    assert "Paris" in ours[0]  # a real model: it knows the capital of France
    assert _tree_class(servers["none"]) == plain_tree  # SGLang's own prefix cache
    assert servers["none"].stats()["prefix_cache"]["backend"] == plain_tree
    assert _tree_class(servers["rkv"]) == "KvcRadixCache"  # SGLang's RadixCache, which compaction is written for


def _tokens(server: ServerProcess, prompt: list[int], max_tokens: int, kvc: dict | None = None):
    """Greedy completion as (tokens, their log-probabilities)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1}
    if kvc:
        body["kv_compression"] = kvc
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def test_under_budget_request_answers_as_the_full_cache(servers, smollm2_path: str) -> None:
    # A prompt this server has not seen (no prefix hit), budget above prompt + output.
    ids = chat_ids(smollm2_path, "Explain in a few sentences why the sky is blue.")
    before = servers["rkv"].stats()["compression"]["passes"]
    ours, ours_lp = _tokens(servers["rkv"], ids, 48, {"policy": "snapkv", "budget": 1024})
    assert servers["rkv"].stats()["compression"]["passes"] == before  # nothing was compressed
    # Exactly the full cache of the same server (same attention kernel).
    assert ours == _tokens(servers["rkv"], ids, 48, {"policy": "none"})[0]
    # Against plain SGLang's attention: in float32 the two kernels round alike, so the same 48
    # tokens with the same log-probabilities (measured: within 4e-6). A wrong kernel (another
    # head mapping, a missing key) changes the answer from its first tokens.
    plain, plain_lp = _tokens(servers["none"], ids, 48)
    assert ours == plain
    assert max(abs(a - b) for a, b in zip(ours_lp, plain_lp)) < 1e-4
    assert servers["rkv"].stats()["decode_attention"]["layers"] > 0  # the kernel served it


# A conversation kept compressed from turn to turn (each turn's question and answer an extension of
# the document) against the same turns with the whole conversation compressed anew, both on the
# default server and on plain SGLang's answers as their history, so that each turn compares the two
# on the same prompt: the README's chat-over-an-upload request (docs/quality.md, "Conversations").
# Measured (Intel Xeon, 2 cores, float32): agreeing with plain on turns 2-4, of 12, extended 12 and
# anew 12; with each extension keeping 0.3 of its own tokens (the rule before the turn window) 10
# against 12, both times where anew agreed, which fails. About 85 s alone, 160 s in CI.
CONVERSATIONS, DOCUMENT_TOKENS, FACTS, SEED = 4, 512, 8, 2
TURNS = 4  # asked of each conversation's FACTS questions
README_REQUEST = {"prompt_policy": "kvzip", "document": {"ratio": 0.3}}


def test_an_extended_conversation_agrees_with_plain_sglang_as_often_as_compressing_anew(servers, smollm2_path) -> None:
    from transformers import AutoTokenizer

    from benchmarks.conversations import ANSWER_TOKENS, agrees, make_conversations
    from benchmarks.shared_documents import Question, ask

    conversations, _ = make_conversations(AutoTokenizer.from_pretrained(smollm2_path), CONVERSATIONS,
                                          DOCUMENT_TOKENS, FACTS, SEED)
    rkv = servers["rkv"]
    history = [[{"role": "user", "content": c.document}] for c in conversations]
    before = rkv.stats()["documents"]
    turns = []  # per turn from 2: (extended agrees, anew agrees) per conversation
    for t in range(TURNS):
        row = []
        for c in conversations:
            q = Question(c.index, t, (*history[c.index], {"role": "user", "content": c.questions[t]}), c.answers[t])
            plain = ask(servers["none"].url, q, {}, ANSWER_TOKENS)
            # anew first (turn 1 is the same request both ways): its own namespace, so nothing of
            # the conversation's chain matches it, and the chain stays the most recently used
            # entry of the tree for its own turn after it
            anew = ask(rkv.url, q, {"kv_compression": README_REQUEST, "cache_salt": f"anew-{c.index}-{t}"},
                       ANSWER_TOKENS) if t else None
            extended = ask(rkv.url, q, {"kv_compression": README_REQUEST}, ANSWER_TOKENS)
            errors = [a.error for a in (plain, anew, extended) if a is not None and a.error]
            assert not errors, errors
            history[c.index] = [*q.messages, {"role": "assistant", "content": plain.text}]
            if anew is not None:
                row.append((agrees(extended.text, extended.correct, plain.text, plain.correct),
                            agrees(anew.text, anew.correct, plain.text, plain.correct)))
        if t:
            turns.append(row)
    after = rkv.stats()["documents"]
    # every turn from the second extended its conversation's chain (it was not read anew)
    assert after["extensions"] - before["extensions"] == CONVERSATIONS * (TURNS - 1), (before, after)
    extended = sum(e for row in turns for e, _ in row)
    anew = sum(a for row in turns for _, a in row)
    # Paired answers: only those where the two servers differ tell them apart, and each of those
    # goes either way by a CPU's rounding; one standard deviation of their difference, were both
    # equally faithful, is the square root of their count (McNemar's).
    differing = sum(e != a for row in turns for e, a in row)
    per_turn = [(sum(e for e, _ in row), sum(a for _, a in row)) for row in turns]
    assert extended >= anew - math.sqrt(differing), (
        f"extended turns agree with plain SGLang {extended} times, compressed anew {anew}, of "
        f"{CONVERSATIONS * (TURNS - 1)} (per turn from 2: {per_turn})")
