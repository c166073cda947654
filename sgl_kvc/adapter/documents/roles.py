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

    def without_start(self) -> "DocumentPlan":
        """Its own document read by itself, as it declared it (no resident node to start from)."""
        if self.own is None:
            return NO_PLAN
        return DocumentPlan(role=self.mode, own=self.own, key=self.own, mode=self.mode)


NO_PLAN = DocumentPlan()
