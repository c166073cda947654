"""Accuracy of FP8 KV-cache storage against the 16-bit cache, scale choice by scale choice.

    python -m research.fp8_accuracy                    # writes research/results/fp8-accuracy.{json,md,png}
    python -m research.fp8_accuracy --new-tokens 64 --prompts 1 --out /tmp/x   # quick

The model is the built-in demo Llama (transformers, float32 arithmetic). Its KV cache is stored
the way each scheme stores it: every key/value is quantized once, when it is written (prefill
and each decode step), and attention reads the dequantized values, like sgl-kvc's pool. The
reference is the bfloat16 cache the 16-bit server keeps.

Inputs with outliers: real keys have a few channels tens of times larger than the rest, and
values are often small. Both are produced here without changing what the model computes: key
channels are multiplied by a gain g and the matching query channels divided by g (q.k is
unchanged; the gains are equal on the two channels RoPE rotates together), and values are
multiplied by g with the output projection divided by g. So every setting is the same function
in exact arithmetic, and only the magnitudes the cache must store change:

  demo             the model as it is (|K|, |V| up to about 3)
  k_outliers       4 of 32 key channels per head x50 (|K| up to about 150)
  k_outliers_small_v   same, and values x1/64 (|V| mostly below 0.05)
  k_outliers_large     same keys x8 (|K| up to about 1200, past e4m3's 448)

Schemes: `token_head` is one scale per (token, KV head), sgl-kvc's pool (scale stored as bfloat16,
or as float16 / float32 / an e8m0 exponent byte for comparison); `token` one scale per token over all KV
heads; `layer_running_amax` one scale per layer from the running amax (stored codes re-quantized
when it grows); `layer_1.0` SGLang's per-layer scale of 1.0 (its default without checkpoint
scales). `float32` (no rounding at all) shows the distance of the bf16 reference itself.

Measured per scheme over `--prompts` prompts x `--new-tokens` greedy tokens of the reference:
relative error of the attention outputs (input of o_proj, every layer, every step) and of the
next-token logits, teacher-forced on the reference's tokens; top-1 agreement on those steps; and
free-running greedy generation: share of positions equal to the reference, first divergence.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from benchmarks.common import machine, metadata_markdown, run_metadata
from sgl_kvc.kernels import fp8 as F
from tests.fp8_reference import (  # the per-layer scales the pool is compared with
    RunningAmax, dequantize_tensor, fake_quantize_tensor, quantize_tensor,
)

PROMPTS = [
    "Question: what is the capital of France? Answer:",
    "The orchestra tuned its instruments while the audience found their seats.",
    "Good software is small, tested and honest about what it does not do. Each module has",
    "To add two fractions, bring them to a common denominator; to solve a quadratic equation,",
]

SETTINGS: dict[str, dict[str, float]] = {
    "demo": {},
    "k_outliers": {"k_outlier": 50.0},
    "k_outliers_small_v": {"k_outlier": 50.0, "v_gain": 1 / 64},
    "k_outliers_large": {"k_outlier": 50.0, "k_gain": 8.0},
}


# --- stores: how one layer's K (or V) is kept ------------------------------------------------
class Store:
    """Holds one layer's keys (or values) `[B, H, T, D]`; `append` returns what attention reads."""

    def __init__(self) -> None:
        self.data: Tensor | None = None

    def encode(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def append(self, x: Tensor) -> Tensor:
        y = self.encode(x)
        self.data = y if self.data is None else torch.cat([self.data, y], dim=-2)
        return self.data


class CastStore(Store):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def encode(self, x: Tensor) -> Tensor:
        return x.to(self.dtype).to(x.dtype)


class RowStore(Store):
    """One scale per (token, head) (`per_head=True`) or per token over all heads."""

    def __init__(self, fp8: str, scale_format: str, per_head: bool = True) -> None:
        super().__init__()
        self.fp8, self.scale_format, self.per_head = fp8, scale_format, per_head

    def encode(self, x: Tensor) -> Tensor:
        if self.per_head:
            return self._round_trip(x)
        b, h, t, d = x.shape
        rows = x.permute(0, 2, 1, 3).reshape(b, t, h * d)
        y = self._round_trip(rows)
        return y.reshape(b, t, h, d).permute(0, 2, 1, 3)

    def _round_trip(self, x: Tensor) -> Tensor:
        """What a reader of the pool gets back: the rows quantized with their scales, dequantized."""
        codes, stored = F.quantize_rows(x, self.fp8, self.scale_format)
        return F.dequantize_rows(codes, stored, self.scale_format, x.dtype)


class FixedScaleStore(Store):
    def __init__(self, fp8: str, scale: float) -> None:
        super().__init__()
        self.fp8, self.scale = fp8, scale

    def encode(self, x: Tensor) -> Tensor:
        return fake_quantize_tensor(x, self.scale, self.fp8)


class RunningAmaxStore(Store):
    """Codes under one per-layer scale; re-quantized when a write raises the amax."""

    def __init__(self, fp8: str) -> None:
        super().__init__()
        self.amax = RunningAmax(fp8)
        self.codes: Tensor | None = None
        self.requantized = 0

    def append(self, x: Tensor) -> Tensor:
        old, new = self.amax.observe(x)
        if self.codes is not None and new != old:
            self.codes = self.amax.requantize(self.codes, old, new)
            self.requantized += 1
        codes = quantize_tensor(x, new, self.amax.spec.name)
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], dim=-2)
        return dequantize_tensor(self.codes, new, x.dtype)


@dataclass(frozen=True)
class Scheme:
    name: str
    make: Callable[[], Store]
    bytes_per_token_demo: int  # with the demo model's shape (2 layers, 2 KV heads, d=32)
    bytes_per_token_8b: int  # with a Llama-3-8B shape (32 layers, 8 KV heads, d=128)
    note: str = ""


def _bpt(elem: int, scale_bytes: int, per_head: bool, layers: int, heads: int, d: int) -> int:
    """Bytes per token: K and V codes, plus one scale per (layer, head) or per layer (K and V)."""
    scales = 2 * layers * scale_bytes * (heads if per_head else 1)
    return 2 * layers * heads * d * elem + scales


def schemes() -> list[Scheme]:
    def s(name, make, elem, scale_bytes, note="", per_head=True):
        return Scheme(name, make, _bpt(elem, scale_bytes, per_head, 2, 2, 32),
                      _bpt(elem, scale_bytes, per_head, 32, 8, 128), note)

    return [
        s("bfloat16 (reference)", lambda: CastStore(torch.bfloat16), 2, 0, "the 16-bit cache"),
        s("float32 (no rounding)", lambda: CastStore(torch.float32), 4, 0, "distance of the reference itself"),
        s("e4m3 token_head bfloat16", lambda: RowStore("fp8_e4m3", "bfloat16"), 1, 2, "sgl-kvc pool default"),
        s("e4m3 token_head float16", lambda: RowStore("fp8_e4m3", "float16"), 1, 2),
        s("e4m3 token_head float32", lambda: RowStore("fp8_e4m3", "float32"), 1, 4),
        s("e4m3 token_head e8m0", lambda: RowStore("fp8_e4m3", "e8m0"), 1, 1,
          "power-of-two scale in one byte"),
        s("e4m3 token bfloat16", lambda: RowStore("fp8_e4m3", "bfloat16", per_head=False), 1, 2,
          "one scale per token over all KV heads", per_head=False),
        s("e5m2 token_head bfloat16", lambda: RowStore("fp8_e5m2", "bfloat16"), 1, 2, "sgl-kvc pool, fp8_e5m2"),
        s("e4m3 layer_running_amax", lambda: RunningAmaxStore("fp8_e4m3"), 1, 0),
        s("e4m3 layer_1.0 (SGLang)", lambda: FixedScaleStore("fp8_e4m3", 1.0), 1, 0,
          "SGLang's per-layer scale without checkpoint scales"),
        s("e5m2 layer_1.0 (SGLang)", lambda: FixedScaleStore("fp8_e5m2", 1.0), 1, 0),
    ]


# --- the model ----------------------------------------------------------------------------------
def load_model(setting: dict[str, float], device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sgl_kvc.model import ensure_demo_model

    path = ensure_demo_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.to(device).eval()
    reparametrize(model, **setting)
    return model, AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def reparametrize(model, k_outlier: float = 1.0, k_gain: float = 1.0, v_gain: float = 1.0,
                  outlier_pairs: tuple[int, ...] = (14, 15)) -> None:
    """Scale key channels by g and the matching query channels by 1/g, values by g and o_proj's
    input by 1/g: the model computes the same function; its KV cache holds different magnitudes."""
    cfg = model.config
    d = cfg.head_dim
    h_kv = cfg.num_key_value_heads
    group = cfg.num_attention_heads // h_kv
    gain = torch.full((d,), k_gain)
    for c in outlier_pairs:  # RoPE rotates channel c with c + d/2: scale both alike
        gain[c] *= k_outlier
        gain[c + d // 2] *= k_outlier
    for layer in model.model.layers:
        attn = layer.self_attn
        kw = attn.k_proj.weight.view(h_kv, d, -1)
        kw.mul_(gain.to(kw)[None, :, None])
        qw = attn.q_proj.weight.view(h_kv * group, d, -1)
        qw.div_(gain.to(qw)[None, :, None])
        attn.v_proj.weight.mul_(v_gain)
        attn.o_proj.weight.div_(v_gain)


def _cache(num_layers: int, make: Callable[[], Store]):
    from transformers.cache_utils import Cache, DynamicLayer

    class StoreLayer(DynamicLayer):
        def __init__(self) -> None:
            super().__init__()
            self.k_store, self.v_store = make(), make()

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys = self.k_store.append(key_states)
            self.values = self.v_store.append(value_states)
            return self.keys, self.values

    return Cache(layers=[StoreLayer() for _ in range(num_layers)])


@torch.no_grad()
def run(model, prompt: Tensor, n_new: int, make: Callable[[], Store], forced: Tensor | None = None):
    """Greedy decoding (or teacher forcing on `forced`). Returns tokens [n], logits [n, V],
    attention outputs [n, layers, H*D] of the position that predicts each token, the cache."""
    layers = model.model.layers
    cache = _cache(len(layers), make)
    step_attn: list[Tensor] = []
    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(
            lambda mod, args: step_attn.append(args[0][0, -1].float().clone())
        )
        for layer in layers
    ]
    tokens, logits, attn = [], [], []
    try:
        out = model(prompt[None], past_key_values=cache, use_cache=True)
        for i in range(n_new):
            lg = out.logits[0, -1].float()
            logits.append(lg)
            attn.append(torch.stack(step_attn))
            step_attn.clear()
            tok = forced[i] if forced is not None else lg.argmax()
            tokens.append(int(tok))
            if i + 1 < n_new:
                out = model(tok.reshape(1, 1), past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return torch.tensor(tokens), torch.stack(logits), torch.stack(attn), cache


def _rel(a: Tensor, b: Tensor) -> Tensor:
    """Relative L2 error of a against reference b over the last dimension."""
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


def _q(values: Tensor, q: float) -> float:
    return float(torch.quantile(values.double(), q))


def kv_magnitudes(cache) -> dict[str, float]:
    k = torch.cat([layer.k_store.data.flatten() for layer in cache.layers]).abs()
    v = torch.cat([layer.v_store.data.flatten() for layer in cache.layers]).abs()
    e4 = F.fp8_spec("fp8_e4m3")
    small = 2.0 ** e4.min_normal_exp
    return {
        "k_amax": float(k.max()), "k_median_abs": float(k.median()),
        "v_amax": float(v.max()), "v_median_abs": float(v.median()),
        "k_share_over_448": float((k > e4.max).double().mean()),
        "k_share_e4m3_subnormal_at_scale_1": float((k < small).double().mean()),
        "v_share_e4m3_subnormal_at_scale_1": float((v < small).double().mean()),
    }


def measure_setting(setting: str, args: argparse.Namespace) -> dict:
    model, tok = load_model(SETTINGS[setting], args.device)
    prompts = [torch.tensor(tok(p).input_ids, device=args.device) for p in PROMPTS[: args.prompts]]
    all_schemes = schemes()
    ref_scheme = all_schemes[0]
    refs = [run(model, p, args.new_tokens, ref_scheme.make) for p in prompts]
    rows = []
    for scheme in all_schemes[1:]:
        lg_err, at_err, top1, free_match, first_div = [], [], [], [], []
        requant = 0
        for p, (ref_tok, ref_lg, ref_at, _) in zip(prompts, refs):
            _, lg, at, cache = run(model, p, args.new_tokens, scheme.make, forced=ref_tok)
            lg_err.append(_rel(lg, ref_lg))
            at_err.append(_rel(at, ref_at).flatten())
            top1.append((lg.argmax(-1) == ref_lg.argmax(-1)).double())
            requant += sum(getattr(layer.k_store, "requantized", 0) + getattr(layer.v_store, "requantized", 0)
                           for layer in cache.layers)
            free_tok, *_ = run(model, p, args.new_tokens, scheme.make)
            same = free_tok == ref_tok
            free_match.append(float(same.double().mean()))
            first_div.append(int(same.long().cumprod(0).sum()))
        lg_all, at_all, top1_all = torch.cat(lg_err), torch.cat(at_err), torch.cat(top1)
        rows.append({
            "scheme": scheme.name, "note": scheme.note,
            "attn_rel_err_mean": float(at_all.mean()), "attn_rel_err_p95": _q(at_all, 0.95),
            "logits_rel_err_mean": float(lg_all.mean()), "logits_rel_err_p95": _q(lg_all, 0.95),
            "top1_agreement_teacher_forced": float(top1_all.mean()),
            "greedy_match_free_running": sum(free_match) / len(free_match),
            "greedy_first_divergence_mean": sum(first_div) / len(first_div),
            "requantizations": requant,
            "bytes_per_token_demo": scheme.bytes_per_token_demo,
            "bytes_per_token_llama3_8b": scheme.bytes_per_token_8b,
        })
        print(f"  {setting:>20} | {scheme.name:<26} attn {rows[-1]['attn_rel_err_mean']:.4f} "
              f"logits {rows[-1]['logits_rel_err_mean']:.4f} top1 {rows[-1]['top1_agreement_teacher_forced']:.3f} "
              f"free {rows[-1]['greedy_match_free_running']:.3f}", flush=True)
    return {"setting": setting, "reparametrization": SETTINGS[setting],
            "kv_magnitudes": kv_magnitudes(refs[0][3]), "schemes": rows}


def markdown(results: list[dict]) -> str:
    lines = []
    for res in results:
        m = res["kv_magnitudes"]
        lines.append(f"\n**{res['setting']}** (|K| max {m['k_amax']:.3g}, |V| max {m['v_amax']:.3g}, "
                     f"median |V| {m['v_median_abs']:.3g})\n")
        lines.append("| scheme | attn rel err (mean / p95) | logits rel err (mean / p95) | top-1 agree | "
                     "free greedy match | bytes/token (demo / 8B) |")
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in res["schemes"]:
            lines.append(
                f"| {r['scheme']} | {r['attn_rel_err_mean']:.4f} / {r['attn_rel_err_p95']:.4f} "
                f"| {r['logits_rel_err_mean']:.4f} / {r['logits_rel_err_p95']:.4f} "
                f"| {100 * r['top1_agreement_teacher_forced']:.1f}% | {100 * r['greedy_match_free_running']:.1f}% "
                f"| {r['bytes_per_token_demo']} / {r['bytes_per_token_llama3_8b']} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scheme"] for r in results[0]["schemes"] if not r["scheme"].startswith("float32")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(results)
    for j, res in enumerate(results):
        rows = {r["scheme"]: r for r in res["schemes"]}
        xs = [i + j * width for i in range(len(names))]
        axes[0].bar(xs, [rows[n]["logits_rel_err_mean"] for n in names], width, label=res["setting"])
        axes[1].bar(xs, [100 * rows[n]["top1_agreement_teacher_forced"] for n in names], width,
                    label=res["setting"])
    axes[0].set_yscale("log")
    axes[0].set_title("next-token logits: relative error vs bf16 cache (log)")
    axes[1].set_title("top-1 agreement with bf16 cache, teacher forced (%)")
    for ax, loc in zip(axes, ("upper left", "lower left")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=40, ha="right", fontsize=8)
        ax.legend(fontsize=7, loc=loc, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--out", type=Path, default=Path("research/results"))
    args = p.parse_args(argv)
    meta = run_metadata("research.fp8_accuracy", argv)
    print(metadata_markdown(meta), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = [measure_setting(s, args) for s in args.settings]
    setup = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d"), "model": "built-in demo Llama "
        "(2 layers, 4 q heads, 2 KV heads, head_dim 32), float32 arithmetic, transformers eager attention",
        "reference": "bfloat16 KV cache", "prompts": args.prompts, "new_tokens_per_prompt": args.new_tokens,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (args.out / "fp8-accuracy.json").write_text(
        json.dumps({"meta": meta, "setup": setup, "results": results}, indent=2))
    table = markdown(results)
    (args.out / "fp8-accuracy.md").write_text(
        f"{metadata_markdown(meta)}\n"
        f"{setup['model']}; {args.prompts} prompts x {args.new_tokens} greedy tokens; {setup['machine']}\n{table}")
    plot(results, args.out / "fp8-accuracy.png")
    print(table)


if __name__ == "__main__":
    main()
