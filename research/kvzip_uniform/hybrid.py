"""Each head keeps a share of its entries by its own KVzip reference scores and the rest by the token
sort (mean over layers and heads), on allocations.py's 8 prompts. Arguments: the shares
(comma-separated), the token average (mean or top10)."""
import sys, os, torch
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe
from probe import generate
from transformers import AutoModelForCausalLM, AutoTokenizer
from benchmarks.quality_samples import is_correct, passkey_samples
from tests.kvzip_reference import KVzipReference
tok = AutoTokenizer.from_pretrained(probe.MODEL)
model = AutoModelForCausalLM.from_pretrained(probe.MODEL, dtype=torch.float32, attn_implementation="kvc_masked").eval()
sets = [(1024, 128, [0.1, 0.9], 0), (2048, 256, [0.1, 0.5, 0.9], 0), (1024, 128, [0.3, 0.5, 0.7], 1)]
fracs = [float(x) for x in sys.argv[1].split(",")]
agg = sys.argv[2] if len(sys.argv) > 2 else "mean"
tot = {f: 0 for f in fracs}
for (L, b, depths, seed) in sets:
    for s_ in passkey_samples(tok, {L: 1}, depths, seed):
        ref = KVzipReference(**torch.load(f"/tmp/kvzip_probe/{s_.id}.ref.pt")); n = len(s_.prompt_ids)
        s = ref.scores.float(); Lr, H, _ = s.shape
        prot = torch.isinf(s).all(dim=1).all(dim=0); prot[max(n - 8, 0):] = True
        fin = torch.where(torch.isinf(s), torch.zeros_like(s), s)
        tok_s = fin.mean(dim=(0, 1)) if agg == "mean" else fin.flatten(0,1).topk(10, dim=0).values.mean(0)
        tok_order = [i for i in tok_s.masked_fill(prot, float("inf")).argsort(descending=True).tolist()]
        row = []
        for f in fracs:
            kept = []
            for l in range(Lr):
                heads = []
                for h in range(H):
                    own = fin[l, h].masked_fill(prot, float("inf")).argsort(descending=True).tolist()
                    k_own = int(round(b * f))
                    keep = set(own[:k_own])
                    for t in tok_order:
                        if len(keep) >= b: break
                        keep.add(t)
                    heads.append(keep)
                kept.append(heads)
            ok = is_correct(s_, generate(model, tok, s_.prompt_ids, kept)); tot[f] += ok; row.append(f"{f}:{int(ok)}")
        print(s_.id, " ".join(row), flush=True)
print("own-share -> correct of 8", tot)
