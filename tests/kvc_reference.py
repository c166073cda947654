"""Helpers shared by the end-to-end compression tests: native generation, the compaction trace
(`SGLKVC_TRACE`) and the dense transformers reference that replays what the cache held."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:  # the core's tests import this module's references without the server stack
    from loadtest.server import ServerProcess

# A prompt longer than the small budgets the compression tests use.
REASONING_PROMPT = (
    "Reasoning models think aloud for thousands of tokens. Much of that text repeats itself: "
    "the same intermediate result restated, the same check performed twice."
)


def served_backend(fp8_kv: bool = False, unit_pool: bool = False) -> str:
    """The attention backend the launcher gives a server on this machine (no `--attention-backend`):
    torch_native on a CPU; on CUDA FlashInfer, or Triton without it or for sgl-kvc's pools."""
    from sgl_kvc.launcher.machine import flashinfer_installed
    from sgl_kvc.launcher.sglang_argv import default_attention_backend

    on_gpu = torch.cuda.is_available()
    return default_attention_backend(on_gpu, fp8_kv, unit_pool, flashinfer_installed() if on_gpu else True)


def generate(server: ServerProcess, input_ids: list[int], n: int, **extra: Any) -> dict:
    """Greedy `/generate` of exactly n tokens with log-probs; `sampling={...}` adds params."""
    r = server.post(
        "/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {
                "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True,
                **extra.pop("sampling", {}),
            },
            "return_logprob": True,
            **extra,
        },
    )
    r.raise_for_status()
    return r.json()


def complete_concurrently(
    server: ServerProcess, count: int, max_tokens: int, extra: Callable[[int], dict] = lambda i: {}
) -> list[int]:
    """`count` `/v1/completions` at once (prompt i: "i: REASONING_PROMPT", ignore_eos, plus
    `extra(i)` in the body); the completion tokens each got."""

    def one(i: int) -> int:
        r = server.post(
            "/v1/completions",
            json={"model": "m", "prompt": f"{i}: {REASONING_PROMPT}", "max_tokens": max_tokens,
                  "ignore_eos": True, **extra(i)},
        )
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def launcher_argv(cmd: list[str]) -> list[str]:
    """The launcher's own arguments in a server's command line (`python -m sgl_kvc.launch ...`),
    as its `parse_args` takes them: every flag, none of the interpreter's."""
    cmd = list(cmd)
    return cmd[cmd.index("sgl_kvc.launch") + 1:] if "sgl_kvc.launch" in cmd else cmd


def assert_pool_whole(stats: dict) -> None:
    """Nothing leaked: every pool slot is free or cached in the radix tree (``stats`` from
    `/v1/kvc/stats`, taken when no request runs)."""
    pool = stats["pool"]
    assert pool["free_tokens"] + pool["cached_tokens"] == pool["total_tokens"], pool


def trace_events(trace: Path, rid: str) -> list[dict]:
    lines = trace.read_text().splitlines() if trace.exists() else []
    return [e for e in map(json.loads, lines) if e["rid"] == rid]


def reference_logprobs(
    model_path: str,
    ids: list[int],
    events: list[dict],
    *,
    evict: bool = True,
    logical: bool = True,
    attn_implementation: str = "eager",
) -> torch.Tensor:
    """Dense reference: one float32 transformers forward over the whole sequence, where each
    query row sees exactly the keys that were in the server's cache when that token was
    processed (a compaction at logical length L removes keys for every query at position >= L),
    and RoPE positions are the tokens' logical positions (or, for `logical=False`, the physical
    index a token was written at, which is what ignoring the offset would give).

    A per-head event (`kept_positions` as [layer][KV head] lists) removes keys per layer and KV
    head: the forward runs with one mask per layer and query head (query head h reads KV head
    h // group), through an attention function that picks its layer's mask and then calls
    `attn_implementation` (eager, or one registered with transformers' AttentionInterface)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    inner = (eager_attention_forward if attn_implementation == "eager"
             else ALL_ATTENTION_FUNCTIONS[attn_implementation])
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation="eager"
    )
    cfg = model.config
    n_layers, h_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    group = cfg.num_attention_heads // h_kv
    t = len(ids)
    allowed = torch.ones(n_layers, h_kv, t, t, dtype=torch.bool).tril()
    positions = torch.arange(t)
    for e in sorted(events, key=lambda e: e["logical_len"]):
        length = e["logical_len"]
        kept = e["kept_positions"]
        present = torch.zeros(n_layers, h_kv, t, dtype=torch.bool)
        if kept and isinstance(kept[0], list):  # per head: [layer][KV head] lists (any lengths)
            for layer, heads in enumerate(kept):
                for head, ps in enumerate(heads):
                    present[layer, head, ps] = True
        else:  # a shared event: every head
            present[:, :, kept] = True
        present[..., length:] = True
        if evict:
            allowed[..., length:, :] &= present[:, :, None, :]
        if not logical:  # tokens after it were written right after the slots it kept
            physical = e.get("physical_kept", kept_count(e))
            positions[length:] = torch.arange(length, t) - (length - physical)
    masks = torch.zeros(n_layers, h_kv, t, t).masked_fill(~allowed, float("-inf"))
    masks = masks.repeat_interleave(group, dim=1)  # [L, H_q, t, t]

    def per_layer(module, query, key, value, attention_mask, **kwargs):
        return inner(module, query, key, value, masks[module.layer_idx][None], **kwargs)

    AttentionInterface.register("kvc_per_layer_mask", per_layer)
    model.set_attn_implementation("kvc_per_layer_mask")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), position_ids=positions[None]).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def logprob_error(model_path: str, prompt_ids: list[int], out: dict, events: list[dict]):
    """For a `generate` result `out` with logprobs: a function `error(events=events, **kw)` giving
    the largest |served - reference| log-prob of the generated tokens, the reference from
    `reference_logprobs(model_path, prompt + output, events, **kw)`."""
    output_ids = out["output_ids"]
    served = torch.tensor([lp[0] for lp in out["meta_info"]["output_token_logprobs"]])
    seq = prompt_ids + output_ids[:-1]
    rows = torch.arange(len(prompt_ids) - 1, len(seq))
    targets = torch.tensor(output_ids)

    def error(events: list[dict] = events, **kw: Any) -> float:
        ref = reference_logprobs(model_path, seq, events, **kw)[rows, targets]
        return float((ref - served).abs().max())

    return error


def fp8_attention(fp8: str | None) -> str:
    """Name of a transformers attention (for `reference_logprobs`) that reads K and V as the
    FP8 pool stores them: rounded per (token, KV head) row, bf16 scales. None: no rounding."""
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from fp8_reference import fake_quantize_rows

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        if fp8 is not None:
            key = fake_quantize_rows(key.to(torch.bfloat16), fp8, "bfloat16").to(key.dtype)
            value = fake_quantize_rows(value.to(torch.bfloat16), fp8, "bfloat16").to(value.dtype)
        return eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    name = f"kvc_test_{fp8}"
    AttentionInterface.register(name, attention)
    return name


def kept_count(event: dict) -> int:
    """Entries per head a compaction kept (shared or per-head event)."""
    kept = event["kept_positions"]
    while kept and isinstance(kept[0], list):
        kept = kept[0]
    return len(kept)


# --- plain-Python math for the policies' dense references (loops, float64) -----------------------
def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def maxpool(xs: list[float], kernel: int) -> list[float]:
    """Centred 1-D max pooling; edges use what exists."""
    w = kernel // 2
    return [max(xs[max(0, i - w): i + w + 1]) for i in range(len(xs))]



def window_scores(model_path: str, ids: list[int], window: int, question: list[int] | None = None,
                  dtype: torch.dtype = torch.float32) -> list[float]:
    """SnapKV's score of each entry of `ids` (`Policy.combined_score`: the mean over every layer
    and KV head, the shared selection's), its last `window` +inf (always kept), when its
    observation window is the last `window` queries of `question` read right after `ids`, or
    without one, of `ids` itself. One dense transformers forward of `ids + question` gives each
    layer's keys of `ids` and window queries after RoPE, as the server's pool and window hold
    them; the policy's own code scores them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from sgl_kvc.policies import PolicyParams, get_policy
    from sgl_kvc.policies.base import LayerView

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="eager")
    n = len(ids)
    views: dict[int, LayerView] = {}

    t = n + len(question or [])
    causal = torch.full((t, t), -math.inf).triu(1)[None, None]  # a registered attention gets no mask

    def capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        last = query[0, :, t - window : t]
        views[module.layer_idx] = LayerView(keys=key[0, :, :n].transpose(0, 1).float(),
                                            queries=last.transpose(0, 1).float(), scale=scaling)
        return eager_attention_forward(module, query, key, value, causal.to(query.dtype), scaling, dropout, **kw)

    AttentionInterface.register("kvc_window_capture", capture)
    model.set_attn_implementation("kvc_window_capture")
    with torch.no_grad():
        model(input_ids=torch.tensor([ids + (question or [])]))
    policy = get_policy("snapkv", PolicyParams(window=window))
    scores = policy.combined_score([views[k] for k in sorted(views)])
    scores[n - window :] = math.inf
    return scores.tolist()
