"""`--policy none` is plain SGLang: the same prefix-cache class and greedy tokens as
`python -m sglang.launch_server`."""

from __future__ import annotations

import os
import re
import sys

import pytest

from loadtest.server import ServerProcess

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The orchestra tuned its instruments while",
    "Question: what is the capital of France? Answer:",
    "A radix tree maps token prefixes to the slots that hold their keys and values, so",
    "Seven times eight is fifty six, twelve squared is",
]


def _greedy(server: ServerProcess, prompt: str) -> tuple[str, int]:
    r = server.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": prompt,
            "max_tokens": 40,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def plain_sglang(demo_model_path: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLKVC_")}
    # Same CPU settings the launcher uses, and no plugins at all: this is SGLang alone.
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PLUGINS": "__no_plugin__"})
    cmd = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", demo_model_path,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch",
        "--grammar-backend", "none",
        "--max-total-tokens", "16384",
    ]
    with ServerProcess.launch(cmd, env=env) as server:
        yield server


def test_policy_none_same_greedy_tokens_as_plain_sglang(kvc_server, plain_sglang) -> None:
    for prompt in PROMPTS:
        ours, plain = _greedy(kvc_server, prompt), _greedy(plain_sglang, prompt)
        assert ours == plain, prompt
        assert ours[1] == 40


def test_policy_none_keeps_sglangs_prefix_cache(kvc_server, plain_sglang) -> None:
    def tree_class(server: ServerProcess) -> str:
        found = re.search(r"Tree cache initialized: .*?impl=(\w+)", server.log_path.read_text(errors="replace"))
        assert found, "SGLang logged no tree cache"
        return found.group(1)

    assert tree_class(kvc_server) == tree_class(plain_sglang)
    assert kvc_server.stats()["prefix_cache"]["backend"] == tree_class(plain_sglang)
