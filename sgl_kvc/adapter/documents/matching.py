"""What a request's row starts from, and which document it compresses: its plan at a match
(`plan_match`, from `KvcRadixCache.match_prefix`).

A request declares its document as its prompt's first D' tokens (on the chat route, by default,
every message but the last: the conversation so far). Its own document resident: it starts from
it (a hit). Else, on a server that extends documents, where one that its document begins with is
resident (its first D < D' tokens, compressed in the same namespace and settings: the same
`DocumentKey.content`), it starts from the longest such one: its row begins with that document's
entries, it prefills only [D, D') and its question, and the document it compresses is the
*extension*: what that one kept, then entries chosen among [D, D') alone, published as a child
node of it (`extensions.py`). Where the last turn's request left its question and answer in
the tree (a finished turn after that document, `turns.py`), it starts from that turn too: it reads
only what its template adds after the answer, and its question. The next turn, whose document is
one turn longer again, starts from the extension, and so on.

A chain at its budget, at its depth (`--kv-document-depth`), or ending in a reply (a compacted
row, a reply, which a request starts from only where its own decode settings would have kept
the same) is compressed again with the extension, as one document under the root (a *rebuild*):
no chain grows past the depth, whatever a client sends.

Every lookup goes through the registry's indexes (by content, by the document a turn follows),
and what a request's prompt prefixes hash to is computed once per request. Below, whether a
request waits for another that compresses its document now.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from typing import Any

from sgl_kvc.adapter import kvc_req
from sgl_kvc.adapter.documents.keys import DocumentKey, Kind, content_digest, extension_key
from sgl_kvc.adapter.documents.links import Document
from sgl_kvc.adapter.documents.roles import DocumentPlan, Role
from sgl_kvc.adapter.documents.plan import may_start_from, plan_of, publishes
from sgl_kvc.adapter.documents.registry import DocumentRegistry


def plan_match(registry: DocumentRegistry, req: Any, read_len: int, match_len: int) -> DocumentPlan:
    """`req`'s plan now (`plan.py`), set on it: the node it starts from, if any, and the document
    it compresses. `read_len`: the tokens it reads (its prompt, a retracted one's output too);
    `match_len`: the most of them SGLang lets it match (its key's limit: the observation window,
    the prompt's last token). A compressed document is started from wherever a token is left to
    read after it: its entries stand for its D tokens, which cannot be read again in part, and
    its request's own budget applies beyond them. A finished turn (exact tokens) is started from
    only within the limit, as a plain prefix is; else its document is."""
    fields = kvc_req.of(req)
    plan = plan_of(req).without_start()
    own = plan.own
    if own is not None and may_start_from(req):
        plan = _plan(registry, req, plan, own, read_len, match_len)
    fields.plan = plan
    return plan


def _plan(registry: DocumentRegistry, req: Any, plan: DocumentPlan, own: DocumentKey, read_len: int,
          match_len: int) -> DocumentPlan:
    def fits(doc: Document | None) -> bool:
        if doc is None:
            return False
        return doc.key.tokens < (match_len if doc.key.kind is Kind.TURN else read_len)

    doc = registry.get(own)
    if doc is not None:
        return DocumentPlan(role=Role.HIT, own=own, key=own, start=doc, mode=plan.mode) if fits(doc) else plan
    rule = kvc_req.of(req).rule
    if rule is None:
        return plan
    found = extendable(registry, req, own)
    if found is None:
        return plan
    parent, entries, rebuilds = found
    key = extension_key(own, parent.key, req.origin_input_ids, entries, rebuilds)
    resident = registry.get(key)
    if resident is not None:
        return DocumentPlan(role=Role.HIT, own=own, key=key, start=resident, mode=plan.mode) if fits(resident) else plan
    start = resident_turn(registry, req, parent, own) or parent
    if not fits(start):
        start = parent if fits(parent) else None
    if start is None:
        return plan
    return DocumentPlan(role=Role.REBUILD if rebuilds else Role.EXTEND, own=own, key=key, start=start, parent=parent,
                        mode=plan.mode)


def resident_turn(registry: DocumentRegistry, req: Any, parent: Document, own: DocumentKey) -> Document | None:
    """The longest finished turn after `parent` (`turns.py`) that `req`'s own document (`own`)
    begins with, or None: its row then starts with the turn's exact tokens after the parent's
    entries, and it reads only the rest of its extension and its question. One lookup per length
    the turns after `parent` have (`DocumentRegistry.turn_lengths`), however many turns there are."""
    after = registry.turns_after.get(parent.key.digest)
    if not after:
        return None
    lengths = sorted((t for t in registry.turn_lengths.get(parent.key.digest, {}) if t <= own.tokens), reverse=True)
    contents = _prefix_contents(req, lengths, own.family)
    for tokens in lengths:
        same = after.get(contents[tokens])
        if same:
            return next(iter(same.values()))
    return None


def extendable(registry: DocumentRegistry, req: Any, own: DocumentKey) -> tuple[Document, int, bool] | None:
    """The longest resident document that `req`'s own (`own`) extends, and the entries per (layer,
    KV head) its extension keeps of its own (`ExtensionRule.entries`), or, where it compresses
    the chain again (a chain at its budget, window or depth, a reply), in all (True); or None. A reply,
    and every document made from one, counts only where the request's own decode settings are
    the reply's."""
    rule = kvc_req.of(req).rule
    lengths = sorted((t for t in registry.lengths.get(own.family, {}) if t < own.tokens), reverse=True)
    contents = _prefix_contents(req, lengths, own.family)
    for tokens in lengths:
        for doc in registry.by_content.get(contents[tokens], {}).values():
            extension = own.tokens - tokens
            if doc.key.settings and doc.key.settings != rule.settings:
                continue  # another tenant's decode settings decided what it holds (a reply, or made from one)
            if doc.key.kind is Kind.REPLY:
                entries = rule.recompress(doc.key.entries, own.tokens, extension)
                if entries is not None:
                    return doc, entries, True
                continue
            if doc.depth >= rule.depth:
                entries = rule.recompress(doc.key.entries, own.tokens, extension)
                if entries is not None:
                    return doc, entries, True
                continue
            entries = rule.entries(doc.key.entries, tokens, extension)
            if entries is not None:
                return doc, entries, False
            entries = rule.rebuild(doc.key.entries, tokens, extension)
            if entries is not None:
                return doc, entries, True
    return None


def _prefix_contents(req: Any, lengths: list[int], family: str) -> dict[int, str]:
    """`DocumentKey.content` of the first T tokens of `req`'s prompt, for each T of `lengths`,
    hashed once per request (one running hash over the prompt for those not known yet): SGLang
    matches a waiting request in every round."""
    fields = kvc_req.of(req)
    known = fields.prefix_contents if fields.prefix_contents is not None else {}
    missing = sorted(t for t in set(lengths) if t not in known)
    if missing:
        prompt, h, read = req.origin_input_ids, hashlib.sha256(), 0
        for t in missing:
            h.update(array("q", prompt[read:t]).tobytes())
            read = t
            known[t] = content_digest(h.copy().hexdigest(), family)
        fields.prefix_contents = known
    return known


# Whether a matched request waits. Concurrent first requests of one document compress it once: a
# request stays in the queue only behind another that is admitted and compresses the same
# document (`held_back`, `waits_in_round`), and at most `--kv-document-wait` seconds in all
# (`stop_waiting`): the publisher's prompt, hence how long it reads, is its own tenant's choice.
# After that the waiter reads the document itself.


def held_back(waiting: list[Any], registry: DocumentRegistry) -> list[Any]:
    """The waiting requests that wait for their document to be published rather than compress it
    themselves: another request in flight (admitted, `compressing`) compresses it. Never behind one
    that is only queued (it may not be admitted for a long time, or ever: the first of them that
    is admitted compresses it, and the others wait for it from then on, `waits_in_round`), never
    past the server's bound (`stop_waiting`), and never one that may not start from it
    (`may_start_from`)."""
    held = []
    for req in waiting:
        key = plan_of(req).key
        if key is None or registry.get(key) is not None or not may_start_from(req) or kvc_req.of(req).waited_out:
            continue
        by = registry.compressed_by(key)
        if by is not None and by is not req:
            _waits(req)
            held.append(req)
    return held


def waits_in_round(req: Any, admitted: list[Any], registry: DocumentRegistry | None) -> bool:
    """Whether `req`, about to be admitted in a prefill round, waits instead: a request this round
    already admitted (`admitted`, SGLang's `can_run_list`) compresses the same document, and will
    be registered as compressing it (`compressing`)."""
    key = plan_of(req).key
    if (key is None or registry is None or registry.get(key) is not None or not may_start_from(req)
            or kvc_req.of(req).waited_out):
        return False
    for other in admitted:
        k = plan_of(other).key
        if other is not req and k is not None and k.digest == key.digest and publishes(other):
            _waits(req)
            return True
    return False


def overdue(held: list[Any], bound: float, now: float | None = None) -> list[bool]:
    """Which of the held requests have waited `bound` seconds (each since it first waited),
    by this process's clock: tensor-parallel ranks vote on it before acting (`stop_waiting`)."""
    now = time.monotonic() if now is None else now
    return [now - (kvc_req.of(req).wait_since or now) >= bound for req in held]


def stop_waiting(held: list[Any], late: list[bool], registry: DocumentRegistry) -> list[Any]:
    """The held requests that go on waiting. Those `late` (past `--kv-document-wait`, as every
    rank agreed) wait no more for this document: they read it themselves, whatever the publisher
    they waited for still reads (its prompt is of its own tenant's choosing): marked
    (`KvcReq.waited_out`) and counted (the documents' stats, `waited_out`)."""
    still = []
    for req, done in zip(held, late):
        if done:
            kvc_req.of(req).waited_out = True
            registry.stats.waited_out += 1
        else:
            still.append(req)
    return still


def _waits(req: Any) -> None:
    fields = kvc_req.of(req)
    if fields.wait_since is None:
        fields.wait_since = time.monotonic()


def compressing(admitted: list[Any], registry: DocumentRegistry) -> None:
    """Requests just admitted to read their prompt that compress their document: registered, so
    that later ones wait for it (`held_back`). Those that ended without publishing are forgotten."""
    registry.forget_gone()
    for req in admitted:
        key = plan_of(req).key
        if key is not None and publishes(req) and registry.get(key) is None and registry.compressed_by(key) is None:
            registry.publishers[key.digest] = req
