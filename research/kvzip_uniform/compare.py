import json, math, sys
import torch
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from tests.kvzip_reference import KVzipReference, uniform_choice
from probe import select
mode = sys.argv[1]
ans = json.load(open(f"/tmp/kvzip_probe/srv/{mode}/answers.json"))
ev = {json.loads(l)["rid"]: json.loads(l) for l in open(f"/tmp/kvzip_probe/srv/{mode}/trace.jsonl")}
for a in ans:
    e = ev[a["rid"]]
    ref = KVzipReference(**torch.load(f"/tmp/kvzip_probe/{a['id']}.ref.pt"))
    n = ref.scores.shape[-1]
    mine = select(ref.scores, n, 256, mode)
    if mode == "uniform":
        rc, margins = uniform_choice(ref, 256, 8)
    jac, jac2, worst, lost = [], [], (1, None), []
    for l in range(30):
        for h in range(3):
            srv = set(e["kept_positions"][l][h])
            j = len(srv & mine[l][h]) / len(srv | mine[l][h])
            jac.append(j)
            if mode == "uniform":
                jac2.append(len(rc[l][h] & mine[l][h]) / len(rc[l][h] | mine[l][h]))
            if j < worst[0]: worst = (j, (l, h))
            # reference score mass kept by server vs by reference choice
    print(a["id"], a["text"], f"server vs ref-selection Jaccard mean {sum(jac)/len(jac):.3f} min {worst[0]:.3f} at {worst[1]}",
          f"exact heads {sum(j == 1 for j in jac)}/90", f"| ref uniform_choice vs sgl select {sum(jac2)/max(1,len(jac2)):.3f}" if jac2 else "",
          "sizes", sum(len(h) for L in e["kept_positions"] for h in L), sum(len(h) for L in mine for h in L))
