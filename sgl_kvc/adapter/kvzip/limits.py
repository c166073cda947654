"""What one reconstruction forward may read (docs/architecture.md, "Reconstruction passes"): which
requests (`unscorable`), the KV slots its part for a request holds beside the request's own
(`forward_slots` for KVzip's repeat of a chunk of context, `question_slots` for a cut's question,
`reserve_tokens` the larger), and how a round's parts are cut into forwards (`forward_limit`,
`forward_groups`).

Memory: a forward holds, per request, one chunk of the context and its instruction: at most
`forward_slots`, which admission counts in the request's footprint (`sgl_kvc/footprint.py`). A
round's requests are cut into forwards (`forward_groups`) of at most SGLang's tokens per prefill
forward (`forward_limit`: the activations its memory slack is sized for; one forward of every due
request read sum(chunk + instruction) tokens, 32 requests over a cached 16K prefix far past the
chunked-prefill size) and of at most the entries whose keys `adapter/memory/kv_memory.py` reserves
(`forward_entries`: per layer, a CPU forward hands its fold every row's gathered keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sgl_kvc.adapter.kvc_req import resolved
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import question_tokens
from sgl_kvc.policies import policy_class
from sgl_kvc.request_settings import ResolvedCompression

# Tokens of one reconstruction forward besides its chunk of the context: its instruction, the
# previous chunk's quoted tokens and the template's opening of an answer (SmolLM2: 30). A forward
# never reads more than `reserve_tokens`: a template whose text is longer shrinks the chunk.
RESERVE_HEAD = 64


def forward_slots(config: KvcConfig, settings: ResolvedCompression, prompt: int) -> int:
    """KV slots a reconstruction forward of a request with these settings and a prompt of
    `prompt` tokens holds at most beside its own (0 when its prompt policy reads none): one
    `--kvzip-chunk` of its context and its instruction. Admission counts them in the request's
    footprint (`sgl_kvc/footprint.py`); a request whose pool can never hold them with it is
    refused at once (`admission.around_max_new_tokens`)."""
    if not (settings.compressing and policy_class(settings.prompt_policy_name).uses_reconstruction):
        return 0
    return min(prompt, config.kvzip_chunk) + RESERVE_HEAD


def question_slots(config: KvcConfig, settings: ResolvedCompression, prompt: int) -> int:
    """KV slots the forward of a prompt's question holds at a cut between its chunks beside the
    request's own (`core/reconstruction.question_tokens`: its last `QUESTION_TOKENS`, at least
    `--kv-window`), for a prompt policy that scores from its observation window with
    `--kv-chunk-window question` (else 0)."""
    if not (settings.compressing and config.kv_chunk_window == "question"
            and policy_class(settings.prompt_policy_name).reads_window):
        return 0
    return question_tokens(prompt, 0, config.kv_window)


def reserve_tokens(config: KvcConfig, req: Any) -> int:
    """The most slots a forward of one of SGLang's requests holds: its reconstruction forward's
    (`forward_slots`) or its question's (`question_slots`); a prompt policy reads one of them."""
    settings, prompt = resolved(req, config), len(req.origin_input_ids)
    return max(forward_slots(config, settings, prompt), question_slots(config, settings, prompt))


def unscorable(req: Any) -> str | None:
    """Why a reconstruction cannot score `req` (one of SGLang's requests), or None. A multimodal
    prompt holds the processor's pad values where its images or audio go (the encoder's
    embeddings replace them in a prefill): repeated as text, they reach the embedding as token
    ids outside the vocabulary (an IndexError on a CPU, a device-side assert that ends the process
    on CUDA). Admission refuses such a request first (`request_settings.multimodal_conflict`)."""
    if getattr(req, "multimodal_inputs", None) is not None:
        return "a multimodal prompt cannot be repeated as text (KVzip's reconstruction)"
    return None


def forward_limit(scheduler: Any) -> int | None:
    """The most tokens SGLang reads in one prefill forward: its chunk (`--chunked-prefill-size`)
    and its cap on a prefill round (`--max-prefill-tokens`), the smaller; None where it has
    neither. Its memory slack holds the activations of such a forward, not of a larger one."""
    limits = [int(v) for v in (getattr(scheduler, "chunked_prefill_size", None),
                               getattr(scheduler, "max_prefill_tokens", None))
              if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(limits) if limits else None


def forward_groups(sizes: Sequence[tuple[int, int]], max_tokens: int, max_entries: int) -> list[list[int]]:
    """The parts of one round ((tokens read, entries attended) of each request's chunk, in the
    round's order) cut, in that order, into forwards of at most `max_tokens` tokens and
    `max_entries` entries. A part over either bound alone is a forward of its own (its plan keeps
    its tokens within `max_tokens`; one row's keys are one request's transient work). Every
    tensor-parallel rank cuts the same sizes alike: they come from host data the ranks share."""
    groups: list[list[int]] = []
    tokens = entries = 0
    for j, (t, e) in enumerate(sizes):
        if groups and tokens + t <= max_tokens and entries + e <= max_entries:
            groups[-1].append(j)
            tokens, entries = tokens + t, entries + e
        else:
            groups.append([j])
            tokens, entries = t, e
    return groups
