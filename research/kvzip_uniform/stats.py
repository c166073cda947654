import json, sys, torch
sys.path.insert(0, __import__("os").path.abspath(__import__("os").path.join(__import__("os").path.dirname(__file__), "..", "..")))  # the repository root
from tests.kvzip_reference import KVzipReference
R = json.load(open("/tmp/kvzip_probe/probe.json"))
for r in R[:3]:
    ref = KVzipReference(**torch.load(f"/tmp/kvzip_probe/{r['id']}.ref.pt"))
    s = ref.scores[:, :, ref.start:ref.end].float()  # context only
    key = [k - ref.start for k in r["key_at"]]
    top = s.sort(dim=-1, descending=True).values
    s256 = top[..., 255]
    print(r["id"], "context", s.shape[-1])
    rows = []
    for l in range(30):
        for h in range(3):
            hi = int((s[l, h] > 0.5).sum()); mid = int((s[l, h] > 0.1).sum())
            rank = [(s[l, h] > s[l, h, k]).sum().item() for k in key]
            rows.append((l, h, hi, mid, float(s256[l, h]), float(s[l, h, key].min()), sorted(rank)[len(rank)//2], r["variable"]["sizes"][l][h], r["uniform"]["key_share"][l][h], r["variable"]["key_share"][l][h]))
    rows.sort(key=lambda x: -x[2])
    print(" l  h  #>0.5 #>0.1  s256    key_min  key_med_rank var_size  key%uni key%var")
    for x in rows[:14]:
        print(f"{x[0]:2d} {x[1]:2d} {x[2]:6d} {x[3]:5d}  {x[4]:.4f}  {x[5]:.4f}  {x[6]:6d}  {x[7]:6d}   {x[8]:.1f}  {x[9]:.1f}")
    print(" heads with >256 entries above 0.5:", sum(x[2] > 256 for x in rows), "| above 0.1:", sum(x[3] > 256 for x in rows))
