"""The built-in real model (SmolLM2-135M-Instruct) for the live tests that serve it
(`tests/e2e/test_smollm2*.py`): its path, its servers and the requests they send.

The servers run in float32: on a CPU without native bfloat16 (AVX2 only) a bfloat16 forward is
emulated and several times slower, and nothing tested on this model depends on the dtype.
Requests whose tokens are compared go one at a time: greedy decoding on CPU is not
batch-invariant.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Iterator

from benchmarks.quality_samples import Sample, is_correct
from loadtest.server import ServerProcess

DTYPE = os.environ.get("SMOLLM2_TEST_DTYPE", "float32")
LAUNCH = [sys.executable, "-m", "sgl_kvc.launch", "--dtype", DTYPE]  # no --model-path: SmolLM2


def smollm2_path() -> str:
    from sgl_kvc.model import ensure_smollm2

    return str(ensure_smollm2())


@contextmanager
def servers(specs: dict[str, list[str]]) -> Iterator[dict[str, ServerProcess]]:
    """sgl-kvc servers of SmolLM2 with these flags each (after `LAUNCH`), started together."""
    with ExitStack() as stack, ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(stack.enter_context, ServerProcess.launch([*LAUNCH, *flags]))
                   for name, flags in specs.items()}
        yield {name: f.result() for name, f in futures.items()}


def chat_ids(path: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def complete(server: ServerProcess, prompt: list[int], max_tokens: int, kvc: dict | None = None) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if kvc:
        body["kv_compression"] = kvc
    r = server.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def answers(server: ServerProcess, samples: list[Sample], kvc: dict) -> list[bool]:
    """Whether each pass-key sample is answered right with these settings; the samples go at once
    (a pass key does not depend on batch invariance)."""
    with ThreadPoolExecutor(len(samples)) as pool:
        texts = list(pool.map(lambda s: complete(server, s.prompt_ids, s.max_tokens, kvc), samples))
    return [is_correct(s, text) for s, text in zip(samples, texts)]
