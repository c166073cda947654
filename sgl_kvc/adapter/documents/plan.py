"""What a request does with its document: one plan (`roles.DocumentPlan`; `roles.py` says what
each `Role` does), made when it enters the queue and again at each match (`matching.plan_match`),
read by every later step; first the key of the document a request declares (`request_key`) and
its decode settings' digest (`settings_digest`), the two reads of a request that decide a key.
Last, the positions of a request's chunks that the plan's cuts are asked of (`chunk_end`,
`chunk_cap`, `next_cut`; where a `SPLIT` request's row is cut is the plan's, `DocumentPlan.cut_at`).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents.keys import (
    NODE_ATTR, DocumentKey, ExtensionRule, content_digest, document_entries, refusal,
)
from sgl_kvc.adapter.documents.links import fill_skip, prompt_read
from sgl_kvc.adapter.documents.registry import registry_of
from sgl_kvc.adapter.documents.roles import NO_PLAN, PUBLISHES, DocumentPlan, Role
from sgl_kvc.adapter.kvc_req import of_request, refused_by_sglang, resolved
from sgl_kvc.config import KvcConfig
from sgl_kvc.request_settings import RequestSettingError, document_conflict, document_floor, document_prompt_conflict

if TYPE_CHECKING:
    from sgl_kvc.adapter.documents.links import Document


def request_key(req: Any, config: KvcConfig, chunk: int | None = None) -> DocumentKey | None:
    """The document a request declares, or None. Raises `RequestSettingError` (its 400) when the
    document cannot be served for it. `chunk`: the server's chunk size where it compresses prompts
    between chunks (`admission.server_chunk`), None where it reads them whole: a document longer
    than a chunk is cut at every chunk boundary there, the same cuts for every request."""
    spec = of_request(req).document
    if spec is None:
        return None
    field_name = "kv_compression.document"
    settings = resolved(req, config)
    conflict = document_conflict(settings, config, field_name)
    if conflict is not None:
        raise conflict
    prompt = req.origin_input_ids
    conflict = document_prompt_conflict(spec, len(prompt), config, field_name)
    if conflict is not None:
        raise conflict
    entries = document_entries(spec, config)
    policy = settings.prompt_policy_name
    # Everything that decides what the document keeps is in its key; the publisher's own budget,
    # the pool's pressure and the chunks SGLang's rounds give it are not, so they decide nothing.
    every = chunk if chunk and spec.tokens > chunk else 0
    between = config.chunk_target(entries) if every else 0
    h = hashlib.sha256(array("q", prompt[: spec.tokens]).tobytes())
    family = hashlib.sha256(repr((getattr(req, "extra_key", None), getattr(req, "cache_salt", None), policy,
                                  settings.selection, config.kv_head_budget)).encode()).hexdigest()
    content = content_digest(h.hexdigest(), family)
    h.update(repr((getattr(req, "extra_key", None), getattr(req, "cache_salt", None), policy, entries,
                   settings.selection, config.kv_head_budget, every, between)).encode())
    return DocumentKey(digest=h.hexdigest(), tokens=spec.tokens, entries=entries, policy=policy, every=every,
                       between=between, family=family, content=content)


def settings_digest(req: Any, config: KvcConfig) -> str:
    """What of a request's own settings decides what its passes keep as it decodes (its decode
    policy, its budget, its selection): a reply it leaves is keyed by it, and a later request
    starts from that reply only with the same (`DocumentKey.settings`)."""
    s = resolved(req, config)
    return hashlib.sha256(repr((s.policy, s.budget.tokens, s.budget.ratio, s.budget.floor, s.selection,
                                config.kv_head_budget)).encode()).hexdigest()


def plan_of(req: Any) -> DocumentPlan:
    fields = kvc_req.peek(req)
    return NO_PLAN if fields is None or fields.plan is None else fields.plan


def set_plan(req: Any, plan: DocumentPlan) -> None:
    kvc_req.of(req).plan = plan


def publishes(req: Any) -> bool:
    """Whether admitted `req` compresses and publishes its document (unless another in flight
    already is, `waiting.compressing`): not one that has answered (a retracted request re-read)."""
    return plan_of(req).role in PUBLISHES and not req.output_ids


def may_reply(req: Any) -> bool:
    """Whether `req` may keep its row as a reply when it finishes (`turns.py`): it declared a
    document on a server that extends them."""
    fields = kvc_req.peek(req)
    return fields is not None and fields.rule is not None and plan_of(req).own is not None


def may_start_from(req: Any) -> bool:
    """Whether `req` may start from a resident node. Not a request that asks for its prompt's
    log-probabilities: a hit's prefix is k slots standing for D tokens, so SGLang would expect
    log-probabilities of tokens it never reads and count the rest from k, not D (its assert in the
    scheduler loop took the server down); such a request reads its prompt itself, exact, as on a
    server without documents (and may publish the document from it, read whole)."""
    from sgl_kvc.adapter.scheduling.requests import asks_prompt_logprobs

    return not asks_prompt_logprobs(req, len(getattr(req, "origin_input_ids", ())))


def extension_due(req: Any, n: int) -> "Document | None":
    """The document `req` extends (`DocumentPlan.extends`) where its row of `n` entries holds its
    extension exact after what it started from (nothing of it compacted since: its fill ids are
    shifted by the start's offset alone) up to its own document's end, else None. One that adopts
    its extension (`DocumentPlan.adopts`) publishes it at the chunk that ends there or not at all:
    after its question, it would repeat a failed pass. Where its start already covers its whole document
    (a finished turn that ends there), no chunk of it can end there: it publishes at its first
    chunk, the one that began there, and there alone. From SGLang's fields, alike on every
    tensor-parallel rank."""
    plan = plan_of(req)
    if plan.extends is None or fill_skip(req) != plan.layout.offset or n < plan.layout.held:
        return None
    read = plan.layout.tokens(n)
    if read < plan.key.tokens:
        return None
    if read > plan.key.tokens and plan.adopts and not _began_at_its_end(req):
        return None
    return plan.parent


def _began_at_its_end(req: Any) -> bool:
    """Whether `req`'s start covers its whole document and the chunk that just ran began there."""
    plan = plan_of(req)
    return plan.layout.covers == plan.key.tokens and prompt_read(req) == plan.key.tokens


def extension_lost(req: Any) -> bool:
    """Whether `req`, which extends a resident document, compacted its row since it started from
    it: it will not publish its extension."""
    plan = plan_of(req)
    return plan.extends is not None and fill_skip(req) != plan.layout.offset


def declare(req: Any, config: KvcConfig, tree_cache: Any, split: bool = False, chunk: int | None = None) -> None:
    """When a request enters the queue: the document it declares, its plan without a start, or
    its 400 (SGLang's `set_finish_with_abort`) when that document cannot be served for it.
    `split`: the request is compressed between chunks of its prompt (`admission.scheduler_chunk`);
    `chunk`: the server's chunk size where it compresses prompts between chunks
    (`admission.server_chunk`), else None (every request reads its prompt whole, and publishes its
    document so)."""
    fields = kvc_req.of(req)
    fields.plan, fields.rule, fields.cuts = NO_PLAN, None, 0
    if refused_by_sglang(req):  # SGLang's own refusal stands (its prompt is cut to one token)
        return
    try:
        key = request_key(req, config, chunk)
        if key is not None and registry_of(tree_cache) is None:
            raise RequestSettingError("kv_compression.document", "shared documents live in sgl-kvc's prefix cache: "
                                      "this server runs without it (--disable-radix-cache or the hierarchical cache)")
    except RequestSettingError as e:
        from http import HTTPStatus

        req.set_finish_with_abort(refusal(e), status_code=HTTPStatus.BAD_REQUEST)
        return
    if key is None:
        return
    mode = Role.SPLIT if split else Role.ABSTAIN if chunk is not None else Role.WHOLE
    fields.plan = DocumentPlan(role=mode, own=key, key=key, mode=mode)
    if config.kv_document_extend == "resident":
        spec = of_request(req).document
        fields.rule = ExtensionRule(spec.ratio, spec.budget, document_floor(config), chunk,
                                    depth=config.kv_document_depth, settings=settings_digest(req, config),
                                    window=config.kv_turn_window)
    # Its exact KV never enters the tree: the document's compressed node is what later requests
    # start from, and its whole prompt and answer (several times the node's size, and newer)
    # would only push the node out of the LRU.
    req.skip_radix_cache_insert = True


def declared_part(req: Any, config: KvcConfig, split: bool) -> int:
    """`DocumentPlan.held_for_document` of a request not yet in the queue (its document's
    settings unchecked: 0 if it declares none or an invalid one, which `admit` refuses)."""
    spec = of_request(req).document
    if spec is None or spec.tokens is None:
        return 0
    return document_entries(spec, config) if split else spec.tokens


def unmatched(req: Any) -> None:
    """Before SGLang matches `req` again (its tokens unshifted): no start."""
    fields = kvc_req.peek(req)
    if fields is not None and fields.plan is not None:
        fields.plan = fields.plan.without_start()


def matched(req: Any) -> None:
    """After SGLang matched a request's prefix (`Req.init_next_round_input`): where its row starts
    from the node its plan named, its fill ids start that node's offset later (SGLang reads its
    extend at `prefix_len`, the chain's slots, in them) and nothing of it is ever inserted into
    the tree under its tokens (its row does not hold their KV); else it reads its own document."""
    fields = kvc_req.peek(req)
    if fields is None or fields.plan is None or fields.plan.start is None:
        return
    plan = fields.plan
    if getattr(getattr(req, "last_node", None), NODE_ATTR, None) is not plan.start:
        fields.plan = plan.without_start()
        return
    from sgl_kvc.adapter.scheduling.requests import shifted_fill_ids

    shifted_fill_ids(req, plan.layout.offset)
    req.skip_radix_cache_insert = True


def started_from(req: Any, doc: "Document") -> None:
    """`req` published `doc` from its own row, which now starts with the document's node: it goes
    on as a request that started from it."""
    plan = plan_of(req)
    set_plan(req, replace(plan, role=Role.HIT, key=doc.key, start=doc, parent=None))


def chunk_end(req: Any) -> int:
    """The prompt position where the chunk of `req` that just ran ended (its fill ids shifted by
    its start's offset, SGLang's `extend_end` in them): what `DocumentPlan.ended_at` and
    `cut_inside` are asked of."""
    return fill_skip(req) + int(req.extend_end)


def chunk_cap(req: Any) -> int | None:
    """`DocumentPlan.chunk_cap` of `req` as far as it has read its prompt."""
    return plan_of(req).chunk_cap(prompt_read(req))


def next_cut(req: Any) -> int | None:
    """`DocumentPlan.cut_at` where the next chunk of `req` ends at the latest (`chunk_cap`), or
    None: what its admission counts that cut's copies and reconstruction forward by."""
    cap = chunk_cap(req)
    return None if cap is None else plan_of(req).cut_at(prompt_read(req) + cap)
