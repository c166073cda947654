"""How much a conversation's next document keeps where it follows a resident one
(`ExtensionRule`): an extension of its own tokens, or, at the chain's budget or depth, or after a
reply, the whole compressed again as one document."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sgl_kvc.request_settings import DEFAULT_DOCUMENT_RATIO


@dataclass(frozen=True)
class ExtensionRule:
    """What a request's document keeps where it extends a resident one (`entries`), and how long
    an extension may be: on a server that compresses between chunks, one chunk (`limit`, C), which
    its request reads before any cut of its row (a longer one is compressed whole, as a document of
    its own, cut where its key says); None: any. `depth`: the most compressed links a chain holds
    (`--kv-document-depth`): a chain that deep is compressed again as one document, whatever the
    client sends, so that no chain grows without bound. `settings`: the request's own decode
    settings (`keys.settings_digest`), which a reply it may start from must share."""

    ratio: float | None
    budget: int | None
    floor: int  # what a document always keeps (`document_floor`)
    limit: int | None
    depth: int = 16
    settings: str = ""

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
        chain (or a reply) keeping `parent_entries` and the `extension` tokens after it again as
        one: the budget, or the ratio of them all, never more than they hold; None where the
        extension is too long to extend anything."""
        if self.limit is not None and extension > self.limit:
            return None
        if self.budget is not None:
            wanted = max(self.budget, self.floor)
        else:
            ratio = DEFAULT_DOCUMENT_RATIO if self.ratio is None else self.ratio
            wanted = max(self.floor, math.ceil(ratio * tokens))
        return min(parent_entries + extension, wanted)
