"""KVzip's reconstruction score and its plan (`sgl_kvc/core/reconstruction.py`) against a float64
rewrite of kvpress 0.5.5 `KVzipPress.score_kvzip`, and the `kvzip` prompt policy's choice."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvc.core.reconstruction import (
    REPEAT_BUDGET,
    CarriedScores,
    PassScores,
    ReconstructionChunk,
    ReconstructionPrompt,
    carry_scores,
    carry_through,
    context_range,
    fold_chunk,
    initial_scores,
    next_repeat,
    plan_question,
    plan_reconstruction,
    question_tokens,
    reconstruction_probs,
)
from sgl_kvc.policies import HeadSelection, LayerView, PolicyParams, get_policy, select_per_head

EPS32 = torch.finfo(torch.float32).eps
# The score is a softmax probability (<= 1) computed in float32 from float32 inputs: a few dozen
# roundings of relative size eps32 each, on terms of size <= 1.
TOL = 64 * EPS32


def reference_scores(q, keys, positions, repeat, chunk, sink, scale, reduce="max", whole_row=False):
    """float64, one head at a time, as kvpress builds it: the softmax over [the first
    min(sink, chunk start) tokens, the chunk's entries, the repeat's keys (causal)], its chunk
    part maximised over the query group and the queries (`reduce="mean"` averages over the group
    instead: a deliberately wrong variant). `whole_row`: the softmax over every entry and the
    repeat's keys, every entry scored."""
    r, h_q, d = q.shape
    h_kv = keys.shape[0]
    g = h_q // h_kv
    out = {}
    for h in range(h_kv):
        pos = positions[h].tolist()
        sinks = [] if whole_row else [j for j, p in enumerate(pos) if p < min(sink, chunk.start)]
        mine = list(range(len(pos))) if whole_row else [j for j, p in enumerate(pos) if chunk.start <= p < chunk.end]
        ks = torch.cat([keys[h, sinks + mine], repeat[h]]).double()  # [m + r, d]
        qs = q[:, h * g : (h + 1) * g].double()  # [r, g, d]
        logits = torch.einsum("rgd,md->grm", qs, ks) * scale
        m = len(sinks) + len(mine)
        for i in range(r):
            logits[:, i, m + i + 1 :] = -math.inf
        probs = logits.softmax(-1)[..., len(sinks) : m]  # [g, r, |mine|]
        per_query = probs.amax(dim=0) if reduce == "max" else probs.mean(dim=0)
        for col, value in zip(mine, per_query.amax(dim=0).tolist()):
            out[(h, col)] = value
    return out


def _case(seed: int, device: torch.device, h_kv: int = 2, group: int = 3, d: int = 16, w: int = 48, r: int = 14):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(r, h_kv * group, d, generator=gen)
    keys = torch.randn(h_kv, w, d, generator=gen) * 1.5
    repeat = torch.randn(h_kv, r, d, generator=gen)
    return q.to(device), keys.to(device), repeat.to(device)


@pytest.mark.parametrize("per_head", [False, True])
def test_score_is_kvpress_max_attention(device: torch.device, per_head: bool) -> None:
    """The largest attention a reconstruction query pays an entry, over its query group, with
    kvpress's softmax (sinks, the chunk, the repeat); per head after a per-head compaction."""
    q, keys, repeat = _case(1, device)
    h_kv, w, _ = keys.shape
    if per_head:  # each head holds its own tokens (a compacted cache): ascending, different
        gen = torch.Generator().manual_seed(7)
        positions = torch.stack([torch.sort(torch.randperm(120, generator=gen)[:w]).values for _ in range(h_kv)])
    else:
        positions = torch.arange(w).expand(h_kv, w)
    positions = positions.to(device)
    valid = torch.ones(h_kv, w, dtype=torch.bool, device=device)
    scale = 1 / math.sqrt(keys.shape[-1])
    scores = initial_scores(positions, valid, 6, 200)
    chunks = [ReconstructionChunk(6, 30, tuple(range(14))), ReconstructionChunk(30, 200, tuple(range(14)))]
    refs, wrong = {}, {}
    cpu = [t.cpu() for t in (q, keys, positions, repeat)]
    for chunk in chunks:
        fold_chunk(scores, q, keys, positions, valid, repeat.clone(), chunk, 4, scale, block_elements=300)
        refs.update(reference_scores(*cpu, chunk, 4, scale))
        wrong.update(reference_scores(*cpu, chunk, 4, scale, reduce="mean"))
    assert scores.device == device
    scores = scores.cpu()
    positions = positions.cpu()
    got = {k: float(scores[k]) for k in refs}
    err = max(abs(got[k] - refs[k]) for k in refs)
    err_wrong = max(abs(got[k] - wrong[k]) for k in refs)
    assert err <= TOL, err
    assert err_wrong > 1000 * TOL  # the test can fail: a mean over the group is far off
    outside = positions < 6  # the system prompt: never scored, always kept
    assert torch.isinf(scores[outside]).all() and torch.isfinite(scores[~outside]).all()


def test_whole_row_scores_every_entry_in_one_softmax(device: torch.device) -> None:
    """A prompt cut between chunks is scored again whole: each chunk's queries take their softmax
    over every entry the request holds (the forward's own attention) and score every one of
    them, the largest over the chunks."""
    q, keys, repeat = _case(3, device)
    h_kv, w, _ = keys.shape
    gen = torch.Generator().manual_seed(11)  # a compacted cache: each head its own tokens
    positions = torch.stack([torch.sort(torch.randperm(120, generator=gen)[:w]).values for _ in range(h_kv)])
    positions = positions.to(device)
    valid = torch.ones(h_kv, w, dtype=torch.bool, device=device)
    scale = 1 / math.sqrt(keys.shape[-1])
    chunks = [ReconstructionChunk(6, 60, tuple(range(14))), ReconstructionChunk(60, 120, tuple(range(14)))]
    cpu = [t.cpu() for t in (q, keys, positions, repeat)]
    scores = initial_scores(positions, valid, 6, 120)
    chunked = initial_scores(positions, valid, 6, 120)
    refs: dict = {}
    for chunk in chunks:
        fold_chunk(scores, q, keys, positions, valid, repeat.clone(), chunk, 4, scale, whole_row=True)
        fold_chunk(chunked, q, keys, positions, valid, repeat.clone(), chunk, 4, scale)
        for k, v in reference_scores(*cpu, chunk, 4, scale, whole_row=True).items():
            refs[k] = max(refs.get(k, 0.0), v)
    scores, chunked, positions = scores.cpu(), chunked.cpu(), positions.cpu()
    context = positions >= 6
    err = max(abs(float(scores[k]) - v) for k, v in refs.items() if context[k])
    assert err <= TOL, err
    assert float((scores - chunked)[context].abs().max()) > 1000 * TOL  # the test can fail: chunk-local differs
    assert torch.isinf(scores[~context]).all()


def _cut_after_every_chunk(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """(first position, end) each pass repeats of a `prompt`-token context cut after every
    `chunk` tokens and read whole at the end."""
    p, ids = _prompt(), list(range(prompt))
    carried, out = None, []
    ends = [*range(chunk, prompt, chunk), prompt]
    for end in ends:
        resume, whole_row = next_repeat(carried, end, prompt, last=end == prompt)
        plan = plan_reconstruction(ids, 0, end, p, chunk=64, resume=resume, whole_row=whole_row,
                                   repeated=carried.repeated if carried else 0)
        assert plan.whole_row == (carried is not None)
        out.append((plan.chunks[0].start, end))
        carried = CarriedScores(end, [], cut=True, repeated=plan.repeated)
    assert carried.repeated == sum(end - start for start, end in out)
    return out


def test_a_cut_prompt_is_repeated_whole_within_a_budget() -> None:
    """After its own cut a prompt scores against every entry it holds and repeats its whole
    context again: always once the prompt is read, between chunks while its repeats stay within
    `REPEAT_BUDGET` times the prompt; then only what was read since. A shared document's hit
    repeats only what follows the document, in kvpress's chunks."""
    assert next_repeat(None, 40, 100, last=False) == (None, False)
    assert next_repeat(CarriedScores(60, []), 90, 100, last=True) == (60, False)  # a document's scores
    # four cuts of a 2K prompt: every pass repeats the whole context read so far
    assert _cut_after_every_chunk(2048, 512) == [(0, 512), (0, 1024), (0, 1536), (0, 2048)]
    # a hundred cuts: whole while the budget allows, then only the new chunks, whole at the end
    passes = _cut_after_every_chunk(100 * 512, 512)
    repeated = sum(end - start for start, end in passes)
    assert repeated <= REPEAT_BUDGET * 100 * 512 and passes[-1][0] == 0
    assert passes[5][0] == 0 and passes[-2][0] > 0


def test_blocks_and_padding_change_nothing(device: torch.device) -> None:
    """Queries in blocks of any size give the same score; padded columns get 0."""
    q, keys, repeat = _case(2, device, r=20)
    valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=device)
    valid[1, -5:] = False
    scale = 0.25
    whole = reconstruction_probs(q, keys, valid, repeat, scale, block_elements=1 << 30)
    small = reconstruction_probs(q, keys, valid, repeat, scale, block_elements=1)
    assert torch.allclose(whole, small, atol=TOL, rtol=0)
    assert (whole[1, -5:] == 0).all() and whole.device == device


def _prompt() -> ReconstructionPrompt:
    return ReconstructionPrompt(system=(1, 2, 3), suffix=(8, 9), first=(50, 51), later=(60, 61, 62))


def test_context_is_between_the_system_prompt_and_the_answer() -> None:
    p = _prompt()
    ids = [1, 2, 3, *range(100, 120), 8, 9]
    assert context_range(ids, len(ids), p, 4, prompt_read=True) == (3, 23)
    assert context_range(ids, len(ids), p, 4, prompt_read=False) == (3, 25)  # between chunks: all read so far
    assert context_range([7, *ids[1:]], len(ids), p, 4, prompt_read=True) == (4, 23)  # no template: sinks


def test_plan_repeats_the_context_in_chunks() -> None:
    """kvpress `prepare`: the first chunk asked to repeat the context, later ones the part starting
    with the previous chunk's last `overlap` tokens; each then the suffix and its own tokens."""
    p = _prompt()
    ids = list(range(1000, 1030))
    plan = plan_reconstruction(ids, 3, 25, p, chunk=10, overlap=2, sink_tokens=4)
    assert [(c.start, c.end) for c in plan.chunks] == [(3, 13), (13, 23), (23, 25)]
    assert plan.chunks[0].ids == (50, 51, 8, 9, *ids[3:13])
    assert plan.chunks[1].ids == (60, 61, 62, 1011, 1012, 8, 9, *ids[13:23])
    assert plan.longest == len(plan.chunks[1].ids) and plan.tokens == sum(len(c.ids) for c in plan.chunks)
    resumed = plan_reconstruction(ids, 3, 25, p, resume=13, chunk=10, overlap=2)
    assert [(c.start, c.end) for c in resumed.chunks] == [(13, 23), (23, 25)]
    assert resumed.chunks[0].ids[:5] == (60, 61, 62, 1011, 1012)
    # a forward never reads more than it may hold: the chunk shrinks
    small = plan_reconstruction(ids, 3, 25, p, chunk=10, overlap=2, max_tokens=12)
    assert small.longest <= 12 and [c.end - c.start for c in small.chunks][0] == 12 - 7
    with pytest.raises(ValueError):
        plan_reconstruction(ids, 3, 25, p, chunk=10, overlap=2, max_tokens=7)


def test_kvzip_keeps_the_best_reconstruction_scores_and_what_it_never_scored(device: torch.device) -> None:
    """Per head: the system prompt (+inf) and the window, then the highest scores."""
    n, h = 20, 2
    gen = torch.Generator().manual_seed(3)
    recon = torch.rand(h, n, generator=gen)
    recon[:, :3] = math.inf
    view = LayerView(keys=torch.randn(n, h, 4, generator=gen).to(device), reconstruction=recon.to(device))
    pol = get_policy("kvzip", PolicyParams(budget=8, window=2))
    sel = select_per_head(pol, [view], 8)
    for head in range(h):
        kept = set(sel.kept(0, head).tolist())
        best = torch.argsort(recon[head, 3:18], descending=True)[:3] + 3
        assert kept == {0, 1, 2, 18, 19, *best.tolist()}
    with pytest.raises(ValueError, match="reconstruction"):
        pol.score(LayerView(keys=torch.randn(n, h, 4, device=device)))


def test_carried_scores_follow_the_kept_columns(device: torch.device) -> None:
    scores = PassScores([torch.arange(12.0, device=device).reshape(2, 6)], end=40)
    sel = HeadSelection(indices=torch.tensor([[[1, 4, HeadSelection.PAD], [0, 2, 5]]], device=device),
                        lengths=torch.tensor([[2, 3]], device=device), n=6)
    carried = carry_scores(scores, sel, per_head_lengths=True)
    assert isinstance(carried, CarriedScores) and carried.end == 40
    assert carried.layers[0][0, :2].tolist() == [1.0, 4.0] and carried.layers[0][1].tolist() == [6.0, 8.0, 11.0]
    assert carried.lengths[0].tolist() == [2, 3]


def test_a_cuts_question_forward_reads_the_prompts_end_never_what_it_has_read() -> None:
    """At a cut between chunks the question's forward reads the prompt's last 64 tokens (or the
    window, if longer), at most the part still unread, after the entries held: no context."""
    assert question_tokens(2000, 512, 8) == 64
    assert question_tokens(2000, 512, 100) == 100
    assert question_tokens(2000, 1980, 8) == 20  # exactly the rest of the prompt
    assert question_tokens(2000, 2000, 8) == 0
    plan = plan_question(list(range(2000)), 512, 64)
    assert [(c.start, c.end, c.ids) for c in plan.chunks] == [(512, 512, tuple(range(1936, 2000)))]
    assert (plan.start, plan.end, plan.repeated, plan.tokens) == (512, 512, 0, 64)
    with pytest.raises(ValueError):
        plan_question(list(range(2000)), 512, 0)


def test_a_documents_scores_are_carried_through_a_decode_pass() -> None:
    """A row that started from a document whose 3 entries carry scores keeps, through a decode
    pass, each kept entry's score where the document covered it, and 0 (a context entry's start,
    scored afresh by the next pass, which repeats from `end`) for one read after it; packed, a
    head's entries are its first `lengths` columns only."""
    scores = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    carried = CarriedScores(end=90, layers=[scores], repeated=7)
    pad = HeadSelection.PAD
    kept = HeadSelection(indices=torch.tensor([[[0, 2, 4], [1, 3, pad]]]), lengths=torch.tensor([[3, 2]]), n=6)
    out = carry_through(carried, kept)
    assert out.end == 90 and out.repeated == 7 and out.lengths is None and not out.cut
    assert torch.equal(out.layers[0], torch.tensor([[1.0, 3.0, 0.0], [5.0, 0.0, 0.0]]))
    packed = CarriedScores(end=90, layers=[scores], lengths=[torch.tensor([1, 3])])
    out = carry_through(packed, kept)  # head 0 holds one document entry: its column 2 is read after it
    assert torch.equal(out.layers[0], torch.tensor([[1.0, 0.0, 0.0], [5.0, 0.0, 0.0]]))
    assert torch.equal(out.lengths[0], torch.tensor([3, 2]))


def test_a_prefill_pass_carries_no_score_for_an_entry_it_did_not_score() -> None:
    """A prefill pass's table also holds its question's entries, past the reconstruction's scored
    columns: kept, they carry 0 (the next pass that covers them scores them), never an error."""
    scores = PassScores(layers=[torch.tensor([[1.0, 2.0], [3.0, 4.0]])], end=40, repeated=40)
    kept = HeadSelection(indices=torch.tensor([[[1, 2], [0, HeadSelection.PAD]]]), lengths=torch.tensor([[2, 1]]), n=3)
    out = carry_scores(scores, kept, per_head_lengths=True)
    assert torch.equal(out.layers[0], torch.tensor([[2.0, 0.0], [3.0, 0.0]])) and out.cut and out.end == 40
