"""KVzip's reconstruction pass, run by SGLang inside the scheduler (docs/architecture.md,
"Reconstruction passes").

At a prompt moment (after prefill, between chunks) a request whose prompt policy reads a
reconstruction (`Policy.uses_reconstruction`: KVzip) is asked to repeat its context before its
pass chooses. Each chunk of the context is one extend forward that SGLang builds and runs as it
builds and runs a prefill: a short-lived `Req` per request, prefilled by SGLang's
`ScheduleBatch.prepare_for_extend` (its row is the request's own, its prefix the request's cached
entries up to the context's end, so nothing is copied; its chunk gets new slots from SGLang's
allocator), turned into a `ForwardBatch` and run by the model runner; the passes due in one moment
share the forwards of each round. While it runs, the attention observer folds each layer's queries
into the request's scores (`core/reconstruction.py`) and records nothing else. Afterwards the
chunk's slots go back to the allocator and the row is as it was: the pass leaves nothing allocated.

Memory: a forward holds, per request, one chunk of the context and its instruction: at most
`forward_slots`, which admission counts in the request's footprint (`sgl_kvc/footprint.py`). A
round's requests are cut into forwards (`forward_groups`) of at most SGLang's tokens per prefill
forward (`forward_limit`: the activations its memory slack is sized for; one forward of every due
request read sum(chunk + instruction) tokens, 32 requests over a cached 16K prefix far past the
chunked-prefill size) and of at most the entries whose keys `adapter/memory/kv_memory.py` reserves
(`forward_entries`: per layer, a CPU forward hands its fold every row's gathered keys).

The same forwards read a prompt's question at a cut between its chunks (`question_slots`,
`core/reconstruction.plan_question`): for a prompt policy that scores from its observation window
(SnapKV, R-KV, KV-Compress, Expected Attention), the prompt's end (its last `QUESTION_TOKENS`, at
most what is unread) is read after the entries its row holds, and the observer writes the last
`--kv-window` of its queries where the window's go (`KvcStore.record_extend`): the cut's pass then
chooses by the question, as the pass after the last chunk does, not by the last queries of a
chunk of context. Its slots are freed before the pass copies what it keeps; admission counts them
at every cut (`Sizes.question`).

Failures: an exception while a request's queries are folded fails that request; one while a
forward is prepared fails the requests of that forward; the others of the moment, and every other
request, go on. With tensor parallelism every rank must run the same forwards, whose model runs
collectives: the ranks vote on what they planned before the first forward and on what they
prepared before each (`RankVote`), so a request planned or prepared on one rank only fails on all
of them; an exception inside a forward's model run is never caught there (a rank that left the
forward would leave the others waiting in its collectives: the ranks fail together instead).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank
from sgl_kvc.adapter.safety.tp import RankVote, everywhere
from sgl_kvc.adapter.scheduling.requests import is_middle_chunk
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.passes import pass_tables
from sgl_kvc.core.reconstruction import (
    OVERLAP,
    CarriedScores,
    PassScores,
    ReconstructionPlan,
    ReconstructionPrompt,
    ReconstructionRound,
    RowReconstruction,
    context_range,
    initial_scores,
    instruction_tokens,
    next_repeat,
    plan_question,
    plan_reconstruction,
    question_tokens,
)
from sgl_kvc.core.request_state import ReqKvState
from sgl_kvc.core.store import KvcStore
from sgl_kvc.policies import Policy, policy_class
from sgl_kvc.request_settings import ResolvedCompression
from sgl_kvc.adapter.kvc_req import resolved

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Tokens of one reconstruction forward besides its chunk of the context: its instruction, the
# previous chunk's quoted tokens and the template's opening of an answer (SmolLM2: 30). A forward
# never reads more than `reserve_tokens`: a template whose text is longer shrinks the chunk.
RESERVE_HEAD = 64
SHADOW_ATTR = "_sgl_kvc_reconstruction"  # on a reconstruction forward's ScheduleBatch and Reqs

FIRST = "\n\nRepeat the previous context exactly."  # KVzip §3.2 / kvpress `prepare`
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


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


def is_reconstruction(batch: Any) -> bool:
    """Whether `batch` (a ScheduleBatch) is a reconstruction forward."""
    return bool(getattr(batch, SHADOW_ATTR, False))


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


def prompt_from_tokenizer(tokenizer: Any) -> ReconstructionPrompt:
    """The instruction ids and the chat template's text around a user's message, as kvpress
    `KVzipPress` takes them: a dummy message rendered with the template, split at it."""
    if tokenizer is None:
        raise RuntimeError("a reconstruction pass needs the model's tokenizer (not with --skip-tokenizer-init)")
    if getattr(tokenizer, "chat_template", None) is None:
        system, suffix = "", "\n"  # kvpress's default for a model without a chat template
    else:
        dummy = "dummy context"
        separator = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": dummy + separator}], add_generation_prompt=True, tokenize=False,
            enable_thinking=False,
        )
        context, suffix = text.split(separator)
        system = context.split(dummy)[0]

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False)) if text else ()

    return ReconstructionPrompt(system=ids(system), suffix=ids(suffix), first=ids(FIRST), later=ids(LATER))


@dataclass
class ReconstructionStats:
    passes: int = 0  # requests whose context was repeated before a pass chose
    forwards: int = 0  # reconstruction forwards run (each one chunk of one or more requests)
    tokens: int = 0  # tokens those forwards read
    context_tokens: int = 0  # context tokens repeated
    seconds: float = 0.0  # spent in them, folding the scores included
    score_seconds: float = 0.0  # of which folding the queries into the scores
    forward_normalizers: int = 0  # folds (request x layer) whose softmax normalizer the forward computed
    questions: int = 0  # cuts between chunks whose window was their question's (`plan_question`)
    max_held_slots: int = 0  # the most slots one forward held (its tokens; the memory admission reserves)


@dataclass
class _Item:
    i: int  # index in the batch
    req: Any
    state: ReqKvState
    row: int
    plan: ReconstructionPlan
    prefix: int  # physical entries of the row the forward attends to
    scores: list[torch.Tensor]
    error: BaseException | None = None
    dropped: bool = False  # its forward was not run (on every rank alike): it reads no later chunk
    question: bool = False  # a question's forward: its queries become the row's window, no scores


@dataclass
class Reconstructor:
    """Runs the reconstruction passes of one scheduler process (one per `Compressor`)."""

    config: KvcConfig
    store: KvcStore
    stats: ReconstructionStats = field(default_factory=ReconstructionStats)
    # The tensor-parallel group's vote (None: one rank), the compressor's `FailureLedger.vote`.
    vote: RankVote | None = None
    # Entries one forward may attend to in all (its rows' prefixes and chunks): the keys
    # `adapter/memory/kv_memory.py` reserved for them (None: no reservation ran; the widest row).
    forward_entries: int | None = None
    _prompt: ReconstructionPrompt | None = None
    _positions: int | None = None

    def prompt(self, scheduler: Scheduler) -> ReconstructionPrompt:
        if self._prompt is None:
            self._prompt = prompt_from_tokenizer(getattr(scheduler, "tokenizer", None))
        return self._prompt

    def positions(self, scheduler: Scheduler) -> int:
        """The positions the model encodes: its rotary tables' length (the shortest, where it has
        several), else its context length. A reconstruction forward reads its tokens at the
        positions after the context, so its last one must stay below it."""
        if self._positions is None:
            model = scheduler.tp_worker.model_runner.model
            tables = [int(m.cos_sin_cache.shape[0]) for m in model.modules()
                      if isinstance(getattr(m, "cos_sin_cache", None), torch.Tensor)]
            self._positions = min(tables) if tables else int(scheduler.model_config.context_len)
        return self._positions

    def refusal(self, scheduler: Scheduler, ids: Sequence[int]) -> str | None:
        """Why a prompt of `ids` cannot have its context repeated (a 400 at admission), or None:
        the smallest forward (its instruction and one context token) must fit in the positions
        after the context."""
        prompt = self.prompt(scheduler)
        _, end = context_range(ids, len(ids), prompt, self.config.sink_tokens, prompt_read=True)
        need = instruction_tokens(prompt, OVERLAP) + 1
        limit = self.positions(scheduler)
        if end + need <= limit:
            return None
        over = end + need - limit
        return (f"prompt_policy 'kvzip' repeats the prompt's context after it, which needs {need} positions "
                f"after the context; this prompt leaves {max(0, limit - end)} of the model's {limit}: shorten "
                f"it by at least {over} token{'s' if over > 1 else ''}, or use another prompt_policy")

    def must_agree(self, batch: ScheduleBatch) -> bool:
        """Whether the ranks vote on this batch's reconstructions even where a rank has none due:
        with tensor parallelism, whenever a request of the batch asks for one (its settings,
        which every rank reads alike). A rank on which such a request was skipped (its state
        failed to start, say) still takes part, so that the others do not wait for it."""
        if self.vote is None:
            return False
        for req in batch.reqs:
            try:
                settings, prompt = resolved(req, self.config), len(req.origin_input_ids)
                # a question's forward comes only at a cut between chunks
                if forward_slots(self.config, settings, prompt) or (
                        question_slots(self.config, settings, prompt) and is_middle_chunk(batch, req)):
                    return True
            except Exception:  # noqa: BLE001 - the same on every rank: vote
                return True
        return False

    def run(
        self, scheduler: Scheduler, batch: ScheduleBatch, due: list[tuple[Any, ...]],
        fail: Callable[[Any, BaseException], None],
    ) -> None:
        """Repeat the context of each request `due` ((index in `batch`, state, moment: prefill or
        chunk[, n: the first n entries of its row only, a shared document])); its scores go to
        `state.reconstruction` for the moment's pass. Moment `question`: read the prompt's question
        after its row instead, whose queries become its window. A request that fails is handed to `fail`.
        With tensor parallelism every rank calls it where `must_agree` (or with the same `due`)."""
        if not due and not self.must_agree(batch):
            return
        t0 = time.perf_counter()
        planned: dict[int, _Item] = {}
        for i, state, moment, *length in due:
            req = batch.reqs[i]
            try:
                planned[i] = self._plan(scheduler, batch, i, state, moment, *length)
            except Exception as e:  # noqa: BLE001 - that request fails, alone
                fail(req, e)
        items = self._agreed(batch, [d[0] for d in due], planned, fail)
        tokens, entries = self._forward_bounds(scheduler, kvzip=any(not item.question for item in items))
        rounds = max((len(item.plan.chunks) for item in items), default=0)
        for k in range(rounds):
            # Every request with a k-th chunk, in forwards within the bounds (TP ranks run the
            # same ones: the plans come from host data every rank shares, and were voted on).
            part = [item for item in items if k < len(item.plan.chunks) and not item.dropped]
            sizes = [(len(item.plan.chunks[k].ids), item.prefix + len(item.plan.chunks[k].ids)) for item in part]
            for group in forward_groups(sizes, tokens, entries):
                self._forward(scheduler, [part[j] for j in group], k)
        for item in items:
            if item.error is not None:
                fail(item.req, item.error)
                continue
            if item.question:
                self.stats.questions += 1
                continue
            item.state.reconstruction = PassScores(item.scores, item.plan.end, item.plan.repeated)
            self.stats.passes += 1
            self.stats.context_tokens += sum(c.end - c.start for c in item.plan.chunks)
        self.stats.seconds += time.perf_counter() - t0

    def _agreed(self, batch: ScheduleBatch, due: list[int], planned: dict[int, _Item],
                fail: Callable[[Any, BaseException], None]) -> list[_Item]:
        """The planned items every rank planned, in `due`'s order; one planned here but not on
        another rank (its plan failed there, or it was skipped there) fails here too. One vote
        (a small all-reduce over the TP group's CPU group) before any forward; none on one rank."""
        if self.vote is None:
            return [planned[i] for i in due if i in planned]
        planned_everywhere = everywhere(self.vote, [i in planned for i in range(len(batch.reqs))])
        items = []
        for i in due:
            if i not in planned:
                continue
            if planned_everywhere[i]:
                items.append(planned[i])
            else:
                fail(batch.reqs[i], FailedOnAnotherRank("its reconstruction was not planned on another rank"))
        return items

    def _everywhere(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (one vote; `ok` itself on one rank)."""
        return everywhere(self.vote, [ok])[0]

    def _forward_bounds(self, scheduler: Scheduler, kvzip: bool = True) -> tuple[int, int]:
        """(tokens, entries) one forward may read and attend to: SGLang's tokens per prefill
        forward (no fewer than the smallest forward: with a reconstruction (`kvzip`), an
        instruction and one context token, which need the tokenizer; else a question's token),
        and the entries whose keys were reserved."""
        limit = forward_limit(scheduler)
        smallest = instruction_tokens(self.prompt(scheduler), OVERLAP) + 1 if kvzip else 1
        tokens = max(limit, smallest) if limit is not None else 1 << 62
        entries = self.forward_entries or int(self.store.req_to_token.shape[1])
        return tokens, entries

    # --- planning -----------------------------------------------------------------------------
    def _plan(self, scheduler: Scheduler, batch: ScheduleBatch, i: int, state: ReqKvState, moment: str,
              n: int | None = None) -> _Item:
        req = batch.reqs[i]
        why = unscorable(req)
        if why is not None:  # never fed to a forward (refused at admission first)
            raise ValueError(why)
        failpoints.check("kvzip_plan_raise", req)
        row = req.kv.req_pool_idx
        n = int(batch.seq_lens_cpu[i]) if n is None else n
        length = state.logical_len(n)
        if moment == "question":
            return self._plan_question(i, req, state, row, n, length)
        prompt = self.prompt(scheduler)
        ids = req.origin_input_ids
        sink = self.config.sink_tokens
        start, end = context_range(ids, length, prompt, sink, prompt_read=moment == "prefill")
        compacted = state.packed if state.units is not None else (
            0 if state.kept_positions is None else int(state.kept_positions.shape[-1]))
        if end - state.offset < compacted:  # the context ends among compacted entries: all of it
            end = length
        prefix = end - state.offset
        carried: CarriedScores | None = state.reconstructed
        resume, whole_row = next_repeat(carried, end, len(ids), last=moment == "prefill")
        repeated = carried.repeated if carried is not None else 0
        if resume is None:  # repeated whole: its own scores only
            carried = None
        # a forward's room: what admission reserved, its row's end, the model's positions and
        # SGLang's tokens per prefill forward (its chunk shrinks to fit)
        room = min(reserve_tokens(self.config, req), self.store.req_to_token.shape[1] - prefix,
                   self.positions(scheduler) - end, self._forward_bounds(scheduler)[0])
        plan = plan_reconstruction(ids, start, end, prompt, resume=resume, repeated=repeated,
                                   chunk=self.config.kvzip_chunk, overlap=OVERLAP, sink_tokens=sink,
                                   max_tokens=room, whole_row=whole_row)  # fmt: skip
        scores = self._initial(state, row, n, start, end, carried, policy_class(state.policy_name(moment)))
        return _Item(i, req, state, row, plan, prefix, scores)

    def _plan_question(self, i: int, req: Any, state: ReqKvState, row: int, n: int, length: int) -> _Item:
        """The forward of the question of a request cut between its chunks: its prompt's end
        (`question_tokens`) after the `n` entries of its row, at logical positions `length`..."""
        ids = req.origin_input_ids
        tokens = min(question_tokens(len(ids), length, self.config.kv_window),
                     question_slots(self.config, resolved(req, self.config), len(ids)),
                     self.store.req_to_token.shape[1] - n)
        return _Item(i, req, state, row, plan_question(ids, length, tokens), n, [], question=True)

    def _initial(self, state: ReqKvState, row: int, n: int, start: int, end: int,
                 carried: CarriedScores | None, policy: type[Policy]) -> list[torch.Tensor]:
        """Per layer of the rank, [H_kv, W] in the columns of the pass to come (of `policy`): 0
        for the context, +inf elsewhere, and what earlier passes gave the entries they kept."""
        store = self.store
        layers = store.num_layers - store.first_layer
        tables = pass_tables(store, self.config.kv_head_budget, policy, state, store.req_to_token[row, :n])
        if tables is not None:  # the pass reads the request through its per-head tables
            width = tables.width
            cols = torch.arange(width, device=tables.units.device)
            valid = cols[None, None, :] < tables.lens[..., None]
            positions = tables.positions
        else:
            positions = state.positions(n)
            positions = positions.expand(layers, store.kv_heads, n) if positions.dim() == 1 else positions
            valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        out = []
        for local in range(layers):
            scores = initial_scores(positions[local], valid[local], start, end)
            if carried is not None:
                kept = carried.layers[local]  # [H_kv, k]: the entries the last compaction kept, first
                k = min(kept.shape[-1], scores.shape[-1])
                head_len = carried.lengths[local] if carried.lengths is not None else None
                earlier = torch.ones_like(kept[:, :k], dtype=torch.bool) if head_len is None else (
                    torch.arange(k, device=kept.device)[None, :] < head_len[:, None])
                scores[:, :k] = torch.where(earlier & valid[local][:, :k], kept[:, :k], scores[:, :k])
            out.append(scores)
        return out

    # --- one forward ----------------------------------------------------------------------------
    def _forward(self, scheduler: Scheduler, items: list[_Item], k: int) -> None:
        """Chunk k of each of `items` in one extend forward that SGLang prepares and runs."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        # A request whose scoring failed in an earlier chunk still reads its chunk here (its
        # scores are no longer folded): with tensor parallelism every rank runs the same forwards,
        # whose collectives would otherwise wait for a rank that left it out.
        saved: list[torch.Tensor] = []
        allocated = error = fb = None
        round_ = ReconstructionRound({})
        try:
            try:
                shadows = []
                for item in items:
                    chunk = item.plan.chunks[k]
                    shadows.append(shadow_request(item.req, item.row, item.prefix, chunk.ids,
                                                  scheduler.model_config.vocab_size))
                    saved.append(self.store.req_to_token[item.row, item.prefix : item.prefix + len(chunk.ids)].clone())
                    round_.rows[item.row] = RowReconstruction(item.state, item.scores, chunk, item.plan.sink,
                                                              item.prefix, item, item.plan.whole_row, item.question)
                new = ScheduleBatch.init_new(
                    shadows, scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator, scheduler.tree_cache,
                    scheduler.model_config, False, scheduler.spec_algorithm,
                )
                setattr(new, SHADOW_ATTR, True)
                self.store.reconstruction = round_
                new.prepare_for_extend()
                allocated = new.out_cache_loc
                if new.input_ids is None:
                    new.input_ids = new.prefill_input_ids_cpu.to(new.device)
                    new.prefill_input_ids_cpu = None
                fb = ForwardBatch.init_new(new, scheduler.tp_worker.model_runner,
                                           return_hidden_states_before_norm=False)
            except Exception as e:  # noqa: BLE001 - before the model runs: voted on below
                logger.exception("sgl-kvc: a reconstruction forward could not be prepared")
                error = e
            # Every rank prepared it, or none runs it (the model's collectives need all of them).
            if not self._everywhere(error is None):
                for item in items:
                    item.error = item.error or error or FailedOnAnotherRank(
                        "its reconstruction forward could not be prepared on another rank")
                    item.dropped = True
                return
            if self.vote is not None:
                # The model runs collectives: an exception here is never swallowed. The rank
                # that raises stops (SGLang's scheduler ends the server), where going on would
                # leave the other ranks waiting for it in a collective, or run different forwards.
                scheduler.tp_worker.model_runner.forward(fb)
            else:
                try:
                    scheduler.tp_worker.model_runner.forward(fb)
                except Exception as e:  # noqa: BLE001 - one rank: the forward's requests fail, the others go on
                    logger.exception("sgl-kvc: a reconstruction forward failed")
                    for item in items:
                        item.error = item.error or e
                        item.dropped = True
        finally:
            self.store.reconstruction = None
            self.stats.score_seconds += round_.score_seconds
            self.stats.forward_normalizers += round_.forward_normalizers
            for item, old in zip(items, saved):  # the rows as they were
                self.store.req_to_token[item.row, item.prefix : item.prefix + old.numel()] = old
            if allocated is not None:
                scheduler.token_to_kv_pool_allocator.free(allocated)
                self.stats.max_held_slots = max(self.stats.max_held_slots, int(allocated.numel()))
        self.stats.forwards += 1
        self.stats.tokens += sum(len(item.plan.chunks[k].ids) for item in items)


def shadow_request(req: Any, row: int, prefix: int, ids: Sequence[int], vocab_size: int) -> Req:
    """The short-lived SGLang `Req` that reads `ids` in `req`'s row after its first `prefix`
    entries (a reconstruction forward's part for `req`). It runs with `req`'s LoRA adapter
    (`lora_id`, which `ForwardBatch.init_new` hands the LoRA manager per request): KVzip scores a
    request by the model that answers it, base weights and adapter both."""
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo

    fill = array("q", [0] * prefix)
    fill.extend(ids)
    shadow = Req(rid=f"{req.rid}:reconstruction", origin_input_text="", origin_input_ids=fill,
                 sampling_params=req.sampling_params, vocab_size=vocab_size,
                 lora_id=getattr(req, "lora_id", None))
    shadow.full_untruncated_fill_ids = fill
    shadow.prefix_len, shadow.extend_end = prefix, len(fill)
    shadow.logprob_start_len = -1
    # The request's own row: its first `prefix` entries are the forward's prefix, as a chunked
    # prefill's earlier chunks are; SGLang writes the chunk's new slots after them.
    shadow.kv = ReqKvInfo(req_pool_idx=row, cache_protected_len=prefix, kv_committed_len=prefix,
                          kv_allocated_len=max(prefix, 1))
    setattr(shadow, SHADOW_ATTR, True)
    return shadow


def observe_reconstruction(store: KvcStore, q: torch.Tensor, layer: Any, fb: Any) -> None:
    """A reconstruction forward's layer: fold each row's queries into its scores (a question's:
    record them as the row's window). What fails for a row fails that request (recorded on its
    item), not the forward."""
    round_ = store.reconstruction
    t0 = time.perf_counter()
    h_q, d = layer.tp_q_head_num, layer.qk_head_dim
    q = q.reshape(-1, h_q, d)
    start = 0
    for row, e in zip(store.extend_rows, fb.extend_seq_lens_cpu):
        qi = q[start : start + e]
        start += e
        entry = round_.rows.get(row)
        if entry is None or entry.owner.error is not None:
            continue
        try:
            failpoints.check("reconstruct_raise", entry.owner.req)
            if entry.question:
                store.record_extend(layer.layer_id, row, qi, store.req_to_token.shape[0])
            else:
                round_.fold(store, layer.layer_id, row, qi, layer.scaling)
        except Exception as err:  # noqa: BLE001
            entry.owner.error = err
    round_.score_seconds += time.perf_counter() - t0
