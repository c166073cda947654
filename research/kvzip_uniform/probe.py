"""Offline KVzip probe: reference KVzip scores (tests/kvzip_reference.py), sgl-kvc's per-head
selection (uniform / layer / variable) on them, whether the pass key is kept per (layer, head),
and the greedy answer when decoding from the masked cache (first token from the full prefill)."""
import json
import math
import sys
import time

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, DynamicCache

sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root
from benchmarks.quality_samples import is_correct, passkey_samples  # noqa: E402
from benchmarks.quality_trace import answer_positions  # noqa: E402
from sgl_kvc.policies.per_head import select_from_scores  # noqa: E402
from tests.kvzip_reference import kvzip_scores  # noqa: E402

MODEL = str(__import__("sgl_kvc.model", fromlist=["ensure_smollm2"]).ensure_smollm2())  # the default model, converted once
MASKS: dict[int, torch.Tensor] = {}  # layer -> bool keep [H_kv, n_prompt]


def masked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    g = module.num_key_value_groups
    k = key.repeat_interleave(g, dim=1)
    v = value.repeat_interleave(g, dim=1)
    w = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            w = w.masked_fill(~attention_mask, -math.inf)
        else:
            w = w + attention_mask[..., : w.shape[-1]]
    ql, kl = w.shape[-2], w.shape[-1]
    if attention_mask is None and ql > 1:
        future = torch.arange(kl)[None, :] > torch.arange(ql)[:, None] + (kl - ql)
        w = w.masked_fill(future, -math.inf)
    keep = MASKS.get(module.layer_idx)
    if keep is not None:
        n = keep.shape[1]
        add = torch.zeros(keep.shape[0] * g, w.shape[-1])
        add[:, :n] = torch.where(keep.repeat_interleave(g, dim=0), 0.0, -math.inf)
        w = w + add[None, :, None, :]
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(w, v).transpose(1, 2).contiguous()
    return out, w


AttentionInterface.register("kvc_masked", masked_attention)


def generate(model, tok, ids, keep_sets, max_tokens=16):
    """keep_sets: None (full cache) or [L][H] sets of kept positions."""
    MASKS.clear()
    cache = DynamicCache()
    n = len(ids)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache)
        nxt = int(out.logits[0, -1].argmax())
        toks = [nxt]
        if keep_sets is not None:
            for layer, heads in enumerate(keep_sets):
                m = torch.zeros(len(heads), n, dtype=torch.bool)
                for h, s in enumerate(heads):
                    m[h, sorted(s)] = True
                MASKS[layer] = m
        for step in range(max_tokens - 1):
            if nxt == tok.eos_token_id:
                break
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache,
                        position_ids=torch.tensor([[n + step]]))
            nxt = int(out.logits[0, -1].argmax())
            toks.append(nxt)
    MASKS.clear()
    return tok.decode(toks, skip_special_tokens=True)


def select(scores, n, budget, mode, window=8):
    s = scores.float().clone()
    protected = torch.isinf(s).all(dim=1)  # [L, n]: what the pass never scored
    protected[:, max(n - window, 0):] = True
    sel = select_from_scores(s, protected, budget, mode=mode)
    return [[set(sel.kept(l, h).tolist()) for h in range(sel.num_heads)] for l in range(sel.num_layers)]


def main():
    per_depth = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    style = sys.argv[2] if len(sys.argv) > 2 else "templated"
    out_path = sys.argv[3] if len(sys.argv) > 3 else "/tmp/kvzip_probe/probe.json"
    budget = 256
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="kvc_masked").eval()
    samples = passkey_samples(tok, {2048: per_depth}, [0.1, 0.5, 0.9], 0, style)
    results = []
    for s in samples:
        t0 = time.time()
        ids = s.prompt_ids
        n = len(ids)
        key_at = answer_positions(ids, tok.encode(s.answer, add_special_tokens=False))
        full = generate(model, tok, ids, None)
        import os
        from tests.kvzip_reference import KVzipReference
        cp = f"/tmp/kvzip_probe/{s.id}.ref.pt"
        if os.path.exists(cp):
            ref = KVzipReference(**torch.load(cp))
        else:
            ref = kvzip_scores(MODEL, ids, chunk=2048)
            torch.save({"start": ref.start, "end": ref.end, "scores": ref.scores}, cp)
        row = {"id": s.id, "n": n, "start": ref.start, "end": ref.end, "key_at": key_at,
               "question_at": s.meta["question_at"], "full": full, "full_ok": is_correct(s, full)}
        for mode in ("uniform", "layer", "variable"):
            kept = select(ref.scores, n, budget, mode)
            text = generate(model, tok, ids, kept)
            key_share = [[len(set(key_at) & h) / len(key_at) for h in layer] for layer in kept]
            q = list(range(s.meta["question_at"], ref.end))
            q_share = [[len(set(q) & h) / max(1, len(q)) for h in layer] for layer in kept]
            sizes = [[len(h) for h in layer] for layer in kept]
            row[mode] = {"text": text, "ok": is_correct(s, text), "key_share": key_share,
                         "question_share": q_share, "sizes": sizes}
        results.append(row)
        print(json.dumps({k: (v if not isinstance(v, dict) else {"text": v["text"], "ok": v["ok"],
              "key_mean": sum(map(sum, v["key_share"])) / 90, "q_mean": sum(map(sum, v["question_share"])) / 90})
              for k, v in row.items()}), f"{time.time() - t0:.0f}s", flush=True)
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main()
