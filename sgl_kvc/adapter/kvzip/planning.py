"""Planning a reconstruction pass: the instruction KVzip asks the model to repeat its context with
(`prompt_from_tokenizer`, from the chat template), and each due request's plan (`plan_pass`: the chunks
of its context to repeat, within a forward's room, and the scores they start from; for a cut's
question, `_plan_question`: its prompt's end after its row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sgl_kvc.adapter.kvc_req import resolved
from sgl_kvc.adapter.kvzip.limits import question_slots, reserve_tokens, unscorable
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.core.passes import pass_tables
from sgl_kvc.core.reconstruction import (
    OVERLAP,
    CarriedScores,
    ReconstructionPlan,
    ReconstructionPrompt,
    context_range,
    initial_scores,
    next_repeat,
    plan_question,
    plan_reconstruction,
    question_tokens,
)
from sgl_kvc.core.request_state import ReqKvState
from sgl_kvc.policies import Policy, policy_class

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler

    from sgl_kvc.config import KvcConfig
    from sgl_kvc.core.store import KvcStore

FIRST = "\n\nRepeat the previous context exactly."  # KVzip §3.2 / kvpress `prepare`
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


class Planner(Protocol):
    """What planning reads of the `Reconstructor` that runs the pass."""

    config: KvcConfig
    store: KvcStore

    def prompt(self, scheduler: Scheduler) -> ReconstructionPrompt: ...

    def positions(self, scheduler: Scheduler) -> int: ...

    def forward_bounds(self, scheduler: Scheduler, kvzip: bool = True) -> tuple[int, int]: ...


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
class Item:
    """One request's part of a moment's reconstruction: its plan, and the scores its forwards fold."""

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


def plan_pass(rec: Planner, scheduler: Scheduler, batch: ScheduleBatch, i: int, state: ReqKvState, moment: str,
              n: int | None = None) -> Item:
    """Request i's part of the pass (`moment`: prefill, chunk or question; `n`: the first n
    entries of its row only, else all of them). Raises where the request cannot be planned: it
    then fails alone (`Reconstructor.run`)."""
    req = batch.reqs[i]
    why = unscorable(req)
    if why is not None:  # never fed to a forward (refused at admission first)
        raise ValueError(why)
    failpoints.check("kvzip_plan_raise", req)
    row = req.kv.req_pool_idx
    n = int(batch.seq_lens_cpu[i]) if n is None else n
    length = state.logical_len(n)
    if moment == "question":
        return _plan_question(rec, i, req, state, row, n, length)
    prompt = rec.prompt(scheduler)
    ids = req.origin_input_ids
    sink = rec.config.sink_tokens
    start, end = context_range(ids, length, prompt, sink, prompt_read=moment == "prefill")
    compacted = state.packed if state.packed_entries is not None else (
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
    room = min(reserve_tokens(rec.config, req), rec.store.req_to_token.shape[1] - prefix,
               rec.positions(scheduler) - end, rec.forward_bounds(scheduler)[0])
    plan = plan_reconstruction(ids, start, end, prompt, resume=resume, repeated=repeated,
                               chunk=rec.config.kvzip_chunk, overlap=OVERLAP, sink_tokens=sink,
                               max_tokens=room, whole_row=whole_row)  # fmt: skip
    scores = _initial(rec, state, row, n, start, end, carried, policy_class(state.policy_name(moment)))
    return Item(i, req, state, row, plan, prefix, scores)


def _plan_question(rec: Planner, i: int, req: Any, state: ReqKvState, row: int, n: int, length: int) -> Item:
    """The forward of the question of a request cut between its chunks: its prompt's end
    (`question_tokens`) after the `n` entries of its row, at logical positions `length`..."""
    ids = req.origin_input_ids
    tokens = min(question_tokens(len(ids), length, rec.config.kv_window),
                 question_slots(rec.config, resolved(req, rec.config), len(ids)),
                 rec.store.req_to_token.shape[1] - n)
    return Item(i, req, state, row, plan_question(ids, length, tokens), n, [], question=True)


def _initial(rec: Planner, state: ReqKvState, row: int, n: int, start: int, end: int,
             carried: CarriedScores | None, policy: type[Policy]) -> list[torch.Tensor]:
    """Per layer of the rank, [H_kv, W] in the columns of the pass to come (of `policy`): 0
    for the context, +inf elsewhere, and what earlier passes gave the entries they kept."""
    store = rec.store
    layers = store.num_layers - store.first_layer
    tables = pass_tables(store, rec.config.kv_head_budget, policy, state, store.req_to_token[row, :n])
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
