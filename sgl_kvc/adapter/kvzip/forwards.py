"""The forwards of a reconstruction pass, prepared and run by SGLang: each round's chunk of every
request in it is one extend forward (`run_forward`) of short-lived `Req`s (`shadow_request`) whose
rows are the requests' own, turned into a `ForwardBatch` and run by the model runner. While it
runs, the attention observer folds each layer's queries into the request's scores, or records a
question's as its window (`observe_reconstruction`), and records nothing else. Afterwards the
chunk's slots go back to the allocator and the rows are as they were. `ReconstructionStats`: what
the passes and their forwards ran and read.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import FailedOnAnotherRank
from sgl_kvc.adapter.safety.tp import RankVote, everywhere
from sgl_kvc.core.reconstruction import ReconstructionRound, RowReconstruction
from sgl_kvc.core.store import KvcStore

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

    from sgl_kvc.adapter.kvzip.planning import Item

logger = logging.getLogger(__name__)

SHADOW_ATTR = "_sgl_kvc_reconstruction"  # on a reconstruction forward's ScheduleBatch and Reqs


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


class Runner(Protocol):
    """What a forward reads of the `Reconstructor` that runs the pass."""

    store: KvcStore
    stats: ReconstructionStats
    vote: RankVote | None  # the tensor-parallel group's (None: one rank)


def is_reconstruction(batch: Any) -> bool:
    """Whether `batch` (a ScheduleBatch) is a reconstruction forward."""
    return bool(getattr(batch, SHADOW_ATTR, False))


def run_forward(rec: Runner, scheduler: Scheduler, items: list[Item], k: int) -> None:
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
                saved.append(rec.store.req_to_token[item.row, item.prefix : item.prefix + len(chunk.ids)].clone())
                round_.rows[item.row] = RowReconstruction(item.state, item.scores, chunk, item.plan.sink,
                                                          item.prefix, item, item.plan.whole_row, item.question)
            new = ScheduleBatch.init_new(
                shadows, scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator, scheduler.tree_cache,
                scheduler.model_config, False, scheduler.spec_algorithm,
            )
            setattr(new, SHADOW_ATTR, True)
            rec.store.reconstruction = round_
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
        if not _everywhere(rec.vote, error is None):
            for item in items:
                item.error = item.error or error or FailedOnAnotherRank(
                    "its reconstruction forward could not be prepared on another rank")
                item.dropped = True
            return
        if rec.vote is not None:
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
        rec.store.reconstruction = None
        rec.stats.score_seconds += round_.score_seconds
        rec.stats.forward_normalizers += round_.forward_normalizers
        for item, old in zip(items, saved):  # the rows as they were
            rec.store.req_to_token[item.row, item.prefix : item.prefix + old.numel()] = old
        if allocated is not None:
            scheduler.token_to_kv_pool_allocator.free(allocated)
            rec.stats.max_held_slots = max(rec.stats.max_held_slots, int(allocated.numel()))
    rec.stats.forwards += 1
    rec.stats.tokens += sum(len(item.plan.chunks[k].ids) for item in items)


def _everywhere(vote: RankVote | None, ok: bool) -> bool:
    """Whether `ok` holds on every rank (one vote; `ok` itself on one rank)."""
    return everywhere(vote, [ok])[0]


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
