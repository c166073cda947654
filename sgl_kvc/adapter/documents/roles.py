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

    def without_start(self) -> "DocumentPlan":
        """Its own document read by itself, as it declared it (no resident node to start from)."""
        if self.own is None:
            return NO_PLAN
        return DocumentPlan(role=self.mode, own=self.own, key=self.own, mode=self.mode)


NO_PLAN = DocumentPlan()
