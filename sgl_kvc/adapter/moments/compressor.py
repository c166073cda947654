"""The compression moments, run by the scheduler between forward steps.

(a) `prefill`, right after prefill: policies that compress after prefill (SnapKV, KV-Compress,
    H2O, ...) and any request whose prompt is over its budget;
(a') `chunk`, between two chunks of a long prompt (Batch-Max's prefill-time eviction, Algorithm
    1): the cache is cut back to the budget when the next chunk would not fit the memory left
    (`adapter/scheduling/chunk_pressure.py`; `chunk-always`: after every chunk, so the prompt never holds
    more than budget + one chunk); the next chunk's queries attend to what was kept, at logical
    positions;
(b) `decode`, before a decode step: when a request's cache reaches its policy's trigger (R-KV:
    budget + buffer, §3.1), compress it back to the budget;
(c) `preempt`, when SGLang's decode memory check fails: compress running requests that are over
    their budget (largest first) until the step fits; SGLang preempts (in its words, retracts)
    only if memory is still short.

A moment runs passes (`sgl_kvc.core.passes`): per-head passes are staged over scheduler steps
within `--kv-pass-work`, shared among the step's passes; the selections that finish in a
moment are compacted together, each kind by its own routine (`adapter/moments/compaction.py`), and
committed. Whatever fails for one request fails that request alone, and on every
tensor-parallel rank (`adapter/safety/failures.py`): each moment's hook ends by settling its failures.
A pass whose compaction could not have the fresh slots it copies into (admission reserved them,
`adapter/scheduling/admission.py`) is not scored: it is put off with a back-off, or, between two chunks, its
request fails alone.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter import documents
from sgl_kvc.adapter.documents import document_pass, extensions
from sgl_kvc.adapter.kvzip.reconstruction import Reconstructor, is_reconstruction, question_slots, unscorable
from sgl_kvc.adapter.memory.kv_memory import DECODE_BYTES_ATTR, DOCUMENT_BYTES_ATTR, FORWARD_ENTRIES_ATTR, MOMENT_SLOTS_ATTR
from sgl_kvc.adapter.moments.compaction import (
    CompactionResult,
    CompactionSkipped,
    Prepared,
    abandon,
    apply,
    prepare_per_head,
    prepare_units,
)
from sgl_kvc.adapter.moments.rope import rope_params
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank, FailureLedger, failure
from sgl_kvc.adapter.safety.tp import RankVote, ScoreReducer, agree, tp_rank
from sgl_kvc.adapter.scheduling.admission import chunk_need
from sgl_kvc.adapter.scheduling.chunk_pressure import needs_compression
from sgl_kvc.adapter.scheduling.requests import chunk_compressible, insert_exact_prefix, is_middle_chunk, on_release
from sgl_kvc.adapter.telemetry.metrics import CompressionStats, maybe_metrics
from sgl_kvc.adapter.telemetry.trace import CompactionTrace
from sgl_kvc.config import KERNEL_DECODE_ATTENTION, KvcConfig
from sgl_kvc.core.passes import DueCompaction, StepWork, advance, pass_tables, start_pass
from sgl_kvc.core.query_moments import QueryMoments
from sgl_kvc.core.reconstruction import carry_through, question_tokens
from sgl_kvc.core.request_state import ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.core.views import layer_views, prompt_moments, prompt_reconstruction, with_gaps
from sgl_kvc.footprint import compaction_copies
from sgl_kvc.policies import HeadSelection, Policy, get_policy, prompt_policy_error
from sgl_kvc.adapter.kvc_req import resolved

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# What the client of a prompt read in chunks is told when the pass between two of its chunks finds
# no free slots for the entries it keeps.
CHUNK_SKIPPED = ("sgl-kvc could not compress this request between two chunks of its prompt: the KV "
                 "pool had no free slots for the entries it keeps, and its next chunk cannot fit "
                 "uncompressed; retry when the server is less loaded")
# Policies are cached per (name, budget); under --kv-budget-ratio every length gives a new
# budget, so the cache is an LRU of this many entries rather than unbounded.
POLICY_CACHE_SIZE = 64


@dataclass
class _PrefillMoments:
    """What one extend's moments are due: passes between chunks and after prefill ((index in the
    batch, state, target)), the requests whose prompt is read, the documents whose end a chunk
    reached (index -> key; `passes_before`: the passes before the cut of those cut there), and the
    cuts whose window is their question's (indices, and the slots their forwards hold:
    `Compressor._question_slots`)."""

    chunks: list[tuple[int, ReqKvState, int]] = field(default_factory=list)
    starts: list[tuple[int, ReqKvState, int]] = field(default_factory=list)
    read: list[ReqKvState] = field(default_factory=list)
    ends: dict[int, Any] = field(default_factory=dict)
    passes_before: dict[int, int] = field(default_factory=dict)
    questions: list[int] = field(default_factory=list)
    question_slots: int = 0  # the slots their forwards hold at once, at most


def _room(batch: ScheduleBatch) -> int:
    """Slots a compaction or a forward of this moment can take now: free, or the tree's unlocked."""
    return batch.token_to_kv_pool_allocator.available_size() + batch.tree_cache.evictable_size()


class Compressor:
    """One per scheduler process. Owns the policies, the store and the counters."""

    def __init__(self, config: KvcConfig, model_runner: ModelRunner) -> None:
        self.config = config
        self.stats = CompressionStats()
        pool = model_runner.token_to_kv_pool
        self.first_layer = int(getattr(pool, "start_layer", 0))
        self.num_layers = self.first_layer + int(pool.layer_num)
        req_to_token_pool = model_runner.req_to_token_pool
        self.store = KvcStore(
            self.num_layers, config.kv_window, req_to_token_pool.req_to_token, pool, first_layer=self.first_layer,
        )
        on_release(req_to_token_pool, self._released)
        self._policies: OrderedDict[tuple[str, int], Policy] = OrderedDict()
        self.rope = rope_params(model_runner)  # the model's RoPE, for the policies that read it
        # With tensor parallelism each rank sees only its own KV heads: a shared selection's
        # scores are averaged over the TP group first, so every rank keeps the same tokens.
        self.reduce_scores = ScoreReducer.for_sglang_tp_group()
        self.tp_rank = tp_rank()
        # A request that fails on any rank fails on all of them, in the same step.
        self.failures = FailureLedger(drop=self._drop, vote=RankVote.for_sglang_tp_group())
        self.trace = CompactionTrace.from_env(self.tp_rank)
        # KVzip's reconstruction passes, run as SGLang extend forwards before their prompt passes;
        # with tensor parallelism the ranks vote on them before each forward (the model's
        # collectives need every rank in it)
        self.reconstructor = Reconstructor(config, self.store, vote=self.failures.vote)
        self.scheduler: Any = None  # set by the scheduler hooks (`serve`); read for the other running batch
        self._registry: Any = None  # the shared documents' registry `serve` wired
        self._due: list[DueCompaction] = []  # per-head compactions of the current moment
        self._step_seconds = 0.0  # compression work in this step so far
        self.metrics = maybe_metrics(model_runner, config.policy)
        # Requests that may hold prompt moments at once (None: no KV-memory reservation ran, as
        # on a pool layout without one cost per token: not bounded here).
        pool_config = getattr(model_runner, "memory_pool_config", None)
        self.moment_slots: int | None = getattr(pool_config, MOMENT_SLOTS_ATTR, None)
        # The shared documents' metadata stays within what the KV memory reserved for it (None:
        # nothing was reserved, not bounded here), `KvcRadixCache.make_document_room`.
        self.document_bytes: int | None = getattr(pool_config, DOCUMENT_BYTES_ATTR, None)
        # A reconstruction forward attends to at most the entries whose keys were reserved.
        self.reconstructor.forward_entries = getattr(pool_config, FORWARD_ENTRIES_ATTR, None)
        # The fused decode plan's blocks stay within what the KV memory reserved for them.
        decode_bytes = getattr(pool_config, DECODE_BYTES_ATTR, None)
        if decode_bytes:
            self.store.block_bytes = decode_bytes
        backend = model_runner.attn_backend
        if config.compressing and hasattr(backend, "kvc_store"):
            # Only a compressing server observes attention: with --policy none the backend does
            # exactly what SGLang's does (per-request compression is refused on such a server).
            backend.kvc_store = self.store
            self.store.attends = config.kv_decode_attention in KERNEL_DECODE_ATTENTION and backend.kvc_attends
            self.store.intact_as_sglang = config.kv_decode_attention == "batched"
        if config.decode_graphs:  # before SGLang captures its decode graphs (`adapter/decode_graphs.py`)
            mc = model_runner.model_config
            group = int(mc.num_attention_heads) // int(mc.get_total_num_kv_heads())  # query heads per KV head
            units = self.store.unit_pools[0].shape[0] if self.store.unit_pools is not None else 0
            self.store.enable_graphs(q_heads=group * self.store.kv_heads, head_dim=int(mc.head_dim), dtype=mc.dtype,
                                     arena_units=units)

    def serve(self, scheduler: Any) -> None:
        """The scheduler this compressor runs in (set by its hooks, every step), and, once, its
        shared documents' registry: their metrics, their metadata's reservation and the ranks'
        vote, before anything is published."""
        self.scheduler = scheduler
        registry = documents.registry_of(getattr(scheduler, "tree_cache", None))
        if registry is not None and self._registry is not registry:
            self._registry = registry
            registry.metrics = self.metrics
            registry.metadata_budget = self.document_bytes
            registry.vote = self.failures.vote

    # --- per request --------------------------------------------------------------------------
    def policy(self, name: str, budget: int) -> Policy:
        key = (name, budget)
        policy = self._policies.get(key)
        if policy is None:
            params = replace(self.config.policy_params(budget), **self.rope)
            policy = self._policies[key] = get_policy(name, params)
            if len(self._policies) > POLICY_CACHE_SIZE:
                self._policies.popitem(last=False)
        else:
            self._policies.move_to_end(key)
        return policy

    def new_state(self, req: Req) -> ReqKvState:
        settings = resolved(req, self.config)
        why = prompt_policy_error(settings.policy, settings.prompt_policy)
        if why is not None:  # the HTTP layer refuses it first; this guards the scheduler
            raise ValueError(why)
        return ReqKvState(
            policy=self.policy(settings.policy, settings.budget.tokens), budget=settings.budget,
            selection=settings.selection, device=self.store.device,
            prompt_policy=settings.prompt_policy_name,
        )

    def state(self, req: Req) -> ReqKvState | None:
        return kvc_req.of(req).state

    def begin_extend(self, batch: ScheduleBatch) -> None:
        """Before a prefill (chunk): give requests seen for the first time their state, and tell
        the observation store the batch's rows and the tables of its packed requests (host-side:
        no device sync in the forward). A reconstruction forward's rows are its requests' own: the
        store gets them and their tables, nothing else."""
        rows = [req.kv.req_pool_idx for req in batch.reqs]
        if is_reconstruction(batch):
            self.store.begin_extend(rows, batch.seq_lens_cpu.tolist())
            return
        for req in batch.reqs:
            if kvc_req.of(req).state is None and not req.finished() and failure(req) is None:
                self.failures.guarded(req, "start", self._begin, req, getattr(batch, "tree_cache", None))
        self.store.begin_extend(rows, batch.seq_lens_cpu.tolist())
        failpoints.observing(self.store, batch.reqs, rows)

    def _begin(self, req: Req, tree_cache: Any = None) -> None:
        state = self.new_state(req)
        self._query_moments(state)
        self.store.begin(req.kv.req_pool_idx, state)
        doc = documents.hit(req)
        if doc is not None:
            _start_from(state, doc, self.store.device)
            self.store.set_offset(req.kv.req_pool_idx, state.offset)
            if not getattr(req, "retracted_stain", False):
                # SGLang counted the node's slots as cached prompt tokens: the client's usage
                # says the document's D tokens were (counted once, as SGLang counts them).
                req.cached_tokens += doc.offset
            registry = documents.registry_of(tree_cache)
            if registry is not None:
                registry.count_hit()
        # A document request's own budget applies beyond its document: the document's k entries
        # (a hit), or its D tokens (the request that compresses it keeps its own copy whole). A
        # ratio (`--kv-budget-ratio`) is of the tokens after the document: of all of them, a
        # hit's first pass cut the document's entries below what the document keeps.
        document_part = documents.held_for_document(req)
        if document_part:
            covers = doc.key.tokens if doc is not None else documents.declared(req).tokens
            state.budget = state.budget.beyond(document_part, covers)
        kvc_req.of(req).state = state

    def state_from(self, req: Req, doc: documents.Document) -> ReqKvState:
        """The state `req` has once it goes on from `doc` between two chunks of its prompt
        (`extensions.adopt`): a new one, as a request's that started from `doc` (`_begin`, its
        usage and the hit counted when it started). Nothing changes here (`set_state`)."""
        old = self.state(req)
        state = self.new_state(req)
        if old is not None and old.query_moments is not None:
            self._query_moments(state)  # afresh, as a hit's: from the document's end
        _start_from(state, doc, self.store.device)
        state.budget = state.budget.beyond(doc.key.entries, doc.key.tokens)  # (as `_begin`'s for a hit)
        return state

    def set_state(self, req: Req, state: ReqKvState) -> None:
        """`req`'s row is the one `state` (`state_from`) describes now."""
        row = req.kv.req_pool_idx
        self.store.begin(row, state)
        self.store.set_offset(row, state.offset)
        kvc_req.of(req).state = state

    def _query_moments(self, state: ReqKvState) -> None:
        prompt = self.policy(state.policy_name("prefill"), state.budget.tokens)
        if prompt.uses_query_moments and self.config.compressing:
            # Only such a request pays for them (the observation folds in each chunk's queries),
            # within the slots reserved for them in the KV memory (`adapter/memory/kv_memory.py`);
            # beyond, the policy scores its prompt from the observation window.
            if self.moment_slots is not None and self.store.moment_holders >= self.moment_slots:
                self.stats.moments_declined += 1
            else:
                state.query_moments = QueryMoments(
                    self.num_layers, prompt.params.sink_tokens, prompt.params.ea_covariance, prompt.prerope_queries,
                )

    def _released(self, req: Req) -> None:
        """A request gave its row back (finished, aborted, retracted): drop what it held."""
        row = getattr(req.kv, "req_pool_idx", None)
        if row is not None:
            self.store.release(row)
        kvc_req.of(req).state = None

    def begin_decode(self, batch: ScheduleBatch, fb: ForwardBatch) -> None:
        """Before a decode forward: the step's plan, from host-side data."""
        rows = [req.kv.req_pool_idx for req in batch.reqs]
        self.store.begin_decode(rows, fb.seq_lens_cpu.tolist())  # a CPU tensor: no device sync
        failpoints.observing(self.store, batch.reqs, rows)

    def extend_position_offsets(self, batch: ScheduleBatch, fb: ForwardBatch) -> Any:
        """Per-token RoPE offsets of an extend batch (on the device), or None if all are 0: the
        chunks after a compaction between chunks continue at logical positions."""
        if not self.store.offset_rows or not any(r.kv.req_pool_idx in self.store.offset_rows for r in batch.reqs):
            return None
        per_request = self.store.offsets[fb.req_pool_indices]
        return torch.repeat_interleave(per_request, fb.extend_seq_lens, output_size=int(fb.positions.numel()))

    def decode_position_offsets(self, req_pool_indices: Any) -> Any:
        """Per-request RoPE offsets of a decode batch (on the device), or None if all are 0."""
        if not self.store.offset_rows:
            return None
        return self.store.offsets[req_pool_indices]

    # --- the moments ---------------------------------------------------------------------------
    def before_prefill_result(self, batch: ScheduleBatch) -> None:
        """After an extend's forward, before SGLang processes its result: the shared documents of
        the requests whose prompt it finished reading are published from their exact entries. Here,
        not after: SGLang releases a request that finishes at its first token (`max_tokens` 1, an
        EOS at once, the `n` > 1 prefix warm-up of `max_new_tokens` 0) while it processes the
        result, and its row with it, so it could no longer publish. Decided from what every
        tensor-parallel rank holds alike (`document_pass.to_publish`)."""
        self._step_seconds = 0.0
        read_at = [i for i, req in enumerate(batch.reqs) if not is_middle_chunk(batch, req)]
        document_pass.publish_copies(self, batch, document_pass.to_publish(self, batch, read_at))
        # and the extensions of resident documents read by now, before any pass of their rows
        extensions.publish(self, batch, extensions.due(self, batch))

    def after_prefill(self, batch: ScheduleBatch) -> None:
        """After an extend, each request's moment: the chunk moment for a request between two
        chunks of its prompt (`_chunk_moment`), the prefill moment for one whose prompt is read
        (`_prefill_moment`; its document was published before SGLang processed the extend's
        result, `before_prefill_result`). Their passes run together, then the documents whose
        end a chunk reached are published from the rows cut there."""
        # requests whose chunk ended at their document's end: all of them, found alike on every
        # rank (one whose state failed here is still listed, for the ranks' vote on publishing)
        due = _PrefillMoments(ends={i: key for i, req in enumerate(batch.reqs)
                                    if is_middle_chunk(batch, req) and (key := documents.ends_here(req)) is not None})
        # and those whose chunk ended at the end of the extension they published: they go on
        # from it, not cut here (`extensions.adopt`)
        adopting = {i: key for i, req in enumerate(batch.reqs)
                    if is_middle_chunk(batch, req) and (key := documents.adopts_here(req)) is not None}
        for i, req in enumerate(batch.reqs):
            state = self.state(req)
            if req.finished() or state is None or state.policy.name == "none" or i in adopting:
                continue
            n = int(batch.seq_lens_cpu[i])
            if is_middle_chunk(batch, req):
                self._chunk_moment(batch, i, req, state, n, due)
            else:
                self._prefill_moment(batch, i, state, n, due)
        self._reconstruct(batch, due.chunks, due.starts, due.questions)
        chunks = [c for c in due.chunks if failure(batch.reqs[c[0]]) is None]
        starts = [s for s in due.starts if failure(batch.reqs[s[0]]) is None]
        self._run_passes(batch, [], chunks, "chunk", whole=True)
        self._run_passes(batch, [], starts, "prefill")
        for state in due.read:
            # Its prompt is read: the prompt's query moments served this moment's pass (a staged
            # one took them when it began) and serve no later one.
            state.query_moments = None
        self._flush(batch)
        document_pass.publish_cut_rows(self, batch, list(due.ends.items()), due.passes_before)
        extensions.adopt(self, batch, list(adopting.items()))
        self._settle(batch)

    def _chunk_moment(self, batch: ScheduleBatch, i: int, req: Req, state: ReqKvState, n: int,
                      due: _PrefillMoments) -> None:
        """Request i, between two chunks of its prompt (`n` entries in its row): the cut it is due,
        if any, never staged (the next chunk extends what the pass leaves). At its document's end,
        to the document's k entries (published after the pass); inside its document, where the
        document's key says; elsewhere, to its chunk target when its next chunk needs the room."""
        key = due.ends.get(i)
        if key is not None:
            if n > key.entries and self._room_for(batch, i, key.entries):
                # Its document is read, its question not: the row is cut to the document's k
                # entries, to be published (`document_pass.publish_cut_rows`).
                due.chunks.append((i, state, key.entries))
                due.passes_before[i] = state.passes
                return
        inside = documents.cut_inside(req)
        if inside is not None:
            # Inside its document the row is cut only where the document's key says (at fixed
            # chunk boundaries, to fixed sizes), whatever the pool's pressure or this request's own
            # budget: what the document keeps is then the same whoever publishes it (`cut_at`).
            if inside and n > inside and self.failures.guarded(
                req, "compress", self._chunk_due, batch, req, state, n, inside, True
            ):
                due.chunks.append((i, state, inside))
                documents.cut(req)
            return
        keep = self.config.chunk_target(state.effective_budget(n))
        if n > keep and chunk_compressible(req, self.config) and self.failures.guarded(
            req, "compress", self._chunk_due, batch, req, state, n, keep
        ):
            due.chunks.append((i, state, keep))
            slots = self.failures.guarded(req, "compress", self._question_slots, req, state, n)
            if slots and _room(batch) >= due.question_slots + slots:
                due.questions.append(i)
                due.question_slots += slots

    def _question_slots(self, req: Req, state: ReqKvState, n: int) -> int:
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
        unread = question_tokens(len(req.origin_input_ids), state.logical_len(n), self.config.kv_window)
        if min(unread, int(self.store.req_to_token.shape[1]) - n) < 1:
            return 0
        return question_slots(self.config, resolved(req, self.config), len(req.origin_input_ids))

    def _prefill_moment(self, batch: ScheduleBatch, i: int, state: ReqKvState, n: int,
                        due: _PrefillMoments) -> None:
        """Request i, its prompt read (`n` entries): the pass after prefill, where it is on and
        the request is over its target, or put off when its compaction finds no room now."""
        due.read.append(state)
        if "prefill" not in self.config.compress_on:
            return
        target = self._prefill_target(state, n, state.effective_budget(n))
        if target is not None and target < n:
            if self._room_for(batch, i, target):
                due.starts.append((i, state, target))
            else:
                self._put_off(state, n)

    def _prefill_target(self, state: ReqKvState, n: int, budget: int) -> int | None:
        """What the pass after prefill keeps of a prompt of n entries, or None. When the decode
        policy's trigger would fire at that length in the very next step (Batch-Max, whose
        Algorithm 1 evicts once the cache reaches the budget), the pass cuts to what that decode
        pass would keep, so the prompt is compressed once, whichever policy chose."""
        target = self.policy(state.policy_name("prefill"), budget).prefill_target_length(n)
        if target is None and n > budget:
            target = budget  # any policy, with a prompt over budget
        if target is not None and "decode" in self.config.compress_on:
            again = self.policy(state.policy.name, budget).target_length(target)
            if again is not None and again < target:
                target = again
        return target

    def _reconstruct(self, batch: ScheduleBatch, chunks: list[tuple[int, ReqKvState, int]],
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
                if self.policy(state.policy_name(moment), state.effective_budget(n)).uses_reconstruction:
                    due.append((i, state, moment))
        # With tensor parallelism a rank with none due still votes where another rank may have
        # some (a request skipped on this rank alone): `Reconstructor.must_agree`.
        if not due and not self.reconstructor.must_agree(batch):
            return
        t0 = time.perf_counter()
        self.reconstructor.run(self.scheduler, batch, due,
                               lambda req, e: self.failures.fail(req, "compress", e))
        self.account(time.perf_counter() - t0)

    def _chunk_due(self, batch: ScheduleBatch, req: Req, state: ReqKvState, n: int, keep: int,
                   always: bool = False) -> bool:
        """Whether a prompt over its budget is compressed before its next chunk: after every
        chunk (`chunk-always`, or `always`: a cut its document's key asks for), or when what its
        next chunk takes would not fit (`chunk`). Before
        its first such compaction, what it computed so far is published to the tree (still exact).
        One that is due but finds no free slots for the entries it keeps fails alone now: its
        next chunk would not fit uncompressed (SGLang's prefill would run out of memory)."""
        if self.config.chunk_moment != "always" and not always:
            need = None if self.scheduler is None else chunk_need(
                req, self.config, n, state.logical_len(n), state.compressed)
            if need is None or not needs_compression(self.scheduler, req, need, batch):
                return False
        insert_exact_prefix(req, batch.tree_cache)
        if not self._room_for(batch, batch.reqs.index(req), keep):
            self.stats.skipped += 1
            self.failures.fail(req, "compress", CompactionSkipped("no free slots"), message=CHUNK_SKIPPED)
            return False
        return True

    def _room_for(self, batch: ScheduleBatch, i: int, target: int) -> bool:
        """Whether request i's compaction to `target` entries can have the fresh slots it copies
        the tree's kept entries into (free slots, or the tree's unlocked ones), before its pass is
        scored: a pass that could not be compacted would only spend the step's allowance."""
        req = batch.reqs[i]
        copies = compaction_copies(int(batch.seq_lens_cpu[i]), int(req.kv.cache_protected_len), target)
        if not copies:
            return True
        return _room(batch) >= copies

    def _put_off(self, state: ReqKvState, n: int) -> None:
        """A pass of this request was not run, or its compaction not applied, for lack of free
        slots: no new pass starts until it has grown by 2, 4, ... tokens (at most `--kv-buffer`),
        so it does not take the step's allowance from the others every step meanwhile."""
        self.stats.skipped += 1
        state.skips += 1
        state.retry_at = state.logical_len(n) + min(1 << state.skips, max(1, self.config.kv_buffer))

    def before_decode(self, batch: ScheduleBatch) -> None:
        self._step_seconds = 0.0
        pending, starts = [], []
        for i, req in enumerate(batch.reqs):
            state = self.state(req)
            if state is None or state.policy.name == "none" or req.finished():
                continue
            if state.pending is not None:
                pending.append((i, state))
                continue
            n = int(batch.seq_lens_cpu[i])
            if state.retry_at > state.logical_len(n):
                continue  # put off for lack of slots (`_put_off`)
            target = self.policy(state.policy.name, state.effective_budget(n)).target_length(n)
            if target is not None and target < n:
                if self._room_for(batch, i, target):
                    starts.append((i, state, target))
                else:
                    self._put_off(state, n)
        self._run_passes(batch, pending, starts, "decode")
        self._flush(batch)
        self._settle(batch)

    def before_preempt(self, batch: ScheduleBatch) -> bool:
        """Compress over-budget requests until the next decode step fits. True if it fits."""
        order = sorted(range(len(batch.reqs)), key=lambda j: -int(batch.seq_lens_cpu[j]))
        compressed = fits = False
        for i in order:
            req = batch.reqs[i]
            state = self.state(req)
            if state is None or state.policy.name == "none" or req.finished():
                continue
            n = int(batch.seq_lens_cpu[i])
            budget = state.effective_budget(n)
            if n > budget and not self._room_for(batch, i, budget):
                self.stats.skipped += 1  # another may free slots: the next is tried
            elif n > budget:
                passes = state.passes
                work = StepWork.unlimited()  # retraction is the alternative: the pass runs whole
                self.failures.guarded(req, "compress", self._start_pass, batch, i, state, budget, "preempt", work)
                self._flush(batch)
                compressed |= state.passes > passes
                if batch.check_decode_mem():
                    fits = True
                    break
        self._settle(batch)
        if fits and compressed:
            self.stats.avoided_retractions += 1
            if self.metrics:
                self.metrics.avoided_retraction()
        return fits or batch.check_decode_mem()

    def _run_passes(
        self, batch: ScheduleBatch, pending: list[tuple[int, ReqKvState]], starts: list[tuple[int, ReqKvState, int]],
        moment: str, whole: bool = False,
    ) -> None:
        """Advance the staged passes and start the new ones of one moment. The step's work
        (`--kv-pass-work`) is shared equally among them, so no request waits behind another's
        whole pass (each still makes progress every step); `whole`: every pass runs to its end.
        The finished ones are due for the step's compaction (`_flush`)."""
        runs = len(pending) + len(starts)
        if not runs:
            return
        limit = 0 if whole else self.config.kv_pass_work
        share = max(1, limit // runs) if limit > 0 else 0

        def work() -> StepWork:
            return StepWork(allowance=share) if limit > 0 else StepWork.unlimited()

        for i, state in pending:
            self.failures.guarded(batch.reqs[i], "compress", self._advance, batch, i, state, work())
        for i, state, target in starts:
            self.failures.guarded(batch.reqs[i], "compress", self._start_pass, batch, i, state, target, moment, work())

    # --- failure isolation ----------------------------------------------------------------------
    def _drop(self, req: Req) -> None:
        """A failed request: sgl-kvc forgets it at once (its state, a staged pass, its observations),
        and its KV, which may be half moved, never enters the radix tree."""
        kvc_req.of(req).state = None
        row = getattr(req.kv, "req_pool_idx", None)
        if row is not None:
            self.store.release(row)
        req.skip_radix_cache_insert = True

    def _settle(self, batch: ScheduleBatch) -> None:
        """End of a moment's hook: the ranks agree on what failed, and it is aborted."""
        self.stats.failed_requests += self.failures.settle(batch.reqs, self.scheduler)

    # --- passes ---------------------------------------------------------------------------------
    def _start_pass(
        self, batch: ScheduleBatch, i: int, state: ReqKvState, target: int, moment: str, work: StepWork
    ) -> None:
        """Begin a pass to `target` entries and run what `work` allows of it."""
        if not state.per_head:
            self._compress_shared(batch, i, state, target, moment)
            return
        failpoints.check("compress_raise", batch.reqs[i])
        t0 = time.perf_counter()
        row = batch.reqs[i].kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        policy = self.policy(state.policy_name(moment), state.effective_budget(n))
        tables = pass_tables(self.store, self.config.kv_head_budget, policy, state, self.store.req_to_token[row, :n])
        # a staged pass in progress is superseded
        state.pending = start_pass(self.store, row, state, policy, n, target, moment, tables)
        self.account(time.perf_counter() - t0)
        self._advance(batch, i, state, work)

    def _advance(self, batch: ScheduleBatch, i: int, state: ReqKvState, work: StepWork) -> None:
        """Score what `work` allows of the request's pass; a finished selection is due for this
        moment's compaction (`_flush`)."""
        t0 = time.perf_counter()
        row = batch.reqs[i].kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i])
        due = advance(self.store, row, state, n, work, self.config.kv_head_budget, i)
        if due is not None:
            self._due.append(due)
        self.account(time.perf_counter() - t0)

    def _compress_shared(self, batch: ScheduleBatch, i: int, state: ReqKvState, target: int, moment: str) -> None:
        """The shared selection: one set of tokens for every layer and head, in one step (with
        tensor parallelism, scores averaged over the ranks first)."""
        t0 = time.perf_counter()
        req = batch.reqs[i]
        n = int(batch.seq_lens_cpu[i])
        try:
            failpoints.check("compress_raise", req)
            policy = self.policy(state.policy_name(moment), state.effective_budget(n))
            positions = state.positions(n)
            views = layer_views(self.store, req.kv.req_pool_idx, state, n, positions, self._layers(),
                                values=policy.uses_values,
                                moments=prompt_moments(self.store, state, policy, moment),
                                reconstruction=prompt_reconstruction(state, policy, moment))
            combined, error = policy.combined_score(views), None
        except Exception as e:  # noqa: BLE001 - raised below, after the other ranks heard of it
            combined, error = None, e
        reduce = None if failpoints.hits("tp_local_scores", req) else self.reduce_scores  # the planted fault: each rank from its own heads
        if reduce is not None:
            # Every rank joins the all-reduce, the one whose scoring failed too: it would wait forever.
            combined, failed_anywhere = reduce.reduce(combined, n, failed=error is not None)
            if failed_anywhere and error is None:
                error = FailedOnAnotherRank()
        if error is not None:
            raise error
        chosen = policy.choose(views, combined, target)
        stats = None
        if state.policy.uses_stats:  # the decode policy's statistic, whichever policy chose
            stats = with_gaps(self.first_layer, [state.policy.carry_stats(v, chosen) for v in views])
        selection = HeadSelection.broadcast(chosen, len(views), self.store.kv_heads, n)
        self._due.append(DueCompaction(
            i=i, state=state, policy=policy, moment=moment, selection=selection,
            kept_positions=positions[chosen], stats=stats, began_at=n, staged=False,
        ))  # fmt: skip
        self.account(time.perf_counter() - t0)

    # --- compaction and commit ------------------------------------------------------------------
    def _flush(self, batch: ScheduleBatch) -> None:
        """Compact the requests whose selection finished in this step, together: each kind (per
        head or shared; packed in the unit pool) by its routine, in batched moves of bounded size. Then
        the ranks agree on what moved everywhere (`_vote`), that is applied, and each request is
        committed. With tensor parallelism every rank flushes every step on which any rank worked
        for a request (`FailureLedger.active`), due or not; a step with no work has no collective."""
        due = [d for d in self._due if failure(batch.reqs[d.i]) is None]
        self._due = []
        if not due and (self.failures.vote is None or not self.failures.active):
            return  # nothing due here, and (no work on any rank) nowhere: no collective
        t0 = time.perf_counter()
        self.stats.max_compacted_together = max(self.stats.max_compacted_together, len(due))
        outcomes: dict[int, Prepared | Exception] = {
            d.i: CompactionSkipped("planted: no free slots") for d in due if failpoints.skips(batch.reqs[d.i], d.moment)
        }
        packed = [d for d in due if d.units is not None and d.i not in outcomes]  # variable budgets: the unit pool
        rows = [d for d in due if d.units is None and d.i not in outcomes]  # per-head uniform and shared selections
        if packed:
            items = [(d.i, d.selection, d.units) for d in packed]
            outcomes.update(zip((d.i for d in packed), prepare_units(batch, items, self.store.unit_pools)))
        if rows:
            outcomes.update(zip((d.i for d in rows), prepare_per_head(batch, [(d.i, d.selection) for d in rows])))
        ready = self._vote(batch, outcomes)
        applied = dict(zip((p.i for p in ready), apply(batch, ready, self._other_batches(batch))))
        for d in due:
            outcome = applied.get(d.i, outcomes[d.i])
            if isinstance(outcome, CompactionSkipped) and d.moment == "chunk":
                # Its next chunk cannot fit uncompressed: it fails alone, before that chunk runs.
                self.stats.skipped += 1
                self.failures.fail(batch.reqs[d.i], "compress", outcome, message=CHUNK_SKIPPED)
            elif isinstance(outcome, CompactionSkipped):
                logger.debug("compression of %s put off: %s", batch.reqs[d.i].rid, outcome)
                self._put_off(d.state, int(batch.seq_lens_cpu[d.i]))
            elif isinstance(outcome, Exception):
                self.failures.fail(batch.reqs[d.i], "compress", outcome)
            else:
                self.failures.guarded(batch.reqs[d.i], "compress", self._commit, batch, d, outcome)
        self.account(time.perf_counter() - t0)

    def _vote(self, batch: ScheduleBatch, outcomes: dict[int, Prepared | Exception]) -> list[Prepared]:
        """The prepared compactions to apply, the same on every rank: a request whose compaction
        failed on any rank (or which failed there earlier in the step) fails on all; one skipped
        everywhere is skipped; one skipped on some ranks and prepared on others (their pools no
        longer agree) fails. A prepared one not applied is abandoned. `outcomes` is updated."""
        tally = torch.zeros(len(batch.reqs), 3, dtype=torch.int64, device="cpu")  # failed, skipped, prepared (host)
        for i, req in enumerate(batch.reqs):
            outcome = outcomes.get(i)
            if failure(req) is not None or _failed(outcome):
                tally[i, 0] = 1
            elif isinstance(outcome, CompactionSkipped):
                tally[i, 1] = 1
            elif isinstance(outcome, Prepared):
                tally[i, 2] = 1
        tally = agree(self.failures.vote, tally)
        ready = []
        for i, (failed, skipped, prepared) in enumerate(tally.tolist()):
            outcome = outcomes.get(i)
            if isinstance(outcome, Prepared):
                if not failed and not skipped:
                    ready.append(outcome)
                    continue
                abandon(batch, outcome)  # its entries moved here: it cannot go on uncompressed
                outcomes[i] = FailedOnAnotherRank()
            elif isinstance(outcome, CompactionSkipped) and (failed or prepared):
                outcomes[i] = FailedOnAnotherRank()
            elif outcome is None and (failed or skipped or prepared):
                self.failures.fail(batch.reqs[i], "compress", FailedOnAnotherRank())
        return ready

    def _commit(self, batch: ScheduleBatch, d: DueCompaction, outcome: CompactionResult) -> None:
        """After request d.i's compaction: its state, position offset, query count, counters."""
        req = batch.reqs[d.i]
        state, row = d.state, req.kv.req_pool_idx
        n = d.n or d.selection.n  # a packed request's tables are wider than its row
        if d.moment == "chunk":
            # The next chunk extends the kept entries (SGLang resumes at `prefix_len`, which it
            # sets from `extend_end` when it stashes a chunk), and its tokens are read `offset`
            # further on (`shifted_fill_ids`).
            req.prefix_len = req.extend_end = outcome.kept
            # SGLang counts a chunk's cache hits as its prefix minus what the request computed
            # before it (`already_computed`): that is now the kept entries, so the usage's
            # cached_tokens stays what the tree gave (it went negative by every dropped entry).
            req.already_computed = outcome.kept
            state.fill_shift = True
        logical_len = state.logical_len(n)  # the offset is still the one before compaction
        if d.stats is not None:
            state.stats = d.stats
        state.kept_positions = d.kept_positions
        # between chunks, the scores of the kept entries' reconstruction (the next prompt pass
        # repeats only what is read since); after the prompt, nothing, but for a conversation's
        # request (one that may keep a reply, `adapter/documents/turns.py`) the scores of its
        # prefill pass or of the document it started from, through its decode passes: its next
        # turn starts from what the reply kept and repeats only what they do not cover
        if d.moment == "chunk":
            state.reconstructed = d.carried
        elif not documents.may_reply(req):
            state.reconstructed = None
        elif d.moment == "prefill":
            state.reconstructed = d.carried
        elif state.reconstructed is not None:
            state.reconstructed = carry_through(state.reconstructed, d.selection)
        if outcome.units is not None:  # packed into the unit pool
            state.units, state.unit_lens, state.packed = outcome.units, d.selection.lengths, outcome.kept
        if self.trace:
            self.trace.write(req.rid, d.moment, d.policy.name, n, logical_len, state, outcome.kept, d.began_at)
        state.offset = logical_len - outcome.kept
        self.store.set_offset(row, state.offset)
        state.passes += 1
        state.skips = state.retry_at = 0
        self.store.trim_queries(row, outcome.kept)
        if outcome.freed:
            self._reopen_admission(batch)
        self.stats.passes += 1
        self.stats.staged_passes += int(d.staged)
        self.stats.evicted_tokens += n - outcome.kept
        self.stats.max_row_slots = max(self.stats.max_row_slots, n)
        setattr(self.stats, f"{d.moment}_passes", getattr(self.stats, f"{d.moment}_passes") + 1)
        if self.metrics:
            self.metrics.compressed(d.moment, n - outcome.kept)

    def _reopen_admission(self, batch: ScheduleBatch) -> None:
        """A compaction freed slots: let the scheduler try its waiting requests again. SGLang
        stops admitting once a request did not fit (`batch_is_full`) and reopens only when a
        request leaves; freed slots are the same news (sglang 0.5.23, `Scheduler
        .get_new_batch_prefill`). Without this, a request admitted while another's staged pass
        still held its whole prompt would keep the queue shut until that request finished."""
        for b in (batch, getattr(self.scheduler, "running_batch", None)):
            if b is not None and getattr(b, "batch_is_full", False):
                b.batch_is_full = False

    def _other_batches(self, batch: ScheduleBatch) -> tuple[ScheduleBatch, ...]:
        """The other running batch (read only by the invariant check)."""
        running = getattr(self.scheduler, "running_batch", None)
        return (running,) if running is not None and running is not batch else ()

    def account(self, seconds: float) -> float:
        """Time spent compressing: the step's total is the stall it caused the scheduler."""
        self.stats.seconds += seconds
        self._step_seconds += seconds
        self.stats.max_step_seconds = max(self.stats.max_step_seconds, self._step_seconds)
        if self.metrics:
            self.metrics.spent(seconds)
        return seconds

    def retracted(self, n: int) -> None:
        self.stats.retractions += n
        if self.metrics:
            self.metrics.retracted(n)

    def _layers(self) -> range:
        return range(self.first_layer, self.num_layers)


def _failed(outcome: Prepared | Exception | None) -> bool:
    return isinstance(outcome, Exception) and not isinstance(outcome, CompactionSkipped)


def _start_from(state: ReqKvState, doc: documents.Document, device: Any) -> None:
    """`state` of a row that starts with `doc`'s chain: what it reads next sits at logical
    positions D, D+1, ... KVzip: its next pass repeats only its context after the document, whose
    entries carry the scores the document's pass gave them (as its publisher's do after its cut).
    Before, every hit repeated the whole document in its own pass."""
    doc.start(state, device)
    state.fill_shift = True
    # A decode policy that keeps attention statistics (H2O, Batch-Max) has none for the
    # document's entries: their queries were read once, by the request that compressed it. They
    # start at 0 here, at the document's end, as each later entry does at its own position;
    # Batch-Max averages them over the queries since (`stats_since`).
    state.stats_since = doc.key.tokens
