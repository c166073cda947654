"""NVIDIA kvpress on the quality benchmark's samples; run with the python of kvpress's own venv.

    /path/to/kvpress-venv/bin/python research/kvpress_runner.py IN.json OUT.json

kvpress pins its own transformers, so it lives in a separate venv (docs/benchmarks.md, "Quality"); this
script imports nothing from sgl-kvc. IN.json (written by `benchmarks.quality`): the converted
checkpoint folder, the dtype, budgets (entries, or below 1 a fraction of each context), press names
and samples as token ids. OUT.json: one outcome per
sample and configuration (`kvpress:full`, `kvpress:<press>@<budget>`), in the main benchmark's
`Outcome` shape.

How a prompt is run, the way kvpress's own pipeline does it: all prompt tokens but the last are
pre-filled with the press active (a press compresses each layer's cache right after that
layer's attention, so the prompt's hidden states never see the pruning); then the last prompt
token and the greedy answer are decoded on the compressed cache with logical positions. The
budget is kvpress's `compression_ratio = 1 - budget / prefilled_len` (kept = that budget).

Query-agnostic (`"query_agnostic": true` in IN.json; `benchmarks.quality --kvpress-query-agnostic`),
as kvpress's own benchmarks and leaderboard run: only the context, the prompt up to its question
(a sample's `meta.question_at`), is pre-filled with the press; the question (and the chat
template's tail) is then pre-filled on the compressed cache at its logical positions, uncompressed,
and the answer decoded (kvpress's `KVPressTextGenerationPipeline`: the context under the press,
then `generate_answer` from the question ids). The budget counts the context's kept entries; the
question's (about 20) come on top. The full cache's answer is taken the same way.
One pre-fill serves every press and budget: a recording press calls each press's own
`compress` (kvpress's scoring and top-k per layer and KV head) on the layer's full keys and
values and keeps the results, which is exactly what each press would have left in the cache,
at a third of the pre-fill cost on a slow CPU.

KVzip (`kvzip`) cannot be recorded that way: its score is the attention that a second pass,
asked to repeat the context, pays to each entry, and kvpress 0.5.5 applies its choice by masking
(each layer gets its own share of the total budget, heads their own counts; `kvzip_layerwise`:
every layer the same share). It runs as kvpress runs it: its own pre-fill of the context per
budget under `KVzipPress`, then the question and the answer on that cache with kvpress's
attention patch hiding the evicted entries.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


SELF_RUN = {"kvzip", "kvzip_layerwise"}  # presses that need their own pre-fill (module docstring)


def make_presses(names: list[str]) -> dict[str, Any]:
    from kvpress import (
        ExpectedAttentionPress,
        KeyDiffPress,
        KVzipPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    factories = {
        # SnapKV with sgl-kvc's window and pooling kernel (kvpress defaults: 64 and 5), so that
        # the difference left is the granularity: kvpress keeps a set per (layer, KV head).
        "snapkv": lambda: SnapKVPress(window_size=8, kernel_size=7),
        "streamingllm": lambda: StreamingLLMPress(n_sink=4),
        "tova": lambda: TOVAPress(),
        "expected_attention": lambda: ExpectedAttentionPress(),
        "keydiff": lambda: KeyDiffPress(),
        "kvzip": lambda: KVzipPress(),
        # the same score with the budget split evenly across layers (as sgl-kvc's uniform budgets)
        "kvzip_layerwise": lambda: KVzipPress(layerwise=True),
    }
    return {n: factories[n]() for n in names}


def recording_press_class():
    from kvpress.presses.base_press import BasePress

    @dataclass
    class RecordingPress(BasePress):
        """Leaves the cache whole and records, per layer, what each (press, ratio) would keep."""

        presses: dict[str, Any] = field(default_factory=dict)
        ratios: dict[int, float] = field(default_factory=dict)  # budget -> compression ratio
        kept: dict[tuple[str, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(
            default_factory=dict
        )

        def post_init_from_model(self, model: Any) -> None:
            for p in self.presses.values():
                p.post_init_from_model(model)

        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            for name, press in self.presses.items():
                for budget, ratio in self.ratios.items():
                    press.compression_ratio = ratio
                    k, v = press.compress(module, hidden_states, keys, values, attentions, kwargs)
                    self.kept.setdefault((name, budget), {})[module.layer_idx] = (k, v)
            return keys, values

    return RecordingPress


def greedy(
    model: Any, cache: Any, first: int, position: int, max_tokens: int, eos: set[int],
    tok: Any = None, answer: str = "",
) -> list[int]:
    """Decode `first` at logical `position`, then greedily (kvpress pipeline's generate_answer).
    Stops early once `answer` is in the text: scoring only asks whether it appears, and decoding
    on this CPU costs far more than the pre-fill."""
    ids: list[int] = []
    token = first
    for i in range(max_tokens):
        out = model(
            input_ids=torch.tensor([[token]]), past_key_values=cache,
            position_ids=torch.tensor([[position + i]]),
        )  # fmt: skip
        token = int(out.logits[0, -1].argmax())
        ids.append(token)
        if token in eos or (answer and answer in tok.decode(ids, skip_special_tokens=True)):
            break
    return ids


def extend(model: Any, cache: Any, ids: list[int], position: int) -> None:
    """Pre-fill `ids` on `cache` (no press) at logical positions from `position` on."""
    if ids:
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache,
                    position_ids=torch.arange(position, position + len(ids))[None])


def split(sample: dict[str, Any], query_agnostic: bool) -> tuple[list[int], list[int], int]:
    """(context pre-filled under the press, question pre-filled after it, last prompt token)."""
    ids = sample["prompt_ids"]
    if not query_agnostic:
        return ids[:-1], [], ids[-1]
    at = (sample.get("meta") or {}).get("question_at")
    if at is None or not 0 < at < len(ids):
        raise ValueError(f"sample {sample['id']} has no question boundary (meta.question_at)")
    return ids[:at], ids[at:-1], ids[-1]


def masked_answer(
    model: Any, press: Any, ratio: float, context: list[int], question: list[int], last: int,
    sample: dict[str, Any], eos: set[int], tok: Any,
) -> str:
    """A press that masks rather than prunes (KVzip): pre-fill the context under it, then read the
    question and decode on the masked cache; the masks are cleared afterwards."""
    from transformers import DynamicCache

    press.compression_ratio = ratio
    cache = DynamicCache()
    try:
        with press(model):
            model.model(input_ids=torch.tensor([context]), past_key_values=cache)
        extend(model, cache, question, len(context))
        ids = greedy(model, cache, last, len(context) + len(question), sample["max_tokens"], eos,
                     tok, sample["answer"])  # fmt: skip
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
    return tok.decode(ids, skip_special_tokens=True)


def cache_from(layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in sorted(layers):
        k, v = layers[layer]
        cache.update(k.clone(), v.clone(), layer)
    return cache


def cache_path(spec: dict[str, Any]) -> Path:
    """Results are deterministic for one input, kvpress version and runner: a rerun of the
    benchmark (e.g. after a server-side fix) reuses them instead of spending minutes of CPU."""
    key = hashlib.sha256(
        json.dumps(spec, sort_keys=True).encode() + _version().encode() + Path(__file__).read_bytes()
    ).hexdigest()[:16]
    root = os.environ.get("SGLKVC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "sgl_kvc"
    )
    return Path(root) / "kvpress-runs" / f"{key}.json"


def main(inp: str, outp: str) -> None:
    spec = json.loads(Path(inp).read_text())
    cached = cache_path(spec)
    if cached.exists():
        print(f"[kvpress] reusing {cached}", flush=True)
        shutil.copyfile(cached, outp)
        return
    run(spec, outp)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    shutil.copyfile(outp, tmp)
    os.replace(tmp, cached)


def run(spec: dict[str, Any], outp: str) -> None:
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    dtype = spec.get("dtype", "bfloat16")  # the sgl-kvc servers' dtype
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, dtype)).eval()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    all_presses = make_presses(spec["presses"])
    presses = {n: p for n, p in all_presses.items() if n not in SELF_RUN}
    self_run = {n: p for n, p in all_presses.items() if n in SELF_RUN}
    query_agnostic = bool(spec.get("query_agnostic", False))
    Recording = recording_press_class()
    results: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for n, s in enumerate(spec["samples"]):
        t0 = time.perf_counter()
        context, question, last = split(s, query_agnostic)
        # kvpress keeps int(n * (1 - ratio)): half a token less pruned keeps exactly b (a budget
        # below 1 is that fraction of the context, as the benchmark's per-request budgets)
        kept = {b: b if b >= 1 else max(1, round(b * len(context))) for b in spec["budgets"]}
        ratios = {b: (len(context) - kept[b] - 0.5) / len(context) for b in spec["budgets"] if kept[b] < len(context)}
        rec = Recording(presses=presses, ratios=ratios)
        try:
            with torch.no_grad():
                from transformers import DynamicCache

                full = DynamicCache()
                with rec(model):
                    model.model(input_ids=torch.tensor([context]), past_key_values=full)
                full_layers = {i: (full.layers[i].keys, full.layers[i].values) for i in range(len(full.layers))}

                def answer(layers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> str:
                    cache = cache_from(layers)
                    extend(model, cache, question, len(context))  # query-agnostic: the question now
                    ids = greedy(model, cache, last, len(context) + len(question), s["max_tokens"], eos,
                                 tok, s["answer"])  # fmt: skip
                    return tok.decode(ids, skip_special_tokens=True)

                ref = answer(full_layers)
                results.append({"sample": s["id"], "config": "kvpress:full", "text": ref})
                for name in presses:
                    for b in spec["budgets"]:
                        if b not in ratios:  # nothing to compress: the full cache's answer
                            text = ref
                        else:
                            text = answer(rec.kept[(name, b)])
                        results.append({"sample": s["id"], "config": f"kvpress:{name}@{b}", "text": text})
                for name, press in self_run.items():
                    for b in spec["budgets"]:
                        text = ref if b not in ratios else masked_answer(
                            model, press, ratios[b], context, question, last, s, eos, tok)
                        results.append({"sample": s["id"], "config": f"kvpress:{name}@{b}", "text": text})
        except Exception as e:  # noqa: BLE001 - record and go on with the next sample
            err = f"{type(e).__name__}: {e!s:.300}"
            done = {r["config"] for r in results if r["sample"] == s["id"]}
            for cfg in ["kvpress:full", *(f"kvpress:{p}@{b}" for p in all_presses for b in spec["budgets"])]:
                if cfg not in done:
                    results.append({"sample": s["id"], "config": cfg, "text": None, "error": err})
        print(f"[kvpress] {n + 1}/{len(spec['samples'])} {s['id']}: {time.perf_counter() - t0:.0f} s",
              flush=True)  # fmt: skip
    press_params = {n: {k: v for k, v in vars(p).items() if isinstance(v, (int, float, str))}
                    for n, p in all_presses.items()}  # fmt: skip
    Path(outp).write_text(json.dumps({
        "version": kvpress.__version__ if hasattr(kvpress, "__version__") else _version(),
        "presses": list(all_presses), "press_params": press_params, "dtype": dtype, "query_agnostic": query_agnostic,
        "seconds": time.perf_counter() - t_all, "results": results,
    }))  # fmt: skip


def _version() -> str:
    from importlib.metadata import version

    return version("kvpress")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
