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
`forward_slots`, which admission counts in the request's footprint; a round's requests are cut
into forwards within SGLang's tokens per prefill forward and the reserved keys (`limits.py`).

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

This module runs a moment's pass (`Reconstructor`: the ranks' votes, the rounds of forwards, the
scores handed to the pass); what a forward may read is `limits.py`, each request's plan
`planning.py`, and one forward, prepared and run by SGLang and observed layer by layer,
`forwards.py`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from sgl_kvc.adapter.kvc_req import resolved
from sgl_kvc.adapter.kvzip.forwards import ReconstructionStats, run_forward
from sgl_kvc.adapter.kvzip.limits import forward_groups, forward_limit, forward_slots, question_slots
from sgl_kvc.adapter.kvzip.planning import Item, plan_pass, prompt_from_tokenizer
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank
from sgl_kvc.adapter.safety.tp import RankVote, everywhere
from sgl_kvc.adapter.scheduling.requests import is_middle_chunk
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import OVERLAP, PassScores, ReconstructionPrompt, context_range, instruction_tokens
from sgl_kvc.core.store import KvcStore

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    from sgl_kvc.core.request_state import ReqKvState


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
        planned: dict[int, Item] = {}
        for i, state, moment, *length in due:
            req = batch.reqs[i]
            try:
                planned[i] = self._plan(scheduler, batch, i, state, moment, *length)
            except Exception as e:  # noqa: BLE001 - that request fails, alone
                fail(req, e)
        items = self._agreed(batch, [d[0] for d in due], planned, fail)
        tokens, entries = self.forward_bounds(scheduler, kvzip=any(not item.question for item in items))
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

    def _agreed(self, batch: ScheduleBatch, due: list[int], planned: dict[int, Item],
                fail: Callable[[Any, BaseException], None]) -> list[Item]:
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

    def _plan(self, scheduler: Scheduler, batch: ScheduleBatch, i: int, state: ReqKvState, moment: str,
              n: int | None = None) -> Item:
        """Request i's part of the pass (`planning.plan_pass`)."""
        return plan_pass(self, scheduler, batch, i, state, moment, n)

    def _forward(self, scheduler: Scheduler, items: list[Item], k: int) -> None:
        """Chunk k of each of `items` in one forward (`forwards.run_forward`)."""
        run_forward(self, scheduler, items, k)

    def forward_bounds(self, scheduler: Scheduler, kvzip: bool = True) -> tuple[int, int]:
        """(tokens, entries) one forward may read and attend to: SGLang's tokens per prefill
        forward (no fewer than the smallest forward: with a reconstruction (`kvzip`), an
        instruction and one context token, which need the tokenizer; else a question's token),
        and the entries whose keys were reserved."""
        limit = forward_limit(scheduler)
        smallest = instruction_tokens(self.prompt(scheduler), OVERLAP) + 1 if kvzip else 1
        tokens = max(limit, smallest) if limit is not None else 1 << 62
        entries = self.forward_entries or int(self.store.req_to_token.shape[1])
        return tokens, entries
