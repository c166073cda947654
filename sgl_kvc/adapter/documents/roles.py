"""What a request does with the document it declares, as data: its plan (`DocumentPlan`), made by
`plan.py` when it enters the queue and again at each match (`matching.plan_match`).

`Role`, one value per request:
- `NONE`: it declares no document;
- `HIT`: its row starts from a resident node of its own document (or of the extension its own
  would be): it publishes nothing;
- `WHOLE`: it reads its prompt whole and publishes its document from a copy of its entries
  (`document_pass.publish_copies`), on a server that never cuts documents between chunks;
- `SPLIT`: it compresses its document between chunks, cut where its key says, and publishes its
  row's first slots (`cut_rows.publish_cut_rows`);
- `ABSTAIN`: it reads its prompt whole where documents are cut between chunks (it asked for prompt
  log-probabilities): it publishes nothing, since its entries would not be its key's;
- `EXTEND`: it starts from a resident document its own extends (or a finished turn after it) and
  publishes the extension (`extensions.py`), and reads its question from it;
- `REBUILD`: the same, where the chain is at its budget or depth, or is a reply: it compresses the
  chain and its extension again as one document.

`DocumentPlan.start` is the node its row starts from (its `layout` the row's arithmetic),
`parent` the document its key follows, `key` the document it compresses (or, a hit, the one it
starts from), `own` the one it declared and `mode` how it reads that one without a start.
What follows from the plan alone is its property or method: where its row is cut as its key says
(`cut_at`, `chunk_cap`, `ended_at`), how much of its row is its document's (`held_for_document`),
how far it may match in the tree (`match_limit`); `plan.py` reads the positions from SGLang's
request that they are asked of.

A leaf of `documents/`: the request object (`adapter/kvc_req.py`) holds a plan, and the modules
that make and read plans read it through that object.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from sgl_kvc.adapter.documents.keys import DocumentKey
from sgl_kvc.adapter.documents.links import RowLayout

if TYPE_CHECKING:
    from sgl_kvc.adapter.documents.links import Document


class Role(str, Enum):
    NONE = "none"
    HIT = "hit"
    WHOLE = "whole"
    SPLIT = "split"
    ABSTAIN = "abstain"
    EXTEND = "extend"
    REBUILD = "rebuild"


PUBLISHES = (Role.WHOLE, Role.SPLIT, Role.EXTEND, Role.REBUILD)


@dataclass(frozen=True)
class DocumentPlan:
    role: Role = Role.NONE
    own: DocumentKey | None = None
    key: DocumentKey | None = None
    start: "Document | None" = None
    parent: "Document | None" = None
    mode: Role = Role.WHOLE

    @property
    def layout(self) -> RowLayout:
        return self.start.layout if self.start is not None else RowLayout()

    @property
    def splits(self) -> bool:
        """It compresses its document itself, at a chunk that ends at the document's end."""
        return self.role is Role.SPLIT

    @property
    def adopts(self) -> bool:
        """It extends (or compresses again) a resident document on a server that compresses
        documents between chunks: as a `SPLIT` request reads its question from the row its
        document's cut left, it reads its question from the chain its extension ends, once that is
        published (`extensions.adopt`), so one of its chunks ends at its document's end."""
        return self.role in (Role.EXTEND, Role.REBUILD) and self.mode is Role.SPLIT

    @property
    def publishes_whole(self) -> bool:
        """It publishes its document read whole (`document_pass.publish_copies`)."""
        return self.role is Role.WHOLE

    @property
    def extends(self) -> "Document | None":
        """The resident document it starts from and extends (or compresses again) by a document
        of its own, which it publishes (`extensions.py`), or None."""
        return self.parent if self.role in (Role.EXTEND, Role.REBUILD) else None

    @property
    def held_for_document(self) -> int:
        """Entries of its row that are its document's: the chain's after a hit or an extension's
        start, k for a request that compresses it between chunks, D for one that reads it whole (0
        without a document). Its own budget applies beyond them."""
        if self.start is not None:
            return self.start.key.entries
        if self.key is None:
            return 0
        return self.key.entries if self.role is Role.SPLIT else self.key.tokens

    @property
    def fill_offset(self) -> int:
        """Prompt tokens its row read beyond the slots of its matched prefix (0 without a start)."""
        return self.layout.offset

    # Where a `SPLIT` request's document is cut: as its key says, never as the pool's pressure or
    # its publisher's budget would. It reads the document in chunks, one of which ends exactly at
    # D (`chunk_cap`), where its row is cut to the document's k entries before any of its question
    # is read; a document longer than a chunk (C) is also cut at every multiple of C before D, to
    # `DocumentKey.between` entries (`cut_at`). The positions are SGLang's fields, alike on every
    # rank (`plan.prompt_read`, `plan.chunk_end`).

    @property
    def cut_by_key(self) -> bool:
        """Its chunks end where its key says: it compresses its document between chunks
        (`splits`) or adopts its extension (`adopts`)."""
        return self.splits or self.adopts

    def chunk_cap(self, read: int) -> int | None:
        """The most tokens its next chunk may read, `read` tokens of its prompt read, so that one
        chunk ends at its document's end (and, a document longer than a chunk, one at each of its
        cuts, `cut_at`), or None: it compresses its document between chunks (or adopts its
        extension, `adopts`) and has not read all of it."""
        if not self.cut_by_key:
            return None
        key = self.key
        left = key.tokens - read
        if left > 0 and key.every and self.splits:
            left = min(left, key.every - read % key.every)
        return left if left > 0 else None

    def cut_at(self, end: int) -> int | None:
        """The entries its row is cut to where a chunk of it ends at prompt position `end`, as its
        document's key says: k at the document's end, `between` at a multiple of `every` before it,
        0 elsewhere before it (not cut); None where the document decides nothing (it does not
        compress one between chunks, or `end` is past it). An extension (`adopts`) is read whole
        before it is published, in however many chunks SGLang's rounds read it: 0 before its end
        (a cut there would lose it), None at its end, where its request adopts it."""
        if self.adopts:
            return 0 if end < self.key.tokens else None
        if not self.splits:
            return None
        key = self.key
        if end > key.tokens:
            return None
        if end == key.tokens:
            return key.entries
        return key.between if key.every and end % key.every == 0 else 0

    def cut_inside(self, end: int) -> int | None:
        """`cut_at` where a chunk ended at `end` before its document's end (which `ended_at`
        finds), else None."""
        if not self.cut_by_key:
            return None
        return self.cut_at(end) if end < self.key.tokens else None

    def ended_at(self, end: int) -> DocumentKey | None:
        """The document it compresses between chunks (`splits`), or the extension it adopts
        (`adopts`), whose end a chunk that ended at `end` reached, or None."""
        if not self.cut_by_key:
            return None
        return self.key if end == self.key.tokens else None

    @property
    def match_limit(self) -> int | None:
        """The most prompt tokens it may match in the tree, or None (no limit): one that compresses
        its document between chunks matches fewer than D, so that a chunk of it ends at D, and
        fewer than its first cut (`every`), so that its row is cut there as its key says."""
        if not self.splits:
            return None
        return min(self.key.tokens, self.key.every or self.key.tokens) - 1

    def without_start(self) -> "DocumentPlan":
        """Its own document read by itself, as it declared it (no resident node to start from)."""
        if self.own is None:
            return NO_PLAN
        return DocumentPlan(role=self.mode, own=self.own, key=self.own, mode=self.mode)


NO_PLAN = DocumentPlan()
