"""KVzip's reference scores (kvpress's, `tests/kvzip_reference.py`) kept by each allocation the pools
can store, on 8 pass-key prompts (2 x 1K and 3 x 2K of seed 0, 3 x 1K of seed 1, templated): per-head
top-k (uniform, also at twice the budget), one sort per layer (layer), one sort over every head
(variable), and one sort over tokens by their mean score over every layer and head, which every head
keeps (what a uniform pool can store; at 1, 1.25 and 1.5 times the budget). Budgets: 128 at 1K, 256
at 2K (an eighth of the prompt). Answers decoded under transformers with a per-head mask on the
prompt's entries. Writes nothing; prints one line per prompt and the totals."""
import os, sys, torch
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe
from probe import generate, select
from transformers import AutoModelForCausalLM, AutoTokenizer
from benchmarks.quality_samples import is_correct, passkey_samples
from sgl_kvc.policies.per_head import select_from_scores, token_scores
from tests.kvzip_reference import KVzipReference, kvzip_scores

tok = AutoTokenizer.from_pretrained(probe.MODEL)
model = AutoModelForCausalLM.from_pretrained(probe.MODEL, dtype=torch.float32, attn_implementation="kvc_masked").eval()
SETS = [(1024, 128, [0.1, 0.9], 0), (2048, 256, [0.1, 0.5, 0.9], 0), (1024, 128, [0.3, 0.5, 0.7], 1)]


def tokens(ref, n, budget, window=8):
    s = ref.scores.float()
    protected = torch.isinf(s).all(dim=1)
    protected[:, max(n - window, 0):] = True
    sel = select_from_scores(token_scores(s, torch.arange(n)), protected, budget)
    return [[set(sel.kept(l, h).tolist()) for h in range(sel.num_heads)] for l in range(sel.num_layers)]


ALLOCATIONS = {
    "uniform": lambda ref, n, b: select(ref.scores, n, b, "uniform"),
    "uniform 2x": lambda ref, n, b: select(ref.scores, n, 2 * b, "uniform"),
    "layer": lambda ref, n, b: select(ref.scores, n, b, "layer"),
    "variable": lambda ref, n, b: select(ref.scores, n, b, "variable"),
    "tokens": lambda ref, n, b: tokens(ref, n, b),
    "tokens 1.25x": lambda ref, n, b: tokens(ref, n, b * 5 // 4),
    "tokens 1.5x": lambda ref, n, b: tokens(ref, n, b * 3 // 2),
}
total = dict.fromkeys(ALLOCATIONS, 0)
answered = 0
for length, budget, depths, seed in SETS:
    for s in passkey_samples(tok, {length: 1}, depths, seed):
        path = f"/tmp/kvzip_probe/{s.id}.ref.pt"  # the 8 ids differ (probe.py and sweep.py read the same files)
        if os.path.exists(path):
            ref = KVzipReference(**torch.load(path))
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            ref = kvzip_scores(probe.MODEL, s.prompt_ids, chunk=2048)
            torch.save({"start": ref.start, "end": ref.end, "scores": ref.scores}, path)
        n = len(s.prompt_ids)
        if not is_correct(s, generate(model, tok, s.prompt_ids, None)):
            print(s.id, f"seed {seed}: the full cache misses it", flush=True)
            continue
        answered += 1
        row = {}
        for name, choose in ALLOCATIONS.items():
            row[name] = int(is_correct(s, generate(model, tok, s.prompt_ids, choose(ref, n, budget))))
            total[name] += row[name]
        print(s.id, f"seed {seed}, budget {budget}:", row, flush=True)
print(f"kept of {answered}:", total)
