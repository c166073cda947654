"""KVzip's context reconstruction (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression
with Context Reconstruction", §3.2-3.3; kvpress 0.5.5 `KVzipPress` is the reference implementation):
what a request's reconstruction pass reads, and the score its queries give the cached entries.

A request's prompt is its system prompt (the chat template's text before the user's message), its
context, and (once the whole prompt is read) the template's text that opens the answer. The model
is asked to repeat the context, teacher-forced: after the cached prompt it reads "Repeat the
previous context exactly." (§3.2, Fig. 3), the template's opening of an answer, and the context's
own tokens. The context is repeated in chunks (§3.3; kvpress and the authors: 2048 tokens), each
asked after the cache alone, so the extra memory of a pass is one chunk; a chunk after the first
is asked to repeat "the part of the previous context ... starting with" the previous chunk's last
tokens (kvpress: 8).

Score (§3.2, eq. 2 and its GQA form): an entry's importance is the largest attention any query of
the reconstruction pays it, maximised over the query heads of its KV group and over the queries.
The softmax is the one kvpress computes: over the attention sinks (the first `sink` tokens), the
chunk's own entries and the reconstruction's keys up to the query (causal); the other chunks'
entries are left out of it. What a pass never scores is always kept: the system prompt (the
authors keep it; kvpress keeps its first `sink` tokens) and whatever follows the context.

A prompt cut between its chunks is scored against every entry it still holds (`ReconstructionPlan.
whole_row`): each query's softmax covers them all, as the forward's own attention does, and each
pass repeats its whole context read so far while the request's repeats stay within a few times
its prompt (`next_repeat`). Chunk by chunk, a chunk whose entries an earlier cut thinned would see
a smaller softmax than a whole one, and its survivors' scores would not compare with a fresh
chunk's; scores from a much shorter context do not compare either (in 512 tokens the filler is
rarer and scores higher: research/kvzip-uniform-diagnosis.md).

Everything here is plain torch on one layer of one request, in float32; the adapter feeds it the
reconstruction's queries and keys while SGLang runs the pass.

The same forwards serve one more reading (`plan_question`): a prompt cut between its chunks before
its question is read is scored by SnapKV's observation window (and R-KV's, KV-Compress's, Expected
Attention's), which would otherwise be the last queries of a chunk of the context, not those of the
question the whole-prompt pass reads. The prompt's last `QUESTION_TOKENS` tokens (its question and
the template's opening of an answer, known when it is admitted; at most what is still unread) are
read once after the entries the request holds, and the last `window` of their queries, which have
read the whole question as after the last chunk, become the cut's window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgl_kvc.core.request_state import ReqKvState
from sgl_kvc.kernels.attention_lse import attention_lse
from sgl_kvc.policies import HeadSelection

# The most a request's reconstructions repeat in all, in times its prompt: a prompt cut c times
# between chunks and repeated whole at each would repeat about c/2 times it (a prompt read whole
# repeats it once).
REPEAT_BUDGET = 4
CHUNK = 2048  # context tokens repeated per reconstruction forward (kvpress `prepare`'s chunk_size)
OVERLAP = 8  # previous chunk's last tokens quoted in the next chunk's instruction (kvpress prev_postfix_size)
# Tokens of a prompt's end a cut's question forward reads (`plan_question`): a chat question and the
# template's opening of an answer, so that the window's queries (the last --kv-window) have read the
# question, as they have after the prompt's last chunk. Not a paper setting.
QUESTION_TOKENS = 64
# Elements of one block of the score's logits (query heads x queries x keys): a bounded transient
# (32 MB of float32), large enough that a block is a few big matrix products
BLOCK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids the reconstruction is asked with, from the served model's tokenizer and chat
    template (kvpress `KVzipPress.__call__` and `prepare` build the same)."""

    system: tuple[int, ...]  # the template's text before a user's message: the system prompt
    suffix: tuple[int, ...]  # the template's text after a user's message, up to the answer
    first: tuple[int, ...]  # "\n\nRepeat the previous context exactly."
    later: tuple[int, ...]  # "\n\nRepeat the part of the previous context exactly, starting with"

    def __post_init__(self) -> None:
        if not self.first or not self.later:
            raise ValueError("a reconstruction needs the ids of its instructions")


@dataclass(frozen=True)
class ReconstructionChunk:
    """One forward of a reconstruction: it repeats the context's logical positions [start, end)."""

    start: int
    end: int
    ids: tuple[int, ...]  # what it reads after the cache: instruction, suffix, context[start:end]


@dataclass(frozen=True)
class ReconstructionPlan:
    """A request's reconstruction: its context [start, end) (logical positions), the chunks that
    repeat it, and the sinks of their softmax: the first `sink` tokens, those before a chunk.
    `whole_row`: each chunk's softmax covers, and its queries score, every entry the request holds.
    `repeated`: context tokens the request's reconstructions repeat, this one's included."""

    start: int
    end: int
    chunks: tuple[ReconstructionChunk, ...]
    sink: int
    whole_row: bool = False
    repeated: int = 0

    @property
    def tokens(self) -> int:
        """Tokens the reconstruction reads in all."""
        return sum(len(c.ids) for c in self.chunks)

    @property
    def longest(self) -> int:
        """Tokens of its longest forward: the slots it holds at once."""
        return max((len(c.ids) for c in self.chunks), default=0)


def context_range(
    token_ids: Sequence[int], length: int, prompt: ReconstructionPrompt, sink_tokens: int, prompt_read: bool
) -> tuple[int, int]:
    """[start, end): the logical positions of a request's context among its first `length`
    tokens. It starts after the system prompt when the request begins with the template's (else
    after kvpress's sinks) and, once the whole prompt is read (`prompt_read`), ends before the
    template's opening of the answer when the prompt ends with it."""
    ids = list(token_ids[:length])
    system = list(prompt.system)
    start = len(system) if system and ids[: len(system)] == system else min(sink_tokens, length)
    end = length
    suffix = list(prompt.suffix)
    if prompt_read and suffix and len(ids) - len(suffix) >= start and ids[len(ids) - len(suffix):] == suffix:
        end = length - len(suffix)
    return start, max(start, end)


def instruction_tokens(prompt: ReconstructionPrompt, overlap: int = OVERLAP) -> int:
    """The most tokens a reconstruction forward reads besides its context: its instruction (a
    later chunk's quotes `overlap` tokens) and the template's opening of an answer."""
    return max(len(prompt.first), len(prompt.later) + overlap) + len(prompt.suffix)


def plan_reconstruction(
    token_ids: Sequence[int], start: int, end: int, prompt: ReconstructionPrompt, *, resume: int | None = None,
    chunk: int = CHUNK, overlap: int = OVERLAP, sink_tokens: int = 4, max_tokens: int | None = None,
    whole_row: bool = False, repeated: int = 0,
) -> ReconstructionPlan:
    """The chunks that repeat context [start, end) of `token_ids` (kvpress `prepare`: chunks of
    `chunk` tokens; a later chunk's instruction quotes the previous chunk's last `overlap`).
    `resume`: the context before it was repeated by an earlier pass (a prompt read in chunks,
    compressed between them), whose scores its entries carry: only [resume, end) is repeated now.
    `max_tokens`: most tokens one forward may read (the memory reserved for it, the room left in
    the request's row); the chunk shrinks to fit. `whole_row`: every chunk scores against all the
    entries the request holds (a prompt cut between chunks); `repeated`: context tokens its
    earlier reconstructions repeated."""
    if chunk < 1 or overlap < 0:
        raise ValueError(f"chunk must be >= 1 and overlap >= 0, got {chunk}, {overlap}")
    head = instruction_tokens(prompt, overlap)
    if max_tokens is not None:
        if max_tokens <= head:
            raise ValueError(f"a reconstruction forward needs more than {head} tokens of room, has {max_tokens}")
        chunk = min(chunk, max_tokens - head)
    chunks = []
    for cs in range(max(start, resume or start), end, chunk):
        ce = min(cs + chunk, end)
        ask = prompt.first if cs == start else (*prompt.later, *token_ids[max(start, cs - overlap) : cs])
        chunks.append(ReconstructionChunk(cs, ce, (*ask, *prompt.suffix, *token_ids[cs:ce])))
    repeated += sum(c.end - c.start for c in chunks)
    return ReconstructionPlan(start, end, tuple(chunks), sink_tokens, whole_row, repeated)


def question_tokens(prompt: int, read: int, window: int) -> int:
    """Tokens a cut's question forward reads of a `prompt`-token prompt read up to `read`: its last
    `QUESTION_TOKENS` (at least `window`), never more than is still unread. Where the rest of the
    prompt is that short, the forward reads exactly it, at its own positions."""
    return max(0, min(max(QUESTION_TOKENS, window), prompt - read))


def plan_question(token_ids: Sequence[int], end: int, tokens: int) -> ReconstructionPlan:
    """The forward that reads a prompt's last `tokens` tokens (its question, and the template's
    opening of an answer) after its first `end` logical positions, for a pass that cuts the prompt
    there to take the last of their queries as its observation window: SnapKV's window is "the
    last w prompt queries" (KV-Compress §2 and eq. 7), where the question is. It repeats no
    context: [end, end)."""
    if tokens < 1:
        raise ValueError(f"a question's forward reads at least one token, got {tokens}")
    ids = tuple(token_ids[-tokens:])
    return ReconstructionPlan(end, end, (ReconstructionChunk(end, end, ids),), 0)


def next_repeat(carried: CarriedScores | None, end: int, prompt: int, last: bool) -> tuple[int | None, bool]:
    """How a pass over a context read up to `end` of a `prompt`-token prompt repeats it, from what
    earlier passes carried: (resume, whole_row) for `plan_reconstruction`. Nothing carried: the
    whole context in kvpress's chunks. A shared document's scores: only the context after it.

    The request's own cut between chunks: every entry it holds in each softmax, and its whole
    context repeated again: always once the prompt is read (`last`: the pass that chooses what its
    answer sees), between chunks while its repeats so far and this one leave room in
    `REPEAT_BUDGET` for a repeat of every later chunk and the last pass's; else only what was read
    since (the survivors keep their scores, raised where the new queries pay them more). Scores
    carried from a softmax without the new entries run high: resuming lost a key that repeating
    kept (research/kvzip-uniform-diagnosis.md)."""
    if carried is None:
        return None, False
    if not carried.cut:
        return carried.end, False
    if last or carried.repeated + end <= (REPEAT_BUDGET - 2) * prompt:
        return None, True
    return carried.end, True


def initial_scores(positions: Tensor, valid: Tensor, start: int, end: int) -> Tensor:
    """Float32 [H_kv, W] scores before any chunk: 0 for the context's entries (positions in
    [start, end)), +inf (always kept) for the others: the system prompt, what follows the context,
    and padding columns (`valid` False)."""
    context = valid & (positions >= start) & (positions < end)
    out = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    return out.masked_fill_(~context, math.inf)


def reconstruction_probs(
    queries: Tensor, keys: Tensor, valid: Tensor, repeat_keys: Tensor, scale: float,
    block_elements: int = BLOCK_ELEMENTS, lse: Tensor | None = None,
) -> Tensor:
    """The largest softmax probability each of `keys` gets from any query of its KV group.

    queries [r, H_q, d]: the reconstruction's queries (after RoPE), query j at the j-th repeat
    token; keys [H_kv, M, d] with `valid` [H_kv, M]: each KV head's entries in the softmax (the
    sinks and the chunk's entries); repeat_keys [H_kv, r, d]: the reconstruction's own keys, which
    query j sees up to j (causal). Query head h reads KV head h // G (G = H_q / H_kv). Returns
    float32 [H_kv, M] (0 at invalid columns). Queries are taken in blocks of at most
    `block_elements` logits, so its transient memory is bounded whatever the chunk. `lse`
    [H_kv, G, r]: each query's log-sum-exp over those keys, where the caller has it (the forward's
    own attention, `kernels/extend_attention.scored_extend_attention`); else computed here."""
    r, h_q, d = queries.shape
    h_kv, m, _ = keys.shape
    if h_q % h_kv:
        raise ValueError(f"H_q={h_q} is not a multiple of H_kv={h_kv}")
    group = h_q // h_kv
    q = queries.float().reshape(r, h_kv, group, d).permute(1, 2, 0, 3)  # [H_kv, G, r, d]
    # Each query's softmax normalizer first (`kernels/attention_lse.py`), then, for the log of
    # the largest probability per key, one matrix product of the queries widened by it with the
    # keys widened by a 1: scale * q.k - lse, maxed over the group and the queries, one exp at
    # the end; no probability tensor is ever formed.
    if lse is None:
        lse = attention_lse(q, keys, valid, repeat_keys, scale, block_elements)  # [H_kv, G, r]
    qa = torch.cat([q * scale, -lse[..., None]], dim=-1).reshape(h_kv, group * r, d + 1)
    ones = torch.ones(h_kv, m, 1, dtype=torch.float32, device=keys.device)
    ka = torch.cat([keys.float(), ones], dim=-1).transpose(1, 2)  # [H_kv, d + 1, M]
    best = torch.full((h_kv, m), -math.inf, dtype=torch.float32, device=keys.device)
    block = max(1, block_elements // max(1, h_kv * m))
    for b0 in range(0, group * r, block):
        best = torch.maximum(best, torch.bmm(qa[:, b0 : b0 + block], ka).amax(dim=1))
    out = best.exp_()
    return out.masked_fill_(~valid, 0.0)


def scored_entries(positions: Tensor, valid: Tensor, chunk: ReconstructionChunk, sink: int,
                   whole_row: bool = False) -> tuple[Tensor, Tensor]:
    """[H_kv, W'] masks of the cached entries in a chunk's score softmax: its sinks (the first
    `sink` tokens before the chunk; kvpress: keys[:, :, :min(n_sink, start_idx)]) and those it
    scores: its own, or with `whole_row` every valid entry (no sinks apart)."""
    if whole_row:
        return torch.zeros_like(valid), valid.clone()
    sinks = valid & (positions < min(sink, chunk.start))
    mine = valid & (positions >= chunk.start) & (positions < chunk.end)
    return sinks, mine


def fold_chunk(
    scores: Tensor, queries: Tensor, keys: Tensor, positions: Tensor, valid: Tensor, repeat_keys: Tensor,
    chunk: ReconstructionChunk, sink: int, scale: float, block_elements: int = BLOCK_ELEMENTS,
    lse: Tensor | None = None, whole_row: bool = False,
) -> None:
    """Fold one reconstruction forward's queries into a layer's `scores` [H_kv, W] (in place).

    keys [H_kv, W', d], positions [H_kv, W'] (logical), valid [H_kv, W'] (W' <= W): each KV head's
    cached entries the reconstruction attends to, in the scores' column order; repeat_keys
    [H_kv, r, d]: the chunk's own. Each head's softmax covers its sinks and the entries of the
    chunk (per head: after a per-head compaction heads hold different tokens); the chunk's entries
    take the largest probability any query pays them (they belong to this chunk alone). `sink`:
    the first tokens in every chunk's softmax (those before the chunk). `lse`: the softmax's
    log-sum-exp per query, where the forward computed it (`reconstruction_probs`). `whole_row`:
    the softmax covers, and the queries score, every valid entry (`scored_entries`)."""
    h_kv, w_cached = positions.shape
    sinks, mine = scored_entries(positions, valid, chunk, sink, whole_row)
    subset = sinks | mine
    counts = subset.sum(dim=-1)  # [H_kv]
    width = int(counts.max()) if counts.numel() else 0  # one host read per layer and chunk
    if width == 0:
        return
    # each head's subset first, in column order (a stable sort of the mask)
    order = torch.argsort((~subset).to(torch.int8), dim=-1, stable=True)[:, :width]  # [H_kv, M]
    live = torch.arange(width, device=keys.device)[None, :] < counts[:, None]
    sub_keys = keys.gather(1, order[..., None].expand(h_kv, width, keys.shape[-1]))
    probs = reconstruction_probs(queries, sub_keys, live, repeat_keys, scale, block_elements, lse)
    write = live & mine.gather(1, order)
    scores[:, :w_cached].scatter_reduce_(1, order, torch.where(write, probs, 0.0), "amax", include_self=True)


@dataclass
class RowReconstruction:
    """One request's part of a reconstruction forward: the chunk its row reads after its first
    `prefix` entries (the forward's keys are written past them), the sinks, and the scores, one
    [H_kv, W] per layer of the rank, its queries fold into. `owner`: the caller's request;
    `whole_row`: its plan's (`ReconstructionPlan`)."""

    state: ReqKvState
    scores: list[Tensor]
    chunk: ReconstructionChunk
    sink: int
    prefix: int
    owner: Any = None
    whole_row: bool = False
    question: bool = False  # a question's forward (`plan_question`): its queries are the window, no scores


@dataclass(frozen=True)
class ForwardAttention:
    """What a reconstruction row's forward attention hands its layer's fold: the row's keys it
    gathered ([p + r, H_kv, d], its prefix then the chunk's) and each query's log-sum-exp over the
    chunk's score softmax ([H_kv, G, r], float32)."""

    keys: Tensor
    lse: Tensor


@dataclass
class ReconstructionRound:
    """The requests of one reconstruction forward, by row. While it runs the attention observer
    folds each layer's queries of these rows into their scores (`fold`) and records nothing else
    (no window queries, statistics or query moments: the pass is not the request's text); a
    question's forward (`RowReconstruction.question`) records its queries as the row's window."""

    rows: dict[int, RowReconstruction]
    score_seconds: float = 0.0  # the caller's count of the time its folds took
    forward_normalizers: int = 0  # folds (row x layer) whose normalizer the forward computed
    # (row, layer): what the forward's own attention leaves the fold (`scored_columns`), until
    # that layer's fold takes it
    given: dict[tuple[int, int], ForwardAttention] = field(default_factory=dict)

    def scored_columns(self, store: Any, layer: int, row: int) -> Tensor | None:
        """The columns of `row`'s cached entries in its chunk's score softmax in layer `layer`
        (`scored_entries`), for its forward to compute that softmax's normalizer
        (`scored_extend_attention`): where the row is read as it is (no per-head tables) and the
        columns are the same for every KV head; else None (its fold computes the normalizer)."""
        entry = self.rows.get(row)
        if entry is None or entry.question or row in store.extend_tables:
            return None
        positions = entry.state.positions(entry.prefix)
        if positions.dim() > 1:
            positions = positions[layer - store.first_layer]
            if not bool((positions == positions[:1]).all()):
                return None
            positions = positions[0]
        sinks, mine = scored_entries(positions, torch.ones_like(positions, dtype=torch.bool), entry.chunk, entry.sink,
                                     entry.whole_row)
        columns = (sinks | mine).nonzero()[:, 0]
        return columns if columns.numel() else None

    def fold(self, store: Any, layer: int, row: int, queries: Tensor, scale: float) -> None:
        """Layer `layer`'s queries [r, H_q, d] of `row`'s chunk into its scores. The row's keys
        are read from `store`'s pool: through its row (its first `prefix` entries at their logical
        positions, then the chunk's), or, packed on the unit pool, through the per-head tables
        the extend was given (`KvcStore.extend_tables`: each head's entries, then the chunk's)."""
        entry = self.rows[row]
        r = len(entry.chunk.ids)
        local = layer - store.first_layer
        tables = store.extend_tables.get(row)
        given = self.given.pop((row, layer), None)
        if tables is None:
            if given is None:
                slots = store.req_to_token[row, : entry.prefix + r].long()
                keys = store.kv_pool.get_key_buffer(layer)[slots].transpose(0, 1)  # [H_kv, p + r, d]
            else:  # the keys the forward gathered from the same pool
                keys = given.keys.transpose(0, 1)
            h_kv = keys.shape[0]
            positions = entry.state.positions(entry.prefix)
            positions = positions[local] if positions.dim() > 1 else positions.expand(h_kv, entry.prefix)
            prefix_keys, repeat_keys = keys[:, : entry.prefix], keys[:, entry.prefix :]
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        else:
            k_units, _ = store.unit_pools
            units, lens, kept = tables.layer(local)
            keys = k_units[units]  # [H_kv, W', d]
            own = lens - r  # each head's entries before the chunk's
            width = int(own.max())
            cols = torch.arange(keys.shape[1], device=keys.device)
            at = (own[:, None] + torch.arange(r, device=keys.device)).clamp(max=keys.shape[1] - 1)
            repeat_keys = keys.gather(1, at[..., None].expand(-1, -1, keys.shape[-1]))
            prefix_keys, positions = keys[:, :width], kept[:, :width]
            valid = (cols[None, :width] < own[:, None])
        self.forward_normalizers += given is not None
        fold_chunk(entry.scores[local], queries, prefix_keys, positions, valid, repeat_keys, entry.chunk,
                   entry.sink, scale, lse=None if given is None else given.lse, whole_row=entry.whole_row)


@dataclass
class PassScores:
    """A reconstruction's scores for the pass that follows it: one float32 [H_kv, W] per layer of
    the rank, in that pass's columns, the logical end of the context they cover, and the context
    tokens the request's reconstructions have repeated (`ReconstructionPlan.repeated`)."""

    layers: list[Tensor]
    end: int
    repeated: int = 0

    def tensors(self) -> list[Tensor]:
        return list(self.layers)


@dataclass
class CarriedScores:
    """What a compaction between chunks kept of its scores: per layer [H_kv, k] for each head's
    kept entries in their new column order (the first `lengths[layer][h]` of head h on the unit
    pool; every column otherwise), and the end of the context they cover. A request that starts
    from a shared document carries the document's: its next prompt pass repeats only the context
    after `end`. `cut`: carried by the request's own cut, whose next pass scores against every
    entry it holds (`next_repeat`); `repeated`: the context tokens its passes have repeated."""

    end: int
    layers: list[Tensor]
    lengths: list[Tensor] | None = None
    cut: bool = False
    repeated: int = 0

    def tensors(self) -> list[Tensor]:
        return [*self.layers, *(self.lengths or [])]


def carry_through(carried: CarriedScores, selection: HeadSelection) -> CarriedScores:
    """What `carried` (a shared document's scores, its entries the row's first columns) gives the
    entries a later pass of the request keeps (its decode passes: `selection`'s columns index the
    row's): a kept entry it covers keeps its score, one read after it (past `end`, which the next
    prompt pass over this row repeats and scores afresh) gets 0, as any context entry starts."""
    layers, lengths = [], []
    for layer, s in enumerate(carried.layers):
        covered = None if carried.lengths is None else carried.lengths[layer]
        layers.append(_kept_scores(s, selection.indices[layer], covered))
        lengths.append(selection.lengths[layer].to(s.device))
    return CarriedScores(carried.end, layers, lengths if carried.lengths is not None else None, cut=carried.cut,
                         repeated=carried.repeated)


def _kept_scores(scores: Tensor, indices: Tensor, covered: Tensor | None = None) -> Tensor:
    """[H_kv, k]: the scores [H_kv, W] of the kept columns `indices` [H_kv, k]; 0 for a padding
    column, or one past the scored ones (W, or each head's `covered`): an entry the pass did not
    score (read after its context), which the next pass that covers it scores afresh."""
    idx = indices.to(scores.device)
    width = int(scores.shape[-1])
    if not width:
        return torch.zeros(idx.shape, dtype=torch.float32, device=scores.device)
    limit = width if covered is None else covered.to(scores.device)[:, None]
    picked = scores.gather(1, idx.clamp(min=0, max=width - 1))
    return torch.where((idx >= 0) & (idx < limit), picked, 0.0).to(torch.float32)


def carry_scores(scores: PassScores, selection: HeadSelection, per_head_lengths: bool) -> CarriedScores:
    """The scores of the entries `selection` keeps (its columns index the scores' columns; one
    past them, as the question a prefill pass also holds, gets 0), for the request compacted to it
    at a prompt moment; `per_head_lengths`: heads keep different numbers (unit pool)."""
    layers, lengths = [], []
    for layer, s in enumerate(scores.layers):
        layers.append(_kept_scores(s, selection.indices[layer]))
        lengths.append(selection.lengths[layer].to(s.device))
    return CarriedScores(scores.end, layers, lengths if per_head_lengths else None, cut=True,
                         repeated=scores.repeated)
