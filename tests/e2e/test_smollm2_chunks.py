"""KVzip on the built-in real model (SmolLM2-135M-Instruct) when a prompt longer than the pool is
cut between its chunks (the pressure moment), against the full cache of the default server.

Its two servers start together for this one test: a default server (its full cache answers the
prompt) and one whose pool of 1536 tokens reads the 2K-token prompt in chunks of 512.
"""

from __future__ import annotations

import pytest

from benchmarks.quality_samples import Sample, is_correct, passkey_samples
from smollm2_servers import complete, servers as launched, smollm2_path as model_path

pytestmark = pytest.mark.e2e


def test_kvzip_keeps_pass_keys_when_the_prompt_is_cut_between_chunks() -> None:
    """The pressure moment: a pool of 1536 tokens reads a 2K-token prompt in chunks of 512 and cuts
    it after every chunk, before its question is read. KVzip at 256 entries on the default server
    keeps the pass key at 10% depth that the full cache answers (measured; at 90% too). Scoring
    each cut's context alone, with the scores of what earlier cuts kept carried, kept neither: in
    512 tokens the filler scores high (docs/quality.md, "Which allocation each policy gets"). One
    prompt: CI's time is short."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path())
    samples: list[Sample] = passkey_samples(tok, {2048: 1}, [0.1], seed=0, style="templated")
    specs = {"full": ["--policy", "rkv"],
             "pressure": ["--policy", "rkv", "--max-total-tokens", "1536", "--chunked-prefill-size", "512",
                          "--kvzip-chunk", "512", "--kv-pass-work", "0"]}
    with launched(specs) as running:
        full = sum(is_correct(s, complete(running["full"], s.prompt_ids, s.max_tokens, {"budget": 1 << 20}))
                   for s in samples)
        kvc = {"prompt_policy": "kvzip", "budget": 256}
        texts = [complete(running["pressure"], s.prompt_ids, s.max_tokens, kvc) for s in samples]
        cuts = running["pressure"].stats()["compression"]["passes"]
    assert full == len(samples), f"the full cache itself found {full}/{len(samples)} pass keys"
    assert cuts >= 4 * len(samples), cuts  # three cuts between chunks and one after the prompt, each
    assert all(is_correct(s, t) for s, t in zip(samples, texts)), texts
