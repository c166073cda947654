import json, sys, torch
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
import probe
from probe import select, generate
from transformers import AutoModelForCausalLM, AutoTokenizer
from benchmarks.quality_samples import is_correct, passkey_samples
from tests.kvzip_reference import KVzipReference
tok = AutoTokenizer.from_pretrained(probe.MODEL)
model = AutoModelForCausalLM.from_pretrained(probe.MODEL, dtype=torch.float32, attn_implementation="kvc_masked").eval()
samples = passkey_samples(tok, {2048: 1}, [0.1, 0.5, 0.9], 0, "templated")
def run(name, fn):
    res = []
    for s in samples:
        ref = KVzipReference(**torch.load(f"/tmp/kvzip_probe/{s.id}.ref.pt"))
        kept = fn(ref, len(s.prompt_ids))
        t = generate(model, tok, s.prompt_ids, kept)
        res.append((is_correct(s, t), t.replace("The pass key is ", "")[:12], sum(len(h) for L in kept for h in L)))
    print(f"{name:45s} {sum(r[0] for r in res)}/3", [r[1] for r in res], "entries", [r[2] for r in res], flush=True)
for b in (384, 512, 768, 1024):
    run(f"uniform @{b}", lambda ref, n, b=b: select(ref.scores, n, b, "uniform"))
for b in (512, 768):
    run(f"layer @{b}", lambda ref, n, b=b: select(ref.scores, n, b, "layer"))
def uni_plus(heads):
    def f(ref, n):
        k = select(ref.scores, n, 256, "uniform")
        for (l, h) in heads:
            k[l][h] = set(range(n))
        return k
    return f
run("uniform @256 + (18,2) whole", uni_plus([(18, 2)]))
run("uniform @256 + (18,2),(20,2),(17,1) whole", uni_plus([(18, 2), (20, 2), (17, 1)]))
def var_minus(heads, cap=256):
    def f(ref, n):
        k = select(ref.scores, n, 256, "variable")
        u = select(ref.scores, n, cap, "uniform")
        for (l, h) in heads:
            k[l][h] = u[l][h]
        return k
    return f
run("variable @256, (18,2) capped at 256", var_minus([(18, 2)]))
run("variable @256, 10 widest heads capped at 256", var_minus([(18,2),(20,2),(17,1),(23,0),(20,1),(14,1),(15,2),(23,2),(7,2),(21,2)]))
