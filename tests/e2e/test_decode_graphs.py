"""Decode steps read from buffers (`--kv-decode-graphs on`), served, against the eager decode.

With the flag, a compressing server's decode steps are the steps a CUDA graph replays
(`core/graph_step.py`): on a GPU SGLang captures and replays them, on a CPU the same step runs
eagerly, which is what these servers run. Each is compared, request for request, with the same
server without the flag (the eager plan, `core/decode.py`, SGLang's graphs off), in float32,
where both kernels round alike: the same text and log-probabilities to float32 rounding, through compactions during
decode, a prompt KVzip packed on the unit pool, a shared document and a request starting from
it (a packed table of the document's units), FP8 storage with uniform budgets, and a request whose
policy keeps statistics (H2O), whose steps decode eagerly on the graph server and say so in the
stats. On a GPU (`.ci/gpu graphs`) SGLang's own pool is compared too and the graph server must have
replayed its graphs. Every server checks its pool after each compaction (`SGLKVC_CHECK=1`).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
import requests
import torch

from loadtest.server import ServerProcess, kvc_stats

pytestmark = pytest.mark.e2e

BASE = [sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo", "--dtype", "float32", "--policy", "rkv",
        "--kv-budget", "24", "--kv-buffer", "8", "--kv-window", "4"]
PAIRS = {"policy": [], "fp8-uniform": ["--kv-cache-dtype", "fp8_e4m3", "--kv-head-budget", "uniform"]}
if torch.cuda.is_available():  # SGLang's own pool, whose kernels attend there (on a CPU, sgl-kvc's does)
    PAIRS["uniform"] = ["--kv-head-budget", "uniform"]
PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the fence. " * 8
REQUESTS = [
    {},  # R-KV decode, SnapKV prompt
    {"prompt_policy": "kvzip"},  # packed by KVzip's one sort over every head (the unit pool)
    {"prompt_policy": "kvzip", "document": {"tokens": 80}},  # publishes a shared document
    {"prompt_policy": "kvzip", "document": {"tokens": 80}},  # starts from it
    {"policy": "h2o"},  # keeps statistics: its steps decode eagerly
]
# Float32 rounding of a log-probability of order 10 through the demo model's layers, with room.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def servers():
    specs = {(pair, graphs): [*BASE, *flags, "--kv-decode-graphs", graphs]
             for pair, flags in PAIRS.items() for graphs in ("off", "on")}
    with ExitStack() as stack, ThreadPoolExecutor(len(specs)) as pool:
        futures = {key: pool.submit(stack.enter_context, ServerProcess.launch(cmd, {"SGLKVC_CHECK": "1"}))
                   for key, cmd in specs.items()}
        yield {key: f.result() for key, f in futures.items()}


def _answers(server: ServerProcess) -> list[dict]:
    out = []
    for settings in REQUESTS:
        body = {"text": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True,
                                    "custom_params": {"sgl_kvc": settings}}}
        r = requests.post(server.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json())
    return out


@pytest.mark.parametrize("pair", list(PAIRS))
def test_graph_steps_answer_as_the_eager_decode(servers, pair: str) -> None:
    eager, graphs = servers[(pair, "off")], servers[(pair, "on")]
    want, got = _answers(eager), _answers(graphs)
    for settings, a, b in zip(REQUESTS, want, got):
        assert b["text"] == a["text"], settings
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) <= LOGPROB_TOLERANCE, settings
    assert got[3]["meta_info"]["cached_tokens"] == want[3]["meta_info"]["cached_tokens"] > 0  # the document hit
    stats, eager_stats = kvc_stats(graphs.url), kvc_stats(eager.url)
    assert stats["compression"]["passes"] == eager_stats["compression"]["passes"] > len(REQUESTS)
    steps = stats["decode_attention"]
    assert steps["graph_steps"] > 0 and steps["eager_steps"].get("statistics", 0) > 0, steps
    assert eager_stats["decode_attention"]["graph_steps"] == 0
    if torch.cuda.is_available():  # SGLang replayed its captured graphs for them
        assert steps["graph_replays"] > 0, steps
