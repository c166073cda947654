"""A float64 KVzip reference on a transformers checkpoint, written from the paper and kvpress 0.5.5
`KVzipPress` (not from sgl-kvc's code): the context's cache, a teacher-forced pass that repeats the
context chunk by chunk, each entry's score, and the uniform per-head choice a server must make."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass
class KVzipReference:
    start: int  # the context's first position (after the system prompt)
    end: int  # past its last (before the template's opening of the answer)
    scores: torch.Tensor  # float64 [L, H_kv, n]: +inf outside the context


def _template(tok) -> tuple[list[int], list[int]]:
    """(system prompt ids, answer opening ids) around a user message, as kvpress splits them."""
    dummy = "dummy context"
    sep = "\n" + "#" * len(dummy)
    text = tok.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True,
                                   tokenize=False)
    context, suffix = text.split(sep)
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    return encode(context.split(dummy)[0]), encode(suffix)


def kvzip_scores(model_path: str, ids: list[int], *, chunk: int, overlap: int = 8, sink: int = 4,
                 reduce: str = "max") -> KVzipReference:
    """Every entry's KVzip score for the prompt `ids` read whole (a chat prompt: its context lies
    between the template's system prompt and its opening of the answer). `reduce="mean"` averages
    over a KV head's query group instead of taking the largest (a deliberately wrong variant)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64, attn_implementation="eager").eval()
    cfg = model.config
    h_kv, h_q = cfg.num_key_value_heads, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h_q
    system, suffix = _template(tok)
    n = len(ids)
    start = len(system) if ids[: len(system)] == system else min(sink, n)
    end = n - len(suffix) if ids[n - len(suffix):] == suffix else n
    scores = torch.full((cfg.num_hidden_layers, h_kv, n), math.inf, dtype=torch.float64)
    scores[:, :, start:end] = 0.0
    queries: dict[int, torch.Tensor] = {}

    def capture(module, args, kwargs, output):
        hidden = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        q = module.q_proj(hidden).view(hidden.shape[0], hidden.shape[1], -1, d).transpose(1, 2)
        queries[module.layer_idx] = (q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1))[0]  # [H_q, r, d]

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:end]]), past_key_values=cache)
        hooks = [layer.self_attn.register_forward_hook(capture, with_kwargs=True) for layer in model.model.layers]
        try:
            for cs in range(start, end, chunk):
                ce = min(cs + chunk, end)
                ask = FIRST if cs == start else None
                ask_ids = tok.encode(ask, add_special_tokens=False) if ask else (
                    tok.encode(LATER, add_special_tokens=False) + ids[max(start, cs - overlap):cs])
                repeat = ask_ids + suffix + ids[cs:ce]
                r = len(repeat)
                model(input_ids=torch.tensor([repeat]), past_key_values=cache,
                      position_ids=torch.arange(end, end + r)[None])
                for layer in range(cfg.num_hidden_layers):
                    keys = cache.layers[layer].keys[0]  # [H_kv, end + r, d]
                    q = queries[layer].reshape(h_kv, h_q // h_kv, r, d)
                    s = min(sink, cs)
                    sub = torch.cat([keys[:, :s], keys[:, cs:ce], keys[:, end:]], dim=1)
                    logits = torch.einsum("kgrd,kmd->kgrm", q, sub) / math.sqrt(d)
                    m = s + ce - cs
                    future = torch.arange(r)[None, :] > torch.arange(r)[:, None]
                    logits[..., m:] = logits[..., m:].masked_fill(future, -math.inf)
                    probs = logits.softmax(-1)[..., s:m]  # [H_kv, G, r, ce - cs]
                    grouped = probs.amax(dim=1) if reduce == "max" else probs.mean(dim=1)
                    scores[layer, :, cs:ce] = grouped.amax(dim=1)
                cache.crop(-r)  # the repeat leaves the cache
        finally:
            for h in hooks:
                h.remove()
    return KVzipReference(start, end, scores)


def uniform_choice(ref: KVzipReference, budget: int, window: int) -> tuple[list[list[set[int]]], list[list[float]]]:
    """Per (layer, KV head), the positions a uniform budget keeps: what the pass never scored
    (+inf) and the last `window` tokens, then the highest scores (ties to the lower position); and
    each head's margin, the gap between the last kept score and the best one dropped (how far the
    choice is from a tie)."""
    n_layers, h_kv, n = ref.scores.shape
    kept, margins = [], []
    for layer in range(n_layers):
        kept.append([]), margins.append([])
        for h in range(h_kv):
            s = ref.scores[layer, h].clone()
            s[n - window:] = math.inf
            order = sorted(range(n), key=lambda j: (-s[j].item(), j))
            chosen = order[:budget]
            kept[-1].append(set(chosen))
            last, first_out = s[chosen[-1]].item(), s[order[budget]].item() if budget < n else -math.inf
            margins[-1].append(last - first_out)
    return kept, margins


def token_choice(ref: KVzipReference, budget: int, window: int) -> tuple[set[int], list[float]]:
    """The positions a uniform pool keeps in every head (`Policy.global_sort` under uniform budgets):
    the `budget` tokens with the highest mean score over every layer and KV head, what the pass
    never scored (+inf) and the last `window` tokens first (ties to the lower position); and every
    token's mean score (+inf where protected)."""
    s = ref.scores.clone()
    n = s.shape[-1]
    s[..., n - window:] = math.inf
    mean = s.mean(dim=(0, 1))
    order = sorted(range(n), key=lambda j: (-mean[j].item(), j))
    return set(order[:budget]), [mean[j].item() for j in range(n)]
