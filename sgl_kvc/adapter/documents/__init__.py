"""Compressed documents shared through the prefix cache (docs/architecture.md, "Shared documents").

A request says that its prompt's first D tokens are a document to keep compressed
(`kv_compression.document`). The first such request compresses it, by its question-free prompt
policy (KVzip repeats the document alone), to k entries per (layer, KV head), and publishes them to
the radix tree as one node (`adapter/documents/document_pass.py`):
- on a server that compresses between chunks (`--compress-on chunk` or `chunk-always`), it reads
  the document in chunks, one of which ends exactly at D (`chunk_cap`), and compresses its row to k
  entries there, before any of its question is read; its row's k slots become the node, and it goes
  on as a request that started from it (it answers as every later one does, and it holds the
  document whole only if it is at most one chunk, `cut_at`: a document longer than the pool is
  served);
- otherwise it reads its prompt whole, as SGLang does; right after, before its own pass, the
  document's entries [0, D) are scored and the k kept are copied into k fresh slots, the node.
What a document keeps is decided by its key alone, never by the request that happens to publish
it: on a server that compresses between chunks only requests cut between chunks publish (one that
reads its prompt whole there, asking for prompt log-probabilities, never does), and the document's
part of their rows is cut only where its key says (`cut_at`): at D, and for a document longer than
one chunk (`--chunked-prefill-size`, C) at every multiple of C, to `DocumentKey.between` entries,
whatever the pool's pressure, the publisher's own budget or SGLang's chunk sizes in its rounds.
Every later request that begins with the same D tokens (and the same namespace and settings, the
document's *key*) matches that node instead of the tokens: its row starts with the node's k slots,
locked as any matched prefix is, and it prefills only its own suffix, at logical positions D, D+1, ...

The node is an ordinary tree node under a key of its own (k placeholder tokens in a namespace, the
`extra_key`, no real request uses), so its key and value have the same length and SGLang's locking,
LRU eviction and size accounting hold for it as written; this module keeps the side registry that
maps a document's key to its node and to which token each of its entries holds. A request's own
compaction never writes the node's slots (they are tree-owned: it copies what it keeps, as for any
matched prefix, `adapter/moments/compaction.py`).

What a document request adds is checked when it enters the queue (`request_key`: a 400 if its
prompt does not extend past the document, or if its settings cannot compress one).

Concurrent first requests compress a document once: a request waits (stays in the queue) only
behind another that is admitted and compresses the same document (`held_back`, `waits_in_round`),
and at most `--kv-document-wait` seconds in all (`stop_waiting`): the publisher's prompt, hence how
long it reads, is its own tenant's choice. After that the waiter reads the document itself.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sgl_kvc import req_state
from sgl_kvc.config import KvcConfig
from sgl_kvc.core.reconstruction import CarriedScores
from sgl_kvc.request_settings import (
    DEFAULT_DOCUMENT_RATIO, DocumentSpec, RequestSettingError, document_conflict, document_floor,
    document_prompt_conflict, of_request, refused_by_sglang, resolved,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    from sgl_kvc.core.request_state import ReqKvState

NODE_ATTR = "sgl_kvc_document"  # on a radix TreeNode: the Document it holds
NAMESPACE = "sgl-kvc/document/"  # the extra_key prefix of a document node, reserved (`reserved_namespace`)


class DocumentNamespace(str):
    """The `extra_key` of a document's node: `NAMESPACE` + its key's digest, as a str (SGLang's
    KV events and logs read it as one) that is equal only to another `DocumentNamespace`. A
    client's `extra_key` is always a plain str: were the node's one too, a client that computed a
    document's digest (its tokens are the client's, the key formula is public, k is in the stats)
    could plant a node under it before the document was published, and the publication's insert
    would split that node and share its slots (slots owned twice). A plain str never equals this
    class (its reflected `__eq__` runs first) and hashes elsewhere, so SGLang's child keys
    `(extra_key, token)` of a client's nodes and of a document's never meet in the tree."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is DocumentNamespace and str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((DocumentNamespace, str.__str__(self)))


def reserved_namespace(field_name: str, value: Any) -> str | None:
    """Why a client's `extra_key` or `cache_salt` (`field_name`) cannot be served, or None: the
    document namespace is sgl-kvc's own (refused where requests enter, `server/body_guard.py` and
    `adapter/scheduling/request_guard.py`; the node's key cannot be forged anyway, `DocumentNamespace`)."""
    if isinstance(value, str) and value.startswith(NAMESPACE):
        return (f"Invalid '{field_name}': values starting with '{NAMESPACE}' are reserved for "
                "sgl-kvc's shared documents.")
    return None


@dataclass(frozen=True)
class DocumentKey:
    """What identifies a compressed document: a hash of its tokens, the request's namespace
    (`extra_key`, `cache_salt`) and how it is compressed (prompt policy, entries, selection, and
    the cuts before its end). The key alone decides what the document keeps: two tenants that
    name the same document with the same settings get the same entries, whoever published it."""

    digest: str
    tokens: int  # D: prompt tokens the document covers
    entries: int  # k: entries each (layer, KV head) keeps
    policy: str  # the prompt policy that compresses it
    # Cut between chunks, a document longer than one chunk: its row is cut at every multiple of
    # `every` (C, the server's chunk size) before D, to `between` entries (the chunk target of k,
    # `--kv-chunk-keep`); 0: it is scored once, from its D exact entries.
    every: int = 0
    between: int = 0
    # What the chain of documents matches by (`extendable`): a hash of the namespace and settings
    # a document is compressed with but not of how many entries it keeps (`family`), and of that
    # and its D tokens (`content`): a document over [0, D') of the same family and a resident one
    # of the same content over [0, D) with D < D' is one it may extend.
    family: str = ""
    content: str = ""
    # A document that extends a resident one (its `parent`, by digest, which kept `parent_entries`
    # per (layer, KV head) of the chain before it): it keeps those, then `entries - parent_entries`
    # chosen among its own tokens [parent's D, D). The parent's digest is in its own: what it keeps
    # is decided by its key alone, whoever publishes it.
    parent: str = ""
    parent_entries: int = 0
    # A chain at its budget compressed again (`ExtensionRule.rebuild`): its request starts from
    # `parent` as an extension's does, and chooses its `entries` among the parent's and its own
    # tokens' together (none held); the document stands alone (no parent: `parent_entries` 0).
    rebuilds: bool = False
    # A finished request's compacted row (`adapter/documents/replies.py`): what its own passes kept
    # of its conversation, for its own question; the next turn compresses it again (`recompress`).
    reply: bool = False


@dataclass(eq=False)
class Document:
    """A resident compressed document. Uniform head budgets: its node's k slots hold, in (layer
    l, KV head h), the entry of the token at logical position `kept_positions[l, h, j]` in slot j.
    Variable / layer budgets (the unit pool): its G slots are packed, head (l, h) keeping
    `unit_lens[l, h]` entries (at most `width`, K) at the positions `kept_positions` lists, every
    head's in (layer, head, column) order, filling the units of its slots in that order (a request
    starting from it is packed so, `tables`, `core/request_state.py`).

    Its metadata (`compact`) stays resident beside its KV as long as the document: an int32 per
    kept entry, each head's length, nothing padded, and, compressed by a reconstruction (KVzip), a
    float32 score per kept entry: at most 8 bytes per (slot, layer, KV head), what the KV memory
    reserves per pool token for documents (`adapter/memory/kv_memory.py`)."""

    key: DocumentKey
    node: Any  # the radix TreeNode (value: its slots)
    kept_positions: Tensor  # int32, never written: [L, H_kv, k]; packed, [sum(unit_lens)]
    slots: int  # k, or G when packed
    unit_lens: Tensor | None = None  # [L, H_kv] int32 when packed
    width: int = 0  # packed: K, the most entries a head keeps
    # KVzip: each kept entry's reconstruction score (float32, laid out as `kept_positions`) and
    # the end of the context they cover: a request that starts from the document repeats only
    # its context after it (`carried`), as its publisher does after its cut
    scores: Tensor | None = None
    scored_to: int = 0
    # The resident document it extends (its node is this node's parent in the tree), or None:
    # this node holds only its own entries, after the parent's (`tables`, `carried`).
    parent: "Document | None" = None
    # A finished turn (`adapter/documents/turns.py`): its slots hold every token after its parent
    # exact, as its request computed them, in order (no tables of its own: a row starting from it
    # is a row starting from its parent that has read those tokens, `start`).
    exact: bool = False

    @classmethod
    def compact(cls, key: DocumentKey, node: Any, kept_positions: Tensor, slots: int,
                unit_lens: Tensor | None = None, carried: CarriedScores | None = None,
                parent: "Document | None" = None) -> "Document":
        """A document from the tables of the pass that chose it (int64 [L, H_kv, k or K], and a
        packed one's lengths), as int32 (a position is below the context length) and, packed,
        each head's entries only: padded to the widest head, a packed document's tables held 3x
        its slots' share on SmolLM2 (some heads keep far more than others). A packed document's
        units are not kept: they follow from its slots and lengths (`tables`). `carried`: the
        pass's reconstruction scores of the kept entries, in the same columns (KVzip)."""
        scores = None
        if carried is not None:
            width = int(kept_positions.shape[-1])
            scores = torch.stack([layer[:, :width] for layer in carried.layers]).to(torch.float32)
        if unit_lens is None:
            return cls(key=key, node=node, kept_positions=kept_positions.to(torch.int32), slots=slots,
                       scores=scores, scored_to=carried.end if carried is not None else 0, parent=parent)
        width = int(kept_positions.shape[-1])
        valid = torch.arange(width, device=kept_positions.device) < unit_lens[..., None]
        return cls(key=key, node=node, kept_positions=kept_positions[valid].to(torch.int32), slots=slots,
                   unit_lens=unit_lens.to(torch.int32), width=width,
                   scores=None if scores is None else scores.to(valid.device)[valid],
                   scored_to=carried.end if carried is not None else 0, parent=parent)

    @classmethod
    def turn(cls, key: DocumentKey, node: Any, parent: "Document") -> "Document":
        """A finished turn's exact tokens after `parent`, in `node`'s slots."""
        return cls(key=key, node=node, kept_positions=torch.empty(0, dtype=torch.int32), slots=len(node.value),
                   parent=parent, exact=True)

    def tables(self) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """What a request starting from it holds as its compacted state (`ReqKvState`): its kept
        positions, [L, H_kv, k] (uniform, read as they are) or [L, H_kv, K]; packed, its units
        [L, H_kv, K] and lengths [L, H_kv] (else None), int32, 0 past each head's length. Entry e
        of the (layer, head, column) order is in unit e of its slots, slot e // (L x H_kv) first
        (`core/moves.unit_moves`, which packed it). A turn's: its parent's (what follows is exact)."""
        if self.exact:
            return self.parent.tables()
        if self.unit_lens is None:
            if self.parent is None:
                return self.kept_positions, None, None
            return torch.cat([self.parent.tables()[0], self.kept_positions.to(torch.int32)], dim=-1), None, None
        rel, units = packed_units(self.node.value, self.unit_lens, self.width)
        valid = rel >= 0
        # int32: a unit pool of 2^31 units would hold 512 GB of K and V at head_dim 64 (256 GB in
        # FP8), on one device (variable budgets run without tensor parallelism)
        positions, units = self.kept_positions[rel.clamp(min=0)] * valid, units.to(torch.int32)
        if self.parent is None:
            return positions, units, self.unit_lens
        # an extension: each head's entries of the chain above, then its own
        above, above_units, above_lens = self.parent.tables()
        return (after_heads(above, above_lens, positions, self.unit_lens),
                after_heads(above_units, above_lens, units, self.unit_lens), above_lens + self.unit_lens)

    def carried(self, device: torch.device | str | None = None) -> CarriedScores | None:
        """KVzip: the reconstruction scores of its entries as a request that starts from it
        carries them (`ReqKvState.reconstructed`, in its tables' columns: each head's first
        entries), or None (no reconstruction compressed it)."""
        if self.exact:  # its tokens are scored as any exact ones, by the pass that reads them
            return self.parent.carried(device)
        if self.scores is None:
            return None
        device = device if device is not None else self.scores.device
        if self.unit_lens is None:
            scores = self.scores.to(device)
            before = None if self.parent is None else self.parent.carried(device)
            if before is not None:  # the chain's scores, each entry's from the pass that kept it
                scores = torch.cat([torch.stack(before.layers), scores], dim=-1)
            return CarriedScores(self.scored_to, list(scores.unbind(0)))
        lens = self.unit_lens.long()
        valid = torch.arange(self.width, device=lens.device) < lens[..., None]
        wide = torch.zeros(valid.shape, dtype=torch.float32, device=lens.device)
        wide[valid] = self.scores.to(lens.device)
        before = None if self.parent is None else self.parent.carried(lens.device)
        if before is not None:  # each head's scores of the chain above, then its own
            above_lens = torch.stack(before.lengths).long()
            wide = after_heads(torch.stack(before.layers), above_lens, wide, lens)
            lens = above_lens + lens
        return CarriedScores(self.scored_to, list(wide.to(device).unbind(0)), list(lens.to(device).unbind(0)))

    def start(self, state: ReqKvState, device: torch.device | str | None = None) -> None:
        """`state` of a row that starts from it, nothing of its own compacted: its kept positions
        (packed, its tables: `tables`), the offset of what it reads next (logical positions D, D+1,
        ...) and, compressed by KVzip, the scores its entries carry (`carried`). A turn: as its
        parent (its slots, after the parent's, are the row's first exact ones)."""
        if self.exact:
            self.parent.start(state, device)
            return
        kept, units, lens = self.tables()
        state.kept_positions = kept
        if units is not None:  # packed, as a request compacted on the unit pool is
            state.units, state.unit_lens, state.packed = units, lens, self.chain_slots
        state.offset = self.offset
        state.reconstructed = self.carried(device)

    @property
    def chain_slots(self) -> int:
        """The slots of a request's row that start from it: its own and those of what it extends."""
        return self.slots + (0 if self.parent is None else self.parent.chain_slots)

    @property
    def entries(self) -> int:
        """Entries per (layer, KV head) its own node holds (of `key.entries`, the chain's)."""
        return self.key.entries - self.key.parent_entries

    @property
    def covers(self) -> int:
        """Prompt tokens its own entries were chosen among (after what it extends)."""
        return self.key.tokens - (0 if self.parent is None else self.parent.key.tokens)

    @property
    def offset(self) -> int:
        """Tokens a request starting from it has read beyond what its row holds: D - slots."""
        return self.key.tokens - self.chain_slots

    @property
    def metadata_bytes(self) -> int:
        tensors = (self.kept_positions, self.unit_lens, self.scores)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def packed_units(slots: Tensor, unit_lens: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Where a packed document of `slots` whose heads keep `unit_lens` [L, H_kv] entries has them:
    entry e of the (layer, head, column) order in unit e of its slots, slot e // (L x H_kv) first
    (`core/moves.unit_moves` packs so). Returns each (layer, head, column)'s entry number e
    ([L, H_kv, width], -1 past its head's length) and unit (int64, 0 there)."""
    lens = unit_lens.long()
    layers, heads = lens.shape
    cols = torch.arange(width, device=lens.device)
    valid = cols < lens[..., None]
    flat = lens.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(layers, heads)
    rel = torch.where(valid, starts[..., None] + cols, 0)
    per_slot = layers * heads
    slots = slots.to(device=lens.device, dtype=torch.int64)
    units = (slots[(rel // per_slot).clamp(max=max(len(slots) - 1, 0))] * per_slot + rel % per_slot) * valid
    return torch.where(valid, rel, -1), units


def after_heads(first: Tensor, first_lens: Tensor, then: Tensor, then_lens: Tensor) -> Tensor:
    """Per (layer, head) tables [L, H, *]: each head's first `first_lens` columns of `first`, then
    its first `then_lens` of `then`, 0 after (a chain's tables, its ancestors' entries first)."""
    first_lens, then_lens = first_lens.long(), then_lens.long()
    lens = first_lens + then_lens
    width = int(lens.max()) if lens.numel() else 0
    cols = torch.arange(width, device=first.device).expand(*lens.shape, width)
    from_first = cols < first_lens[..., None]
    a = first.gather(-1, cols.clamp(max=max(first.shape[-1] - 1, 0))) if first.shape[-1] else torch.zeros_like(cols)
    then_cols = (cols - first_lens[..., None]).clamp(min=0, max=max(then.shape[-1] - 1, 0))
    b = then.to(first.device).gather(-1, then_cols) if then.shape[-1] else torch.zeros_like(cols)
    out = torch.where(from_first, a.to(first.dtype), b.to(first.dtype))
    return torch.where(cols < lens[..., None], out, torch.zeros((), dtype=first.dtype, device=first.device))


def compact_bytes(entries: int, heads: int, packed: bool, scored: bool = False) -> int:
    """What `Document.compact` keeps of a document of `entries` kept entries in all over its
    `heads` (layer, KV head) pairs: an int32 each (and its float32 score, `scored`: KVzip), and
    packed, each head's int32 length."""
    return (8 if scored else 4) * entries + (4 * heads if packed else 0)


@dataclass
class DocumentStats:
    compressions: int = 0  # documents compressed and published
    extensions: int = 0  # of them: documents published as the extension of a resident one
    rebuilds: int = 0  # of them: chains at their budget compressed again (`ExtensionRule.rebuild`)
    replies: int = 0  # finished requests' compacted rows kept as documents (`replies.py`)
    hits: int = 0  # requests that started from a resident document
    evictions: int = 0  # documents the tree evicted (LRU) or dropped
    not_published: int = 0  # compressed documents not published: no free slots, no room for its metadata, or a failure
    evicted_for_metadata: int = 0  # of the evictions: documents evicted to keep the metadata within its reservation
    waited_out: int = 0  # requests that waited --kv-document-wait for a publisher, then read it themselves
    seconds: float = 0.0  # spent scoring and copying documents
    turns: int = 0  # finished turns published (exact, after their request's document: `turns.py`)
    turns_evicted: int = 0  # of them: evicted or dropped


@dataclass
class DocumentRegistry:
    """One radix tree's documents, by key."""

    by_key: dict[str, Document] = field(default_factory=dict)
    stats: DocumentStats = field(default_factory=DocumentStats)
    metrics: Any = None  # the scheduler's CompressionMetrics (`/metrics`), once it has some
    # documents being compressed: key digest -> the request (SGLang's Req) compressing it
    publishers: dict[str, Any] = field(default_factory=dict)
    # bytes the KV memory reserved for the resident documents' metadata (`adapter/memory/kv_memory.py`);
    # None: nothing reserved (a pool layout without one cost per token), not bounded
    metadata_budget: int | None = None
    # a finishing request's row (its pool index) -> its kv record and the range of the row whose
    # slots its turn took (`turns.publish`), between SGLang's `claim_kv_row` and `free_kv_row` of
    # one release (applied to that record only)
    taken: dict[int, tuple[Any, tuple[int, int]]] = field(default_factory=dict)

    @property
    def metadata_bytes(self) -> int:
        return sum(doc.metadata_bytes for doc in self.by_key.values())

    def get(self, key: DocumentKey | None) -> Document | None:
        return None if key is None else self.by_key.get(key.digest)

    def compressed_by(self, key: DocumentKey) -> Any:
        """The request in flight that compresses this document, or None (one that finished or gave
        its row back without publishing it is forgotten here)."""
        req = self.publishers.get(key.digest)
        if req is not None and _gone(req):
            del self.publishers[key.digest]
            return None
        return req

    def forget_gone(self) -> None:
        """Forget every request registered as compressing a document that finished, failed or gave
        its row back without publishing it. `compressed_by` forgets one only when its document is
        asked for again: a unique document's would keep its `Req` (its prompt, its output) for the
        server's lifetime. Run at each prefill round (`compressing`), it bounds the registry by the
        requests in flight."""
        for digest in [d for d, req in self.publishers.items() if _gone(req)]:
            del self.publishers[digest]

    def settle(self, key: DocumentKey, req: Any) -> None:
        """`req` published the document, or will not: requests held back for it may go."""
        if self.publishers.get(key.digest) is req:
            del self.publishers[key.digest]

    def add(self, doc: Document) -> None:
        setattr(doc.node, NODE_ATTR, doc)
        self.by_key[doc.key.digest] = doc
        if doc.exact:
            self.stats.turns += 1
            return
        if doc.key.reply:  # kept as its request left it, compressed by no document pass
            self.stats.replies += 1
            self._emit("reply")
            return
        self.publishers.pop(doc.key.digest, None)
        self.stats.compressions += 1
        self.stats.extensions += doc.parent is not None
        self.stats.rebuilds += doc.key.rebuilds
        self._emit("compressed")

    def count_hit(self) -> None:
        """A request started from a resident document."""
        self.stats.hits += 1
        self._emit("hit")

    def removed(self, node: Any) -> None:
        """The tree deleted `node` (evicted it): a document it held is gone."""
        doc = getattr(node, NODE_ATTR, None)
        if doc is not None and self.by_key.get(doc.key.digest) is doc:
            self._drop(doc)

    def clear(self) -> None:
        """The tree was reset (`/flush_cache`): every document is gone."""
        for doc in list(self.by_key.values()):
            self._drop(doc)

    def _drop(self, doc: Document) -> None:
        del self.by_key[doc.key.digest]
        if doc.exact:
            self.stats.turns_evicted += 1
            return
        self.stats.evictions += 1
        self._emit("evicted")

    def compressed(self) -> list[Document]:
        """The resident compressed documents (not the finished turns after them)."""
        return [doc for doc in self.by_key.values() if not doc.exact]

    def _emit(self, event: str) -> None:
        if self.metrics is not None:
            docs = self.compressed()
            self.metrics.document(event, len(docs), sum(d.entries for d in docs))

    def snapshot(self) -> dict[str, Any]:
        docs, turns = self.compressed(), [doc for doc in self.by_key.values() if doc.exact]
        return {
            "resident": len(docs),
            "entries": sum(doc.entries for doc in docs),  # per (layer, KV head), their own
            "tokens": sum(doc.covers for doc in docs),  # what their own nodes cover
            "turns_resident": len(turns),
            "turn_tokens": sum(doc.covers for doc in turns),  # exact, one slot each
            # which token each entry holds (and a packed document's tables), on the KV's device,
            # within what the KV memory reserved for it (`metadata_budget`)
            "metadata_bytes": self.metadata_bytes,
            **asdict(self.stats),
        }


def _gone(req: Any) -> bool:
    """`req` will not publish its document any more: finished, or its row given back (retracted)."""
    return req.finished() or not req.kv.holds_kv


def registry_of(tree_cache: Any) -> DocumentRegistry | None:
    """The document registry of SGLang's tree cache (sgl-kvc's prefix cache), or None."""
    return getattr(tree_cache, "documents", None)


def request_key(req: Req, config: KvcConfig, chunk: int | None = None) -> DocumentKey | None:
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
    entries = _entries(spec, config)
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


def content_digest(tokens_digest: str, family: str) -> str:
    """`DocumentKey.content` of a document whose tokens hash to `tokens_digest` (sha256)."""
    return hashlib.sha256(f"{family}/{tokens_digest}".encode()).hexdigest()


def tokens_content(tokens: list[int], family: str) -> str:
    """`DocumentKey.content` of a document of `tokens` (all of them, from the first)."""
    return content_digest(hashlib.sha256(array("q", tokens).tobytes()).hexdigest(), family)


@dataclass(frozen=True)
class ExtensionRule:
    """What a request's document keeps where it extends a resident one (`entries`), and
    how long an extension may be: on a server that compresses between chunks, one chunk (`limit`,
    C), which its request reads before any cut of its row (a longer one is compressed whole, as a
    document of its own, cut where its key says); None: any."""

    ratio: float | None
    budget: int | None
    floor: int  # what a document always keeps (`document_floor`)
    limit: int | None

    def entries(self, parent_entries: int, tokens: int) -> int | None:
        """Entries per (layer, KV head) an extension of `tokens` tokens after a document that keeps
        `parent_entries` keeps of its own, or None where it may not extend it. A ratio is of its own
        tokens (never fewer than the floor, never more than it has: a short turn is kept whole). A
        budget is of the chain: what is left of it after the parent, at least the floor (or all of
        a shorter extension); a chain at its budget is not extended: it is compressed again
        (`rebuild`)."""
        if self.limit is not None and tokens > self.limit:
            return None
        least = min(tokens, self.floor)
        if self.budget is not None:
            own = min(tokens, max(self.budget, self.floor) - parent_entries)
            return own if own >= least else None
        ratio = DEFAULT_DOCUMENT_RATIO if self.ratio is None else self.ratio
        return min(tokens, max(self.floor, math.ceil(ratio * tokens)))

    def rebuild(self, parent_entries: int, tokens: int) -> int | None:
        """The entries per (layer, KV head) of the document that compresses a chain at its budget
        again, where an extension of `tokens` tokens would exceed it (`entries` is None): the
        budget, chosen among the parent's entries and the extension's tokens together; else None."""
        if self.budget is None or (self.limit is not None and tokens > self.limit):
            return None
        if self.entries(parent_entries, tokens) is not None:
            return None
        return max(self.budget, self.floor)

    def recompress(self, parent_entries: int, tokens: int, extension: int) -> int | None:
        """The entries per (layer, KV head) of the document over `tokens` tokens that compresses a
        reply (`DocumentKey.reply`, keeping `parent_entries`) and the `extension` tokens after it
        again: the budget, or the ratio of them all, never more than they hold; None where the
        extension is too long to extend anything."""
        if self.limit is not None and extension > self.limit:
            return None
        if self.budget is not None:
            wanted = max(self.budget, self.floor)
        else:
            ratio = DEFAULT_DOCUMENT_RATIO if self.ratio is None else self.ratio
            wanted = max(self.floor, math.ceil(ratio * tokens))
        return min(parent_entries + extension, wanted)


def may_reply(req: Any) -> bool:
    """Whether `req` may keep its row as a reply when it finishes (`replies.py`): it declared a
    document on a server that extends them."""
    fields = req_state.of(req)
    return fields.extension is not None and fields.own_document is not None


def may_start_from(req: Any) -> bool:
    """Whether `req` may start from its resident document's node. Not a request that asks for its
    prompt's log-probabilities: a hit's prefix is k slots standing for D tokens, so SGLang would
    expect log-probabilities of tokens it never reads and count the rest from k, not D (its assert
    in the scheduler loop took the server down); such a request reads its prompt itself, exact,
    as on a server without documents (and may publish the document from it, read whole)."""
    from sgl_kvc.adapter.scheduling.requests import asks_prompt_logprobs

    return not asks_prompt_logprobs(req, len(getattr(req, "origin_input_ids", ())))


def held_back(waiting: list[Any], registry: DocumentRegistry) -> list[Any]:
    """The waiting requests that wait for their document to be published rather than compress it
    themselves: another request in flight (admitted, `compressing`) compresses it. Never behind one
    that is only queued (it may not be admitted for a long time, or ever: the first of them that
    is admitted compresses it, and the others wait for it from then on, `waits_in_round`), never
    past the server's bound (`stop_waiting`), and never one that may not start from it
    (`may_start_from`)."""
    held = []
    for req in waiting:
        key = declared(req)
        if key is None or registry.get(key) is not None or not may_start_from(req) or waited_out(req):
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
    key = declared(req)
    if (key is None or registry is None or registry.get(key) is not None or not may_start_from(req)
            or waited_out(req)):
        return False
    for other in admitted:
        k = declared(other)
        if other is not req and k is not None and k.digest == key.digest and _compresses(other):
            _waits(req)
            return True
    return False


def overdue(held: list[Any], bound: float, now: float | None = None) -> list[bool]:
    """Which of the held requests have waited `bound` seconds (each since it first waited),
    by this process's clock: tensor-parallel ranks vote on it before acting (`stop_waiting`)."""
    now = time.monotonic() if now is None else now
    return [now - (req_state.of(req).wait_since or now) >= bound for req in held]


def stop_waiting(held: list[Any], late: list[bool], registry: DocumentRegistry) -> list[Any]:
    """The held requests that go on waiting. Those `late` (past `--kv-document-wait`, as every
    rank agreed) wait no more for this document: they read it themselves, whatever the publisher
    they waited for still reads (its prompt is of its own tenant's choosing), and are counted in
    `documents.waited_out`."""
    still = []
    for req, done in zip(held, late):
        if done:
            req_state.of(req).waited_out = True
            registry.stats.waited_out += 1
        else:
            still.append(req)
    return still


def waited_out(req: Any) -> bool:
    return req_state.of(req).waited_out


def _waits(req: Any) -> None:
    fields = req_state.of(req)
    if fields.wait_since is None:
        fields.wait_since = time.monotonic()


def _compresses(req: Any) -> bool:
    """Whether admitted `req`, which declares a document not resident, compresses it (is
    registered as compressing it by `compressing`, unless another in flight already is): not one
    that reads its prompt whole where documents are cut between chunks (it never publishes)."""
    if req.output_ids:
        return False
    return extends(req) is not None or (hit(req) is None and (splits(req) or publishes_whole(req)))


def extends(req: Any) -> Document | None:
    """The resident document `req` started from and extends by a document of its own, which it
    publishes (`adapter/documents/extension_pass.py`), or None."""
    fields = req_state.of(req)
    key, doc = fields.document, fields.hit
    if key is None or doc is None:
        return None
    if doc.exact:  # it started from a finished turn after that document (`turns.py`)
        doc = doc.parent  # (a rebuild names the document it compresses again as its parent too)
    if not key.parent or key.parent != doc.key.digest:
        return None
    return doc


def compressing(admitted: list[Any], registry: DocumentRegistry) -> None:
    """Requests just admitted to read their prompt that compress their document: registered, so
    that later ones wait for it (`held_back`). Those that ended without publishing are forgotten."""
    registry.forget_gone()
    for req in admitted:
        key = declared(req)
        if (key is not None and _compresses(req) and registry.get(key) is None
                and registry.compressed_by(key) is None):
            registry.publishers[key.digest] = req


def declared(req: Any) -> DocumentKey | None:
    return req_state.of(req).document


def hit(req: Any) -> Document | None:
    """The document a request's matched prefix is (set at each match), or None."""
    return req_state.of(req).hit


def splits(req: Any) -> bool:
    """Whether `req` compresses its document itself, at a chunk that ends at the document's end
    (it declares one, did not start from it, and is compressed between chunks)."""
    return req_state.of(req).split and declared(req) is not None and hit(req) is None


def held_for_document(req: Any) -> int:
    """Entries of a request's row that are its document's: k after a hit or for a request that
    compresses it between chunks, D for one that reads it whole (0 without a document). Its own
    budget applies beyond them."""
    doc = hit(req)
    if doc is not None:
        return doc.key.entries
    key = declared(req)
    return 0 if key is None else key.entries if splits(req) else key.tokens


def declared_part(req: Any, config: KvcConfig, split: bool) -> int:
    """`held_for_document` of a request not yet in the queue (its document's settings unchecked:
    0 if it declares none or an invalid one, which `admit` refuses)."""
    spec = of_request(req).document
    if spec is None or spec.tokens is None:
        return 0
    return _entries(spec, config) if split else spec.tokens


def _entries(spec: DocumentSpec, config: KvcConfig) -> int:
    """k: never fewer than what the prompt policy always keeps (its sinks and window), + 1."""
    return spec.entries(document_floor(config))


def prompt_read(req: Any) -> int:
    """Tokens of `req`'s prompt it has read (SGLang's fill ids after its prefix are the rest; they
    start later by the tokens it read beyond its row's slots, `shifted_fill_ids`)."""
    return _skipped(req) + int(req.prefix_len)


def _skipped(req: Any) -> int:
    """Tokens SGLang's fill ids of `req` start after (what its row does not hold of what it read)."""
    return len(req.origin_input_ids) + len(req.output_ids) - len(req.full_untruncated_fill_ids)


def chunk_cap(req: Any) -> int | None:
    """The most tokens `req`'s next chunk may read so that one chunk ends at its document's end
    (and, a document longer than a chunk, one at each of its cuts, `cut_at`), or None: it
    compresses its document between chunks and has not read all of it."""
    if not splits(req):
        return None
    key, read = declared(req), prompt_read(req)
    left = key.tokens - read
    if left > 0 and key.every:
        left = min(left, key.every - read % key.every)
    return left if left > 0 else None


def cut_at(req: Any, end: int) -> int | None:
    """The entries the row of `req` is cut to where a chunk of it ends at prompt position `end`,
    as its document's key says: k at the document's end, `between` at a multiple of `every` before
    it, 0 elsewhere before it (not cut: neither the pool's pressure nor the request's own budget
    cuts a document, whose kept entries would then depend on its publisher); None where the
    document decides nothing (the request does not compress one between chunks, or `end` is
    past it)."""
    if not splits(req):
        return None
    key = declared(req)
    if end > key.tokens:
        return None
    if end == key.tokens:
        return key.entries
    return key.between if key.every and end % key.every == 0 else 0


def cut_inside(req: Any) -> int | None:
    """`cut_at` where the chunk of `req` that just ran ended, before its document's end (which
    `ends_here` finds), else None."""
    if not splits(req):
        return None
    end = _skipped(req) + int(req.extend_end)
    return cut_at(req, end) if end < declared(req).tokens else None


def next_cut(req: Any) -> int | None:
    """`cut_at` where the next chunk of `req` ends at the latest (`chunk_cap`), or None: what its
    admission counts that cut's copies and reconstruction forward by."""
    cap = chunk_cap(req)
    return None if cap is None else cut_at(req, prompt_read(req) + cap)


def cut(req: Any) -> None:
    """`req`'s row was cut inside its document (`cut_inside`)."""
    req_state.of(req).cuts += 1


def cuts(req: Any) -> int:
    """The cuts of `req`'s row inside its document: its passes before the one at the document's
    end, if it followed its key's procedure (`document_pass.publish_cut_rows` checks it)."""
    return req_state.of(req).cuts


def publishes_whole(req: Any) -> bool:
    """Whether `req` publishes its document read whole (`document_pass.publish_copies`): on a server that
    never cuts documents between chunks. Where they are cut between chunks, a request that reads
    its prompt whole (asking for prompt log-probabilities) publishes nothing (`KvcReq.abstains`):
    its document would keep other entries than those of the key's cuts."""
    return (declared(req) is not None and hit(req) is None and not req_state.of(req).split
            and not req_state.of(req).abstains)


def ends_here(req: Any) -> DocumentKey | None:
    """The document whose end the chunk of `req` that just ran ended at, or None. From SGLang's
    fields alone (the chunk's end in its row, `extend_end`, and the tokens its fill ids skip), so
    that every tensor-parallel rank finds the same, a request that failed on one of them too."""
    if not splits(req):
        return None
    key = declared(req)
    return key if _skipped(req) + int(req.extend_end) == key.tokens else None


def extension_due(req: Any, n: int) -> Document | None:
    """The document `req` extends (`extends`) where its row of `n` entries holds its extension
    exact after that document's entries (nothing of it compacted since it started from it: its
    fill ids are shifted by that document's offset alone) up to its own document's end, else
    None. From SGLang's fields, alike on every tensor-parallel rank."""
    parent = extends(req)
    if parent is None or _skipped(req) != parent.offset or _skipped(req) + n < declared(req).tokens:
        return None
    return parent


def extension_lost(req: Any) -> bool:
    """Whether `req`, which extends a resident document, compacted its row since it started
    from it: it will not publish its extension."""
    parent = extends(req)
    return parent is not None and _skipped(req) != parent.offset


def match_limit(req: Any, resident: bool) -> int | None:
    """The most prompt tokens `req` may match in the tree, or None (no limit): one that compresses
    its document between chunks matches fewer than D, so that a chunk of it ends at D, and fewer
    than its first cut (`every`), so that its row is cut there as its key says."""
    if resident or not splits(req):
        return None
    key = declared(req)
    return min(key.tokens, key.every or key.tokens) - 1


def fill_offset(req: Any) -> int:
    """Prompt tokens a request read beyond the slots of its matched prefix (0 without a hit)."""
    doc = hit(req)
    return 0 if doc is None else doc.offset


def node_key(key: DocumentKey, slots: int) -> Any:
    """The radix key of a document's node of `slots` slots: as many placeholder tokens, in the
    document's own namespace (`extra_key`, a `DocumentNamespace` no client's key equals), so that
    no request's tokens ever match into it and no client's node is ever under its key."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", bytes(8 * slots)), extra_key=DocumentNamespace(NAMESPACE + key.digest))


def declare(req: Any, config: KvcConfig, tree_cache: Any, split: bool = False, chunk: int | None = None) -> None:
    """When a request enters the queue: the document it declares, or its 400 (SGLang's
    `set_finish_with_abort`) when that document cannot be served for it. `split`: the request is
    compressed between chunks of its prompt (`adapter/admission.scheduler_chunk`); `chunk`: the
    server's chunk size where it compresses prompts between chunks (`admission.server_chunk`),
    else None (every request reads its prompt whole, and publishes its document so)."""
    fields = req_state.of(req)
    fields.hit, fields.split, fields.abstains, fields.cuts = None, split, not split and chunk is not None, 0
    if refused_by_sglang(req):  # SGLang's own refusal stands (its prompt is cut to one token)
        fields.document = fields.own_document = None
        return
    try:
        key = request_key(req, config, chunk)
        if key is not None and registry_of(tree_cache) is None:
            raise RequestSettingError("kv_compression.document", "shared documents live in sgl-kvc's prefix cache: "
                                      "this server runs without it (--disable-radix-cache or the hierarchical cache)")
        fields.document = fields.own_document = key
        fields.extension = None
        if key is not None and config.kv_document_extend == "resident":
            spec = of_request(req).document
            fields.extension = ExtensionRule(spec.ratio, spec.budget, document_floor(config), chunk)
        if key is not None:
            # Its exact KV never enters the tree: the document's compressed node is what later
            # requests start from, and its whole prompt and answer (several times the node's
            # size, and newer) would only push the node out of the LRU.
            req.skip_radix_cache_insert = True
    except RequestSettingError as e:
        from http import HTTPStatus

        fields.document = fields.own_document = None
        req.set_finish_with_abort(f"Invalid {e.param}: {e}", status_code=HTTPStatus.BAD_REQUEST)


def unmatched(req: Any) -> None:
    req_state.of(req).hit = None


def started_from(req: Any, doc: Document) -> None:
    """`req` published `doc` from its own row, which now starts with the document's node."""
    req_state.of(req).hit = doc


def matched(req: Any) -> None:
    """After SGLang matched a request's prefix (`Req.init_next_round_input`): if it matched a
    document's node, its fill ids start D - k tokens later (SGLang reads its extend at
    `prefix_len`, the node's k slots, in them) and nothing of it is ever inserted into the tree
    under its tokens (its row does not hold their KV)."""
    doc = getattr(getattr(req, "last_node", None), NODE_ATTR, None)
    req_state.of(req).hit = doc
    if doc is None:
        return
    from sgl_kvc.adapter.scheduling.requests import shifted_fill_ids

    shifted_fill_ids(req, doc.offset)
    req.skip_radix_cache_insert = True
