"""Where the pass key's digits rank among the first 488 context tokens of `passkey-2048-d10-0` (the key
at positions 241-255), by KVzip's reference score averaged over every layer and head, when the
reconstruction scores the whole 2K context in one chunk, the first 512 tokens alone (a cut after the
first chunk of 512), the first 1024 alone, and the first 1024 repeated in chunks of 485 (each chunk's
softmax over its own entries, as kvpress's chunks and the server's `--kvzip-chunk`). Prints the ranks."""
import os, sys, torch
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe
from transformers import AutoTokenizer
from benchmarks.quality_samples import passkey_samples
from tests.kvzip_reference import kvzip_scores

tok = AutoTokenizer.from_pretrained(probe.MODEL)
s = passkey_samples(tok, {2048: 1}, [0.1, 0.5, 0.9], 0, "templated")[0]
ids = s.prompt_ids
key = probe.answer_positions(ids, tok.encode(s.answer, add_special_tokens=False))


def ranks(scores, lo=24, hi=512):
    mean = torch.where(torch.isinf(scores), torch.zeros_like(scores), scores).float().mean(dim=(0, 1))[lo:hi]
    order = mean.argsort(descending=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    return [int(rank[k - lo]) for k in key if lo <= k < hi]


print("key positions", key)
for label, length, chunk in (("whole 2K context, one chunk", len(ids), 2048), ("first 512 alone", 512, 2048),
                             ("first 1024 alone", 1024, 2048), ("first 1024 in chunks of 485", 1024, 485)):
    print(f"{label}: ranks {ranks(kvzip_scores(probe.MODEL, ids[:length], chunk=chunk).scores)}", flush=True)
