"""Reference for the second chunk cut (carried scores): the cache after cut 1 is the server's kept set
(equal to the reference's, checked by cut1.py); chunk 2 is prefilled on it (per-head masked attention),
its context [P1, P2) is repeated in chunks of 485 attending to the compressed cache, scored as kvpress
does; the old entries keep their cut-1 reference scores; uniform top-256 with system prompt and the
last 8 protected. Compared with the server's second compaction."""
import json, math, sys, torch
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import probe
from probe import MASKS, MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.models.llama.modeling_llama import rotate_half
from benchmarks.quality_samples import passkey_samples
from tests.kvzip_reference import kvzip_scores, _template, FIRST, LATER
from sgl_kvc.policies.per_head import select_from_scores
CH = 485
tok = AutoTokenizer.from_pretrained(MODEL)
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float64, attn_implementation="kvc_masked").eval()
cfg = model.config; L, Hk, Hq, d = 30, 3, 9, 64
system, suffix = _template(tok)
samples = passkey_samples(tok, {2048: 1}, [0.1, 0.5, 0.9], 0, "templated")
ans = json.load(open("/tmp/kvzip_probe/srv/uniform-pressure/answers.json"))
ev = {}
for l in open("/tmp/kvzip_probe/srv/uniform-pressure/trace.jsonl"):
    e = json.loads(l); ev.setdefault(e["rid"], []).append(e)
queries = {}
def capture(module, args, kwargs, output):
    hidden = kwargs["hidden_states"]; cos, sin = kwargs["position_embeddings"]
    q = module.q_proj(hidden).view(hidden.shape[0], hidden.shape[1], -1, d).transpose(1, 2)
    queries[module.layer_idx] = (q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1))[0]
for s, a in zip(samples, ans):
    e1, e2 = ev[a["rid"]][0], ev[a["rid"]][1]
    P1, P2 = e1["logical_len"], e2["logical_len"]
    ids = s.prompt_ids
    ref1 = kvzip_scores(MODEL, ids[:P1], chunk=CH)
    keep1 = [[set(e1["kept_positions"][l][h]) for h in range(Hk)] for l in range(L)]
    MASKS.clear(); cache = DynamicCache()
    scores = torch.full((L, Hk, P2), -math.inf, dtype=torch.float64)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:P1]]), past_key_values=cache)
        for l in range(L):
            m = torch.zeros(Hk, P1, dtype=torch.bool)
            for h in range(Hk):
                m[h, sorted(keep1[l][h])] = True
                scores[l, h, sorted(keep1[l][h])] = ref1.scores[l, h, sorted(keep1[l][h])]
            MASKS[l] = m
        model(input_ids=torch.tensor([ids[P1:P2]]), past_key_values=cache, position_ids=torch.arange(P1, P2)[None])
        scores[:, :, P1:P2] = 0.0
        hooks = [layer.self_attn.register_forward_hook(capture, with_kwargs=True) for layer in model.model.layers]
        for cs in range(P1, P2, CH):
            ce = min(cs + CH, P2)
            ask = tok.encode(LATER, add_special_tokens=False) + ids[cs - 8:cs]
            rep = ask + suffix + ids[cs:ce]; r = len(rep)
            model(input_ids=torch.tensor([rep]), past_key_values=cache, position_ids=torch.arange(P2, P2 + r)[None])
            for l in range(L):
                keys = cache.layers[l].keys[0]  # [Hk, P2 + r, d]
                q = queries[l].reshape(Hk, Hq // Hk, r, d)
                for h in range(Hk):
                    cols = [p for p in range(min(4, cs)) if p in keep1[l][h]] + list(range(cs, ce))
                    sub = torch.cat([keys[h, cols], keys[h, P2:]], dim=0)
                    lg = torch.einsum("grd,md->grm", q[h], sub) / math.sqrt(d)
                    m = len(cols)
                    fut = torch.arange(r)[None, :] > torch.arange(r)[:, None]
                    lg[..., m:] = lg[..., m:].masked_fill(fut, -math.inf)
                    pr = lg.softmax(-1)[..., len(cols) - (ce - cs):m]
                    scores[l, h, cs:ce] = pr.amax(dim=(0, 1))
            cache.crop(-r)
        for hk in hooks: hk.remove()
    MASKS.clear()
    prot = torch.zeros(L, P2, dtype=torch.bool); prot[:, :len(system)] = True; prot[:, P2 - 8:] = True
    sel = select_from_scores(scores.float(), prot, 256, mode="uniform")
    j = []
    for l in range(L):
        for h in range(Hk):
            a_, b_ = set(e2["kept_positions"][l][h]), set(sel.kept(l, h).tolist())
            j.append(len(a_ & b_) / len(a_ | b_))
    print(s.id, f"cut 2 at {P2}: Jaccard mean {sum(j)/len(j):.4f} min {min(j):.3f} exact {sum(x == 1 for x in j)}/90", flush=True)
