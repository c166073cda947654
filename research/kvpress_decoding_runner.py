"""NVIDIA kvpress's decode-time compression on the long-generation benchmark's prompts; run with
the python of kvpress's own venv.

    /path/to/kvpress-venv/bin/python research/kvpress_decoding_runner.py IN.json OUT.json

IN.json (written by `benchmarks.long_generation`): the converted checkpoint folder, the dtype, the
output length, budgets, press names and samples as token ids. Every sample is generated greedily
under transformers (`model.generate`, exactly `tokens` new tokens) with the full cache
(`kvpress:full`) and under each press at each budget (`kvpress:<press>@<budget>`); generate's
`min_new_tokens` keeps it from stopping at an end-of-sequence token, as `ignore_eos` keeps
SGLang. Compressed the way sgl-kvc compresses a request: `PrefillDecodingPress` with the press on the prompt (cut to the
budget when longer) and `DecodingPress(press, compression_interval=buffer, target_size=budget)`
during decoding, so the cache ranges over [budget, budget + buffer] as sgl-kvc's does. OUT.json:
per sample and configuration the generated text and the number of decode-time compressions
(layer 0). This script imports nothing from sgl-kvc.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


def make_press(name: str) -> Any:
    """The quality benchmark's press of that name (its runner sits beside this script)."""
    from kvpress_runner import make_presses

    return make_presses([name])[name]


def counting_decoding_press(base: Any, interval: int, budget: int) -> Any:
    """kvpress's DecodingPress, counting its compressions of layer 0."""
    from kvpress import DecodingPress

    class Counting(DecodingPress):
        compressions: int = 0

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            if module.layer_idx == 0 and keys.shape[2] > self.target_size:  # else nothing is evicted
                self.compressions += 1
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    return Counting(base_press=base, compression_interval=interval, target_size=budget)


def generate(model: Any, prompt: list[int], tokens: int, press: Any = None) -> list[int]:
    from contextlib import nullcontext

    ids = torch.tensor([prompt])
    with torch.no_grad(), (press(model) if press is not None else nullcontext()):
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=False, pad_token_id=model.generation_config.eos_token_id,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import version

    from kvpress import PrefillDecodingPress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    results: list[dict[str, Any]] = []
    for n, s in enumerate(spec["samples"]):
        t0 = time.perf_counter()
        prompt = s["prompt_ids"]
        runs = [("kvpress:full", None, None)] + [
            (f"kvpress:{name}@{b}", name, b) for name in spec["presses"] for b in spec["budgets"]
        ]
        for config, name, budget in runs:
            try:
                press = decoding = None
                if name is not None:
                    prefill = make_press(name)
                    # kvpress keeps int(n * (1 - ratio)): half a token less pruned keeps exactly `budget`
                    prefill.compression_ratio = max(0.0, (len(prompt) - budget - 0.5) / len(prompt))
                    decoding = counting_decoding_press(make_press(name), spec["buffer"], budget)
                    press = PrefillDecodingPress(prefilling_press=prefill, decoding_press=decoding)
                ids = generate(model, prompt, spec["tokens"], press)
                # compactions as sgl-kvc's trace counts them: the prompt's (when longer than the
                # budget), then every decode-time one
                prompt_pass = int(budget is not None and len(prompt) > budget)
                results.append({"sample": s["id"], "config": config, "text": tok.decode(ids, skip_special_tokens=True),
                                "compactions": decoding.compressions + prompt_pass if decoding is not None else 0})
            except Exception as e:  # noqa: BLE001 - recorded, the other runs go on
                results.append({"sample": s["id"], "config": config, "text": None,
                                "error": f"{type(e).__name__}: {e!s:.300}"})
        print(f"[kvpress] {n + 1}/{len(spec['samples'])} {s['id']}: {time.perf_counter() - t0:.0f} s", flush=True)
    return {"version": version("kvpress"), "results": results}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main()
