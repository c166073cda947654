import json, sys, torch
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from transformers import AutoTokenizer
from benchmarks.quality_samples import passkey_samples
from tests.kvzip_reference import kvzip_scores
from probe import select, MODEL
tok = AutoTokenizer.from_pretrained(MODEL)
samples = passkey_samples(tok, {2048: 1}, [0.1, 0.5, 0.9], 0, "templated")
ans = json.load(open("/tmp/kvzip_probe/srv/uniform-pressure/answers.json"))
first = {}
for l in open("/tmp/kvzip_probe/srv/uniform-pressure/trace.jsonl"):
    e = json.loads(l); first.setdefault(e["rid"], e)
for s, a in list(zip(samples, ans)):
    e = first[a["rid"]]; P = e["logical_len"]
    ref = kvzip_scores(MODEL, s.prompt_ids[:P], chunk=int(sys.argv[1]))
    mine = select(ref.scores, P, 256, "uniform")
    j = [len(set(e["kept_positions"][l][h]) & mine[l][h]) / len(set(e["kept_positions"][l][h]) | mine[l][h]) for l in range(30) for h in range(3)]
    print(s.id, "first cut at", P, "context", ref.start, ref.end, f"Jaccard mean {sum(j)/90:.4f} min {min(j):.3f} exact {sum(x == 1 for x in j)}/90", flush=True)
    srv_only = [sorted(set(e["kept_positions"][l][h]) - mine[l][h]) for l in range(30) for h in range(3)]
    ref_only = [sorted(mine[l][h] - set(e["kept_positions"][l][h])) for l in range(30) for h in range(3)]
    win = sum(all(p in e["kept_positions"][l][h] for p in range(P - 8, P)) for l in range(30) for h in range(3))
    print("  heads keeping the last 8:", win, "/90; examples srv-only", [x for x in srv_only if x][:4], "ref-only", [x for x in ref_only if x][:4])
    # margins: reference scores of differing entries vs the cutoff
    import math
    for idx in [i for i, x in enumerate(srv_only) if x][:3]:
        l, h = divmod(idx, 3)
        sc = ref.scores[l, h].clone(); sc[P-8:] = math.inf
        kept_scores = sorted((sc[list(mine[l][h])]).tolist())
        print(f"   ({l},{h}) cutoff {kept_scores[0]:.3e}; srv-only ref scores", [f"{sc[p]:.3e}" for p in srv_only[idx]], "ref-only", [f"{sc[p]:.3e}" for p in ref_only[idx]])
