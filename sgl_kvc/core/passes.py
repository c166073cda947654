"""Per-head passes: score a request's cache per (layer, KV head), choose what each keeps, and
carry the policy's statistic over to the kept entries. A pass that costs more than a step's work
(`--kv-pass-work`) is staged over several scheduler steps.

Per-head selection makes staging exact: a head's choice depends on no other head or layer, and
the window queries are taken when the pass begins, as a one-step pass would read them. Entries
appended while a pass is under way (the tail) are kept by every head.

Two engines, one per budget mode:
* uniform (`advance_uniform`): every (layer, KV head) keeps `target` entries; whole layers are
  scored where they fit in the step's work, else one KV head at a time;
* variable / layer (`advance_variable`, KV-Compress §4.2): one (layer, KV head) at a time from
  its own table (heads of a packed request hold different numbers of entries); once all have
  scored, ONE sort over layer x head x entry chooses (`select_from_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from sgl_kvc.core.reconstruction import CarriedScores, PassScores, carry_scores
from sgl_kvc.core.request_state import ReqKvState, RequestTables
from sgl_kvc.core.store import KvcStore
from sgl_kvc.core.views import prompt_moments, prompt_reconstruction, request_view, with_gaps
from sgl_kvc.policies import (
    HeadSelection, LayerView, Policy, carry_stats_per_head, select_from_scores, select_per_head, token_scores,
)


@dataclass
class StepWork:
    """Compression work one pass may spend in the current scheduler step, in cost units (one
    cached token scored in one layer by a linear-cost policy, `Policy.score_cost`). A pass
    always makes progress: the first (layer, head) of a step runs whatever it costs."""

    allowance: int
    spent: int = 0

    @classmethod
    def unlimited(cls) -> "StepWork":
        return cls(allowance=1 << 62)

    def fits(self, cost: int) -> bool:
        return self.spent + cost <= self.allowance

    def allows(self, cost: int) -> bool:
        """Whether a (layer, head) of this cost may run now: it fits, or nothing ran yet."""
        return self.spent == 0 or self.fits(cost)

    def spend(self, cost: int) -> None:
        self.spent += cost


@dataclass
class PendingPass:
    """A per-head pass of one request: the n0 entries it held when the pass began, scored
    layer by layer (uniform) or (layer, head) by (layer, head) (variable) until all chose."""

    moment: str
    policy: Policy
    n0: int
    target: int
    positions: Tensor  # [n0], or [L, H_kv, n0] after an earlier per-head compaction
    queries: list[Tensor | None]  # the window queries of each layer of this rank, at the start
    # the prompt's query moments (mean, covariance) of each layer of this rank, at the start, for
    # a prompt moment of a policy that reads them (`views.prompt_moments`); None otherwise
    moments: list[tuple[Tensor | None, Tensor | None]] | None = None
    # the reconstruction scores of this rank's layers (`PassScores`), for a prompt moment of a
    # policy that reads them (`views.prompt_reconstruction`); None otherwise
    reconstruction: PassScores | None = None
    indices: list[Tensor] = field(default_factory=list)  # per layer done: [H_kv, target]
    heads: list[Tensor] = field(default_factory=list)  # of the next layer, done: [target]
    steps: int = 0  # scheduler steps it has run in
    # Variable budgets (unit pool): the per-head tables the pass scores, and the scores and
    # protected masks of the (layer, head)s done, in (layer, head) order; one sort at the end.
    # Uniform budgets, a `global_sort` policy: the scores and protected masks of the layers done.
    tables: RequestTables | None = None
    scores: list[Tensor] = field(default_factory=list)
    protected: list[Tensor] = field(default_factory=list)
    # Entries every head keeps, the first `held` (uniform) or `held_lens[l, h]` of each head's
    # table (variable): a document extended by another is kept as it is, only what extends it is
    # chosen, `target` of its entries per head (`adapter/documents/turns.py`).
    held: int = 0
    held_lens: Tensor | None = None

    @property
    def staged(self) -> bool:
        """Whether it ran over more than one scheduler step."""
        return self.steps > 1

    def tensors(self) -> list[Tensor]:
        """What it holds (for the store's byte count)."""
        held = [self.positions, *self.indices, *self.heads, *self.scores, *self.protected]
        held += [q for q in self.queries if q is not None]
        if self.moments is not None:
            held += [t for pair in self.moments for t in pair if t is not None]
        if self.reconstruction is not None:
            held += self.reconstruction.tensors()
        if self.tables is not None:
            held += [self.tables.units, self.tables.lens, self.tables.positions]
        return held


@dataclass
class DueCompaction:
    """A finished per-head selection, compacted together with the step's others."""

    i: int  # index in the batch
    state: ReqKvState
    policy: Policy
    moment: str
    selection: HeadSelection
    kept_positions: Tensor  # [L, H_kv, k]
    stats: list[Tensor | None] | None  # carried statistics (policies that keep them)
    began_at: int
    staged: bool
    units: Tensor | None = None  # the request's tables [L, H_kv, N] (variable budgets)
    n: int = 0  # the request's row length (slots) when it was selected; 0: selection.n (no tables)
    # between chunks, what it keeps of its pass's reconstruction scores (`CarriedScores`)
    carried: CarriedScores | None = None


def start_pass(
    store: KvcStore, row: int, state: ReqKvState, policy: Policy, n: int, target: int, moment: str,
    tables: RequestTables | None, held: int = 0,
) -> PendingPass:
    """A new pass over the request's n entries (`tables`: its per-head tables on the unit pool).
    `held`: its first `held` entries, which every head keeps among its `target`; on the unit pool
    (`held` = its packed slots) each head's packed entries (`ReqKvState.unit_lens`), and the pass
    allocates `target` per head among the rest."""
    held_lens = None
    if held and tables is not None:
        if state.unit_lens is None or held != state.packed:
            raise ValueError("on the unit pool a pass holds the request's packed entries")
        held_lens = state.unit_lens.to(tables.lens.device, torch.int64)
    return PendingPass(
        moment=moment, policy=policy, n0=n, target=min(target, n), held=held, held_lens=held_lens,
        positions=state.positions(n) if tables is None else tables.positions,
        queries=store.window_queries(row, n), tables=tables,
        moments=prompt_moments(store, state, policy, moment),
        reconstruction=prompt_reconstruction(state, policy, moment),
    )


def advance(
    store: KvcStore, row: int, state: ReqKvState, n: int, work: StepWork, mode: str, i: int = 0,
) -> DueCompaction | None:
    """Score what `work` allows of the request's pending pass: `advance_variable` where it reads
    per-head tables (the unit pool, `mode` its `--kv-head-budget`), else `advance_uniform`."""
    if state.pending.tables is not None:
        return advance_variable(store, row, state, n, work, mode, i)
    return advance_uniform(store, row, state, n, work, i)


def advance_uniform(
    store: KvcStore, row: int, state: ReqKvState, n: int, work: StepWork, i: int = 0,
) -> DueCompaction | None:
    """Score what `work` allows of the request's pending uniform pass: whole layers, or one KV
    head at a time where a layer does not fit. Once every (layer, KV head) has chosen, returns
    the compaction due (n: the entries the request holds now). One layer's keys are held at a
    time. Each TP rank holds whole KV heads and chooses for its own. A `Policy.global_sort` policy
    scores whole layers and, once all have scored, sorts the tokens once by their mean score
    (`token_scores`): every head keeps the same tokens."""
    p = state.pending
    p.steps += 1
    layers = list(range(store.first_layer, store.num_layers))
    layer_cost = p.policy.score_cost(p.n0)
    head_cost = -(-layer_cost // store.kv_heads)
    if p.policy.global_sort:  # one sort over every head, which every head must follow alike
        while len(p.scores) < len(layers) and work.allows(layer_cost):
            view = _layer_view(store, row, state, p, layers, len(p.scores))
            p.scores.append(p.policy.score(view))
            p.protected.append(_held(p, p.policy.protected(view).to(p.scores[-1].device).expand_as(p.scores[-1])))
            work.spend(layer_cost)
        if len(p.scores) == len(layers):
            scores = token_scores(torch.stack(p.scores), p.positions)
            p.indices = list(select_from_scores(scores, torch.stack(p.protected), p.target).indices)
    else:
        while len(p.indices) < len(layers):
            whole_layer = not p.heads and work.fits(layer_cost)
            if not (whole_layer or work.allows(head_cost)):
                break
            view = _layer_view(store, row, state, p, layers, len(p.indices))
            if whole_layer:
                p.indices.append(_choose(p, view).indices[0])
                work.spend(layer_cost)
                continue
            sub = view.head(len(p.heads))
            p.heads.append(_choose(p, sub).indices[0, 0])
            work.spend(head_cost)
            if len(p.heads) == view.n_kv_heads:
                p.indices.append(torch.stack(p.heads))
                p.heads = []
    if len(p.indices) < len(layers):
        return None
    state.pending = None
    indices = torch.stack(p.indices)  # [L, H_kv, target] over the first n0 entries
    if n > p.n0:  # the tail appended since the pass began: every head keeps it
        tail = torch.arange(p.n0, n, device=indices.device)
        indices = torch.cat([indices, tail.expand(*indices.shape[:2], n - p.n0)], dim=-1)
    lengths = torch.full(indices.shape[:2], indices.shape[-1], dtype=torch.int64, device=indices.device)
    selection = HeadSelection(indices=indices, lengths=lengths, n=n)
    positions = state.positions(n)
    stats = None
    if state.policy.uses_stats:  # the decode policy's statistic, whichever policy chose
        stats = with_gaps(store.first_layer, carry_stats_uniform(store, row, state, state.policy, selection, n, positions))
    full = positions.expand(selection.num_layers, selection.num_heads, n)
    return DueCompaction(
        i=i, state=state, policy=p.policy, moment=p.moment, selection=selection,
        kept_positions=full.gather(-1, indices.to(full.device)), stats=stats, began_at=p.n0,
        staged=p.staged, carried=_carried(p, selection, per_head_lengths=False),
    )


def _held(p: PendingPass, protected: Tensor) -> Tensor:
    """`protected` [..., n0] with the pass's held entries too."""
    if not p.held:
        return protected
    protected = protected.clone()
    protected[..., : p.held] = True
    return protected


def _choose(p: PendingPass, view: LayerView) -> HeadSelection:
    """Each head's `p.target` entries of one layer's `view` (its policy's choice, and the held)."""
    if not p.held:
        return select_per_head(p.policy, [view], p.target)
    scores = p.policy.score(view)
    protected = _held(p, p.policy.protected(view).to(scores.device).expand_as(scores))
    return select_from_scores(scores[None], protected[None], p.target)


def _layer_view(store: KvcStore, row: int, state: ReqKvState, p: PendingPass, layers: list[int], layer: int) -> LayerView:
    """The uniform pass's view of its `layer`-th layer, as the pass began."""
    return request_view(store, row, layers[layer], state, n=p.n0, positions=p.positions,
                        queries=p.queries[layer], values=p.policy.uses_values,
                        moments=(None, None) if p.moments is None else p.moments[layer],
                        reconstruction=None if p.reconstruction is None else p.reconstruction.layers[layer])


def allocation(policy: Policy, mode: str) -> str:
    """How a pass of `policy` on a unit-pool server in `mode` (`--kv-head-budget policy`,
    `variable` or `layer`) allocates the request's entries: "variable", one sort over layer x head
    x entry, for scores made for it (`Policy.global_sort` on any of them, `Policy.variable_sort`
    under variable); "layer" otherwise, each layer keeping its share (Ada-KV)."""
    if policy.global_sort or (mode == "variable" and policy.variable_sort):
        return "variable"
    return "layer"


def packs(store: KvcStore, mode: str, policy: Policy | type[Policy], state: ReqKvState) -> bool:
    """The packing rule, for every pass: a request's own (`Compressor`), a document's and an
    extension's (`adapter/documents/`), and KVzip's reconstruction laying out its scores for the
    pass to come. Whether a pass of `policy` over a request (`state`) on a server whose KV is
    `store`, `mode` its `--kv-head-budget`, reads the request through per-head tables and packs
    what it keeps; else it keeps the same number in every head, in the request's row, as on a
    uniform server, and the request decodes as fast. Only on the unit pool: under `variable` and
    `layer` every pass packs; under `policy` a policy whose scores are sorted once over every head
    (KVzip), and a request packed once stays packed (its heads hold different numbers). A node a
    pass publishes is therefore laid out as a request starting from it goes on (`Document.start`):
    a chain of one document's turns is packed throughout or nowhere."""
    if store.unit_layout is None:
        return False
    return mode != "policy" or policy.global_sort or state.packed_entries is not None


def pass_tables(store: KvcStore, mode: str, policy: Policy | type[Policy], state: ReqKvState,
                slots: Tensor) -> RequestTables | None:
    """The per-head tables over the request's row (`slots`) a pass reads where it packs
    (`packs`), else None."""
    if not packs(store, mode, policy, state):
        return None
    return state.tables(slots, *store.unit_layout)


def advance_variable(
    store: KvcStore, row: int, state: ReqKvState, n: int, work: StepWork, mode: str, i: int = 0,
) -> DueCompaction | None:
    """`advance_uniform` for variable budgets (KV-Compress §4.2, `mode` variable or layer):
    score one (layer, KV head) at a time, each from its own entries, as work allows; once all
    have scored, the policy's allocation (`allocation`) chooses what the request keeps."""
    p = state.pending
    mode = allocation(p.policy, mode)
    p.steps += 1
    tables = p.tables
    num_layers, num_heads = tables.lens.shape
    while len(p.scores) < num_layers * num_heads:
        layer, head = divmod(len(p.scores), num_heads)
        cost = -(-p.policy.score_cost(tables.host_lens[layer][head]) // num_heads)
        if not work.allows(cost):
            break
        view = request_view(store, row, store.first_layer + layer, state, tables=tables, head=head,
                            queries=p.queries[layer], values=p.policy.uses_values,
                            moments=(None, None) if p.moments is None else p.moments[layer],
                            reconstruction=None if p.reconstruction is None else p.reconstruction.layers[layer])
        p.scores.append(p.policy.score(view)[0])
        p.protected.append(p.policy.protected(view))
        work.spend(cost)
    if len(p.scores) < num_layers * num_heads:
        return None
    state.pending = None
    device = tables.units.device
    scores = torch.full((num_layers, num_heads, tables.width), -torch.inf, device=device)
    protected = torch.zeros(scores.shape, dtype=torch.bool, device=device)
    for k, (score, prot) in enumerate(zip(p.scores, p.protected)):
        scores[k // num_heads, k % num_heads, : score.numel()] = score
        protected[k // num_heads, k % num_heads, : prot.numel()] = prot
    chosen = _choose_variable(p, scores, protected, tables.lens, mode)
    # Entries appended since the pass began (after each head's own columns): every head keeps them.
    now = state.tables(store.req_to_token[row, :n], num_layers, num_heads)
    tail = torch.arange(n - p.n0, device=device)
    indices = torch.full((num_layers, num_heads, chosen.max_keep + tail.numel()), HeadSelection.PAD,
                         dtype=torch.int64, device=device)
    indices[..., : chosen.max_keep] = chosen.indices
    indices.scatter_(-1, chosen.lengths[..., None] + tail, tables.lens[..., None] + tail)
    selection = HeadSelection(indices=indices, lengths=chosen.lengths + tail.numel(), n=now.width)
    valid = selection.valid()
    safe = torch.where(valid, selection.indices, 0)
    stats = None
    if state.policy.uses_stats:  # the decode policy's statistic, whichever policy chose
        queries = store.window_queries(row, now.width)  # a head's view keeps its last n of them
        stats = with_gaps(store.first_layer, [
            carry_stats_variable(store, row, state, state.policy, now, layer, selection, queries[layer])
            for layer in range(num_layers)
        ])  # fmt: skip
    return DueCompaction(
        i=i, state=state, policy=p.policy, moment=p.moment, selection=selection,
        kept_positions=now.positions.gather(-1, safe) * valid, stats=stats, began_at=p.n0,
        staged=p.staged, units=now.units, n=n, carried=_carried(p, selection, per_head_lengths=True),
    )


def _choose_variable(p: PendingPass, scores: Tensor, protected: Tensor, lens: Tensor, mode: str) -> HeadSelection:
    """The variable pass's choice over its tables' columns: the policy's allocation
    (`allocation`) over every entry, or, holding each head's first `held_lens`, over the rest only
    (columns held_lens[l, h] ...), the held ones kept before them."""
    if p.held_lens is None:
        return select_from_scores(scores, protected, p.target, lengths=lens, mode=mode)
    held = p.held_lens
    rest = lens - held
    width = int(rest.max()) if rest.numel() else 0
    cols = (held[..., None] + torch.arange(width, device=lens.device)).clamp(max=scores.shape[-1] - 1)
    own = select_from_scores(scores.gather(-1, cols), protected.gather(-1, cols), p.target, lengths=rest, mode=mode)
    lengths = held + own.lengths
    keep = int(lengths.max())
    first = torch.arange(keep + 1, device=lens.device)  # + a column the padding is written to
    indices = torch.where(first < held[..., None], first, HeadSelection.PAD)
    valid = own.valid()
    at = torch.where(valid, held[..., None] + torch.arange(own.max_keep, device=lens.device), keep)
    indices.scatter_(-1, at, torch.where(valid, own.indices + held[..., None], HeadSelection.PAD))
    return HeadSelection(indices=indices[..., :keep].contiguous(), lengths=lengths, n=int(scores.shape[-1]))


def _carried(p: PendingPass, selection: HeadSelection, per_head_lengths: bool) -> CarriedScores | None:
    """At a prompt moment, the reconstruction scores of what the pass keeps: between chunks, the
    next prompt pass repeats only the context read since; after the prompt, a conversation's
    request keeps them for its reply (the adapter drops them for any other)."""
    if p.reconstruction is None or p.moment not in ("chunk", "prefill"):
        return None
    return carry_scores(p.reconstruction, selection, per_head_lengths)


# --- statistics carried over a compaction -------------------------------------------------------
def carry_stats_uniform(
    store: KvcStore, row: int, state: ReqKvState, policy: Policy, selection: HeadSelection, n: int,
    positions: Tensor,
) -> list[Tensor | None]:
    """Per layer of this rank, its statistic [H_kv, k] after a per-head compaction
    (`carry_stats_per_head`); the views are made one layer at a time (a generator), so one
    layer's keys are held at a time."""
    queries = store.window_queries(row, n)
    views = (request_view(store, row, store.first_layer + local, state, n=n, positions=positions, queries=q)
             for local, q in enumerate(queries))
    return carry_stats_per_head(policy, views, selection)


def carry_stats_variable(
    store: KvcStore, row: int, state: ReqKvState, policy: Policy, tables: RequestTables, layer: int,
    selection: HeadSelection, queries: Tensor | None,
) -> Tensor:
    """Local layer `layer`'s statistic after a variable compaction: [H_kv, max_keep], each
    head's kept columns of what the policy carries, zero padded (`queries`: the layer's window
    queries, at least as many as any head has entries allow)."""
    out = torch.zeros(selection.num_heads, selection.max_keep, device=selection.indices.device)
    for head in range(selection.num_heads):
        view = request_view(store, row, store.first_layer + layer, state, tables=tables, head=head,
                            queries=queries)
        full = policy.carry_stats(view, torch.arange(view.n, device=view.keys.device))
        kept = selection.kept(layer, head)
        if full is not None:
            out[head, : kept.numel()] = full[0, kept]
    return out
