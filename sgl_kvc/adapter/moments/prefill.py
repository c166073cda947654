"""The moments after an extend: the prefill moment of a request whose prompt is read, and the
chunk moment of one between two chunks of its prompt (Batch-Max's prefill-time eviction,
Algorithm 1; `compressor.py` describes both). Before their passes choose, the reconstruction
pass of those whose prompt policy reads one (KVzip) and the question's forward of the cuts that
read their question first (`reconstruct`); after them, the shared documents published from the
rows cut at their end (`cut_rows.publish_cut_rows`) and the extensions the requests go on
from (`extensions.adopt`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sgl_kvc.adapter import documents, kvc_req
from sgl_kvc.adapter.documents import cut_rows, document_pass, extensions
from sgl_kvc.adapter.kvc_req import resolved
from sgl_kvc.adapter.kvzip.limits import question_slots, unscorable
from sgl_kvc.adapter.moments.commit import CHUNK_SKIPPED, flush, settle
from sgl_kvc.adapter.moments.compaction import CompactionSkipped
from sgl_kvc.adapter.moments.scoring import put_off, room, room_for, run_passes
from sgl_kvc.adapter.safety.failures import failure
from sgl_kvc.adapter.scheduling.admission import chunk_need
from sgl_kvc.adapter.scheduling.chunk_pressure import needs_compression
from sgl_kvc.adapter.scheduling.requests import chunk_compressible, insert_exact_prefix, is_middle_chunk
from sgl_kvc.core.reconstruction import question_tokens
from sgl_kvc.core.request_state import ReqKvState

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch

    from sgl_kvc.adapter.moments.host import Host


@dataclass
class _PrefillMoments:
    """What one extend's moments are due: passes between chunks and after prefill ((index in the
    batch, state, target)), the requests whose prompt is read, the documents whose end a chunk
    reached (index -> key; `passes_before`: the passes before the cut of those cut there), and the
    cuts whose window is their question's (indices, and the slots their forwards hold:
    `cut_question_slots`)."""

    chunks: list[tuple[int, ReqKvState, int]] = field(default_factory=list)
    starts: list[tuple[int, ReqKvState, int]] = field(default_factory=list)
    read: list[ReqKvState] = field(default_factory=list)
    ends: dict[int, Any] = field(default_factory=dict)
    passes_before: dict[int, int] = field(default_factory=dict)
    questions: list[int] = field(default_factory=list)
    question_slots: int = 0  # the slots their forwards hold at once, at most


def before_prefill_result(comp: Host, batch: ScheduleBatch) -> None:
    """After an extend's forward, before SGLang processes its result: the shared documents of
    the requests whose prompt it finished reading are published from their exact entries. Here,
    not after: SGLang releases a request that finishes at its first token (`max_tokens` 1, an
    EOS at once, the `n` > 1 prefix warm-up of `max_new_tokens` 0) while it processes the
    result, and its row with it, so it could no longer publish. Decided from what every
    tensor-parallel rank holds alike (`document_pass.to_publish`)."""
    comp.step_seconds = 0.0
    read_at = [i for i, req in enumerate(batch.reqs) if not is_middle_chunk(batch, req)]
    document_pass.publish_copies(comp, batch, document_pass.to_publish(comp, batch, read_at))
    # and the extensions of resident documents read by now, before any pass of their rows
    extensions.publish(comp, batch, extensions.due(comp, batch))


def after_prefill(comp: Host, batch: ScheduleBatch) -> None:
    """After an extend, each request's moment: the chunk moment for a request between two
    chunks of its prompt (`chunk_moment`), the prefill moment for one whose prompt is read
    (`prefill_moment`; its document was published before SGLang processed the extend's
    result, `before_prefill_result`). Their passes run together, then the documents whose
    end a chunk reached are published from the rows cut there."""
    # requests whose chunk ended at their document's end: all of them, found alike on every
    # rank (one whose state failed here is still listed, for the ranks' vote on publishing); and
    # those whose chunk ended at the end of the extension they published: they go on from it,
    # not cut here (`extensions.adopt`)
    due, adopting = _PrefillMoments(), {}
    for i, req in enumerate(batch.reqs):
        plan = documents.plan_of(req)
        key = plan.ended_at(documents.chunk_end(req)) if plan.cut_by_key and is_middle_chunk(batch, req) else None
        if key is not None:
            (adopting if plan.adopts else due.ends)[i] = key
    for i, req in enumerate(batch.reqs):
        state = comp.state(req)
        if req.finished() or state is None or state.policy.name == "none" or i in adopting:
            continue
        n = int(batch.seq_lens_cpu[i])
        if is_middle_chunk(batch, req):
            chunk_moment(comp, batch, i, req, state, n, due)
        else:
            prefill_moment(comp, batch, i, state, n, due)
    reconstruct(comp, batch, due.chunks, due.starts, due.questions)
    chunks = [c for c in due.chunks if failure(batch.reqs[c[0]]) is None]
    starts = [s for s in due.starts if failure(batch.reqs[s[0]]) is None]
    run_passes(comp, batch, [], chunks, "chunk", whole=True)
    run_passes(comp, batch, [], starts, "prefill")
    for state in due.read:
        # Its prompt is read: the prompt's query moments served this moment's pass (a staged
        # one took them when it began) and serve no later one.
        state.query_moments = None
    flush(comp, batch)
    cut_rows.publish_cut_rows(comp, batch, list(due.ends.items()), due.passes_before)
    extensions.adopt(comp, batch, list(adopting.items()))
    settle(comp, batch)


def chunk_moment(comp: Host, batch: ScheduleBatch, i: int, req: Req, state: ReqKvState, n: int,
                 due: _PrefillMoments) -> None:
    """Request i, between two chunks of its prompt (`n` entries in its row): the cut it is due,
    if any, never staged (the next chunk extends what the pass leaves). At its document's end,
    to the document's k entries (published after the pass); inside its document, where the
    document's key says; elsewhere, to its chunk target when its next chunk needs the room."""
    key = due.ends.get(i)
    if key is not None:
        if n > key.entries and room_for(batch, i, key.entries):
            # Its document is read, its question not: the row is cut to the document's k
            # entries, to be published (`cut_rows.publish_cut_rows`).
            due.chunks.append((i, state, key.entries))
            due.passes_before[i] = state.passes
            return
    plan = documents.plan_of(req)
    inside = plan.cut_inside(documents.chunk_end(req)) if plan.cut_by_key else None
    if inside is not None:
        # Inside its document the row is cut only where the document's key says (at fixed
        # chunk boundaries, to fixed sizes), whatever the pool's pressure or this request's own
        # budget: what the document keeps is then the same whoever publishes it (`cut_at`).
        if inside and n > inside and comp.failures.guarded(
            req, "compress", chunk_due, comp, batch, req, state, n, inside, True
        ):
            due.chunks.append((i, state, inside))
            kvc_req.of(req).cuts += 1
        return
    keep = comp.config.chunk_target(state.effective_budget(n))
    if n > keep and chunk_compressible(req, comp.config) and comp.failures.guarded(
        req, "compress", chunk_due, comp, batch, req, state, n, keep
    ):
        due.chunks.append((i, state, keep))
        slots = comp.failures.guarded(req, "compress", cut_question_slots, comp, req, state, n)
        if slots and room(batch) >= due.question_slots + slots:
            due.questions.append(i)
            due.question_slots += slots


def cut_question_slots(comp: Host, req: Req, state: ReqKvState, n: int) -> int:
    """The slots the forward of `req`'s question holds if its cut between chunks reads it
    first (`--kv-chunk-window question`: its prompt policy, the chunk moment's, scores from its
    observation window, and its prompt is text), else 0. Admission reserved them with the
    cut's copies (`Sizes.question`); where they are not free, the chunk's own window chooses.
    Never at a document's cuts: a shared document keeps what its key says, whatever the question.
    Nor where nothing of the prompt is left to read after the row's `n` entries (a retracted
    request read again in chunks past its prompt) or the row has no room for one token more:
    the chunk's own window chooses there too."""
    if unscorable(req) is not None or getattr(req, "input_embeds", None) is not None:
        return 0
    unread = question_tokens(len(req.origin_input_ids), state.logical_len(n), comp.config.kv_window)
    if min(unread, int(comp.store.req_to_token.shape[1]) - n) < 1:
        return 0
    return question_slots(comp.config, resolved(req, comp.config), len(req.origin_input_ids))


def prefill_moment(comp: Host, batch: ScheduleBatch, i: int, state: ReqKvState, n: int,
                   due: _PrefillMoments) -> None:
    """Request i, its prompt read (`n` entries): the pass after prefill, where it is on and
    the request is over its target, or put off when its compaction finds no room now."""
    due.read.append(state)
    if "prefill" not in comp.config.compress_on:
        return
    target = prefill_target(comp, state, n, state.effective_budget(n))
    if target is not None and target < n:
        if room_for(batch, i, target):
            due.starts.append((i, state, target))
        else:
            put_off(comp, state, n)


def prefill_target(comp: Host, state: ReqKvState, n: int, budget: int) -> int | None:
    """What the pass after prefill keeps of a prompt of n entries, or None. When the decode
    policy's trigger would fire at that length in the very next step (Batch-Max, whose
    Algorithm 1 evicts once the cache reaches the budget), the pass cuts to what that decode
    pass would keep, so the prompt is compressed once, whichever policy chose."""
    target = comp.policy(state.policy_name("prefill"), budget).prefill_target_length(n)
    if target is None and n > budget:
        target = budget  # any policy, with a prompt over budget
    if target is not None and "decode" in comp.config.compress_on:
        again = comp.policy(state.policy.name, budget).target_length(target)
        if again is not None and again < target:
            target = again
    return target


def reconstruct(comp: Host, batch: ScheduleBatch, chunks: list[tuple[int, ReqKvState, int]],
                starts: list[tuple[int, ReqKvState, int]], questions: list[int]) -> None:
    """The reconstruction pass of every request of this moment whose prompt policy reads one
    (KVzip), before the passes choose: one extend forward per chunk of context, shared by them;
    and the question's forward of the cuts in `questions` (their window)."""
    due: list[tuple[int, ReqKvState, str]] = []
    cut = {i: state for i, state, _ in chunks}
    due += [(i, cut[i], "question") for i in questions if failure(batch.reqs[i]) is None]
    for moment, items in (("chunk", chunks), ("prefill", starts)):
        for i, state, _ in items:
            n = int(batch.seq_lens_cpu[i])
            if comp.policy(state.policy_name(moment), state.effective_budget(n)).uses_reconstruction:
                due.append((i, state, moment))
    # With tensor parallelism a rank with none due still votes where another rank may have
    # some (a request skipped on this rank alone): `Reconstructor.must_agree`.
    if not due and not comp.reconstructor.must_agree(batch):
        return
    t0 = time.perf_counter()
    comp.reconstructor.run(comp.scheduler, batch, due,
                           lambda req, e: comp.failures.fail(req, "compress", e))
    comp.account(time.perf_counter() - t0)


def chunk_due(comp: Host, batch: ScheduleBatch, req: Req, state: ReqKvState, n: int, keep: int,
              always: bool = False) -> bool:
    """Whether a prompt over its budget is compressed before its next chunk: after every
    chunk (`chunk-always`, or `always`: a cut its document's key asks for), or when what its
    next chunk takes would not fit (`chunk`). Before
    its first such compaction, what it computed so far is published to the tree (still exact).
    One that is due but finds no free slots for the entries it keeps fails alone now: its
    next chunk would not fit uncompressed (SGLang's prefill would run out of memory)."""
    if comp.config.chunk_moment != "always" and not always:
        need = None if comp.scheduler is None else chunk_need(
            req, comp.config, n, state.logical_len(n), state.compressed)
        if need is None or not needs_compression(comp.scheduler, req, need, batch):
            return False
    insert_exact_prefix(req, batch.tree_cache)
    if not room_for(batch, batch.reqs.index(req), keep):
        comp.stats.skipped += 1
        comp.failures.fail(req, "compress", CompactionSkipped("no free slots"), message=CHUNK_SKIPPED)
        return False
    return True
