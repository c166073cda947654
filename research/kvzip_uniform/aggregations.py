"""Token sorts by other averages of KVzip's reference scores over layers and heads (the same 8 prompts
as allocations.py, every head keeping the top tokens): mean, each head divided by its largest score
or by its sum, per-head ranks, log, square root, median, 0.9 quantile, the mean of the 10 best heads.
Argument: the comma-separated names. Reads the reference scores allocations.py saves."""
import sys, os, torch
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe
from probe import generate
from transformers import AutoModelForCausalLM, AutoTokenizer
from benchmarks.quality_samples import is_correct, passkey_samples
from tests.kvzip_reference import KVzipReference, kvzip_scores
from sgl_kvc.policies.per_head import select_from_scores
tok = AutoTokenizer.from_pretrained(probe.MODEL)
model = AutoModelForCausalLM.from_pretrained(probe.MODEL, dtype=torch.float32, attn_implementation="kvc_masked").eval()
sets = [(1024, 128, [0.1, 0.9], 0), (2048, 256, [0.1, 0.5, 0.9], 0), (1024, 128, [0.3, 0.5, 0.7], 1)]
aggs = sys.argv[1].split(",")
def agg_scores(s, agg):
    fin = torch.where(torch.isinf(s), torch.zeros_like(s), s)  # [L,H,n]
    if agg == "mean": return fin.mean(dim=(0, 1))
    if agg == "max": return fin.amax(dim=(0, 1))
    if agg == "normmax": return (fin / fin.amax(-1, keepdim=True).clamp_min(1e-9)).mean(dim=(0, 1))
    if agg == "normsum": return (fin / fin.sum(-1, keepdim=True).clamp_min(1e-9)).mean(dim=(0, 1))
    if agg == "rank": return fin.argsort(-1).argsort(-1).float().mean(dim=(0, 1))
    if agg == "logmean": return torch.log(fin.clamp_min(1e-6)).mean(dim=(0, 1))
    if agg == "sqrtmean": return fin.sqrt().mean(dim=(0, 1))
    if agg == "median": return fin.flatten(0, 1).median(dim=0).values
    if agg.startswith("q"): return fin.flatten(0, 1).quantile(float(agg[1:]), dim=0)
    if agg.startswith("top"): k=int(agg[3:]); return fin.flatten(0, 1).topk(k, dim=0).values.mean(0)
    raise ValueError(agg)
tot = {a: 0 for a in aggs}; count = 0
for (L, b, depths, seed) in sets:
    for s_ in passkey_samples(tok, {L: 1}, depths, seed):
        cp = f"/tmp/kvzip_probe/{s_.id}.ref.pt"
        if os.path.exists(cp): ref = KVzipReference(**torch.load(cp))
        else:
            ref = kvzip_scores(probe.MODEL, s_.prompt_ids, chunk=2048); torch.save({"start": ref.start, "end": ref.end, "scores": ref.scores}, cp)
        n = len(s_.prompt_ids); s = ref.scores.float(); Lr, H, _ = s.shape
        if not is_correct(s_, generate(model, tok, s_.prompt_ids, None)): print(s_.id, "full wrong"); continue
        count += 1
        prot = torch.isinf(s).all(dim=1).all(dim=0); prot[max(n - 8, 0):] = True
        row = []
        for a in aggs:
            t = agg_scores(s, a).masked_fill(prot, float("inf"))
            keep = set(t.topk(min(b, n)).indices.tolist())
            txt = generate(model, tok, s_.prompt_ids, [[keep] * H for _ in range(Lr)])
            ok = is_correct(s_, txt); tot[a] += ok; row.append(f"{a}:{int(ok)}")
        print(s_.id, " ".join(row), flush=True)
print("TOTAL of", count, tot)
