"""A request's compression state, from its first forward to its release: made (`new_state`) and
begun before its first extend (`begin_extend`, `begin`), from a shared document where it starts
from one (`start_from`), replaced where it goes on from a document between two chunks of its prompt
(`state_from`, `set_state`), and forgotten when it gives its row back (`released`) or fails
(`drop`). Before each forward the observation store is told the batch's rows (`begin_extend`,
`begin_decode`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sgl_kvc.adapter import documents, kvc_req
from sgl_kvc.adapter.kvc_req import resolved
from sgl_kvc.adapter.kvzip.forwards import is_reconstruction
from sgl_kvc.adapter.safety import failpoints
from sgl_kvc.adapter.safety.failures import failure
from sgl_kvc.core.query_moments import QueryMoments
from sgl_kvc.core.request_state import ReqKvState
from sgl_kvc.policies import prompt_policy_error

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sgl_kvc.adapter.moments.host import Host
    from sgl_kvc.core.store import KvcStore


def new_state(comp: Host, req: Req) -> ReqKvState:
    """A fresh state for `req`, from its resolved settings (its policies, budget and selection)."""
    settings = resolved(req, comp.config)
    why = prompt_policy_error(settings.policy, settings.prompt_policy)
    if why is not None:  # the HTTP layer refuses it first; this guards the scheduler
        raise ValueError(why)
    return ReqKvState(
        policy=comp.policy(settings.policy, settings.budget.tokens), budget=settings.budget,
        selection=settings.selection, device=comp.store.device,
        prompt_policy=settings.prompt_policy_name,
    )


def begin_extend(comp: Host, batch: ScheduleBatch) -> None:
    """Before a prefill (chunk): give requests seen for the first time their state, and tell
    the observation store the batch's rows and the tables of its packed requests (host-side:
    no device sync in the forward). A reconstruction forward's rows are its requests' own: the
    store gets them and their tables, nothing else."""
    rows = [req.kv.req_pool_idx for req in batch.reqs]
    if is_reconstruction(batch):
        comp.store.begin_extend(rows, batch.seq_lens_cpu.tolist())
        return
    for req in batch.reqs:
        if kvc_req.of(req).state is None and not req.finished() and failure(req) is None:
            comp.failures.guarded(req, "start", begin, comp, req, getattr(batch, "tree_cache", None))
    comp.store.begin_extend(rows, batch.seq_lens_cpu.tolist())
    failpoints.observing(comp.store, batch.reqs, rows)


def begin(comp: Host, req: Req, tree_cache: Any = None) -> None:
    """`req`'s state, begun: its query moments where its prompt policy reads them, its row in the
    store, and, where it starts from a shared document, the document's entries and its budget
    beyond them."""
    state = new_state(comp, req)
    query_moments(comp, state)
    comp.store.begin(req.kv.req_pool_idx, state)
    doc = documents.plan_of(req).start
    if doc is not None:
        start_from(state, doc, comp.store.device)
        comp.store.set_offset(req.kv.req_pool_idx, state.offset)
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
    document_part = documents.plan_of(req).held_for_document
    if document_part:
        covers = doc.key.tokens if doc is not None else documents.plan_of(req).key.tokens
        state.budget = state.budget.beyond(document_part, covers)
    kvc_req.of(req).state = state


def state_from(comp: Host, req: Req, doc: documents.Document) -> ReqKvState:
    """The state `req` has once it goes on from `doc` between two chunks of its prompt
    (`extensions.adopt`): a new one, as a request's that started from `doc` (`begin`, its
    usage and the hit counted when it started). Nothing changes here (`set_state`)."""
    old = comp.state(req)
    state = new_state(comp, req)
    if old is not None and old.query_moments is not None:
        query_moments(comp, state)  # afresh, as a hit's: from the document's end
    start_from(state, doc, comp.store.device)
    state.budget = state.budget.beyond(doc.key.entries, doc.key.tokens)  # (as `begin`'s for a hit)
    return state


def set_state(comp: Host, req: Req, state: ReqKvState) -> None:
    """`req`'s row is the one `state` (`state_from`) describes now."""
    row = req.kv.req_pool_idx
    comp.store.begin(row, state)
    comp.store.set_offset(row, state.offset)
    kvc_req.of(req).state = state


def query_moments(comp: Host, state: ReqKvState) -> None:
    """The prompt's query moments for `state`, where its prompt policy reads them and a slot
    reserved for them is free."""
    prompt = comp.policy(state.policy_name("prefill"), state.budget.tokens)
    if prompt.uses_query_moments and comp.config.compressing:
        # Only such a request pays for them (the observation folds in each chunk's queries),
        # within the slots reserved for them in the KV memory (`adapter/memory/kv_memory.py`);
        # beyond, the policy scores its prompt from the observation window.
        if comp.moment_slots is not None and comp.store.moment_holders >= comp.moment_slots:
            comp.stats.moments_declined += 1
        else:
            state.query_moments = QueryMoments(
                comp.num_layers, prompt.params.sink_tokens, prompt.params.ea_covariance, prompt.prerope_queries,
            )


def begin_decode(comp: Host, batch: ScheduleBatch, fb: ForwardBatch) -> None:
    """Before a decode forward: the step's plan, from host-side data."""
    rows = [req.kv.req_pool_idx for req in batch.reqs]
    comp.store.begin_decode(rows, fb.seq_lens_cpu.tolist())  # a CPU tensor: no device sync
    failpoints.observing(comp.store, batch.reqs, rows)


def released(store: KvcStore, req: Req) -> None:
    """A request gave its row back (finished, aborted, retracted): drop what it held."""
    row = getattr(req.kv, "req_pool_idx", None)
    if row is not None:
        store.release(row)
    kvc_req.of(req).state = None


def drop(store: KvcStore, req: Req) -> None:
    """A failed request: sgl-kvc forgets it at once (its state, a staged pass, its observations),
    and its KV, which may be half moved, never enters the radix tree."""
    kvc_req.of(req).state = None
    row = getattr(req.kv, "req_pool_idx", None)
    if row is not None:
        store.release(row)
    req.skip_radix_cache_insert = True


def start_from(state: ReqKvState, doc: documents.Document, device: Any) -> None:
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
