"""What identifies a document, and decides what it holds: its key (docs/architecture.md, "Shared
documents").

Every key is a digest of everything that decides its node's content: the tokens it covers, the
namespace and settings it is compressed with, how many entries it keeps, and, for a link of a
chain, the key of the link it follows. Two tenants that name the same document with the same
settings get the same entries, whoever published it; a tenant with other settings gets another
key, never another tenant's node.

The kinds of node (`Kind`): a document compressed from a request's prompt (`ROOT`, also a chain
compressed again as one, `REBUILD`), one that extends a resident one by a conversation's turn
(`EXTENSION`), a finished request's compacted row (`REPLY`) and a finished turn's exact tokens
after a document (`TURN`).
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

from sgl_kvc.config import DEFAULT_TURN_WINDOW, KvcConfig
from sgl_kvc.request_settings import DEFAULT_DOCUMENT_RATIO, DocumentSpec, RequestSettingError, document_floor

NODE_ATTR = "sgl_kvc_document"  # on a radix TreeNode: the Document it holds
NAMESPACE = "sgl-kvc/document/"  # the extra_key prefix of a document node, reserved (`reserved_namespace`)


class Kind(str, Enum):
    ROOT = "root"  # compressed from a request's prompt, query-agnostically
    EXTENSION = "extension"  # a resident document's entries, then a turn's own chosen among its tokens
    REBUILD = "rebuild"  # a chain (or a reply) and a turn compressed again, as one document
    REPLY = "reply"  # a finished request's compacted row: what its own passes kept
    TURN = "turn"  # a finished turn's question and answer, exact, after a document


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
    """What identifies a document and decides what it keeps: a hash of its tokens, the request's
    namespace (`extra_key`, `cache_salt`) and how it is compressed (prompt policy, entries,
    selection, the cuts before its end), and of the key of the link it follows."""

    digest: str
    tokens: int  # D: prompt tokens the document covers
    entries: int  # k: entries each (layer, KV head) keeps (of the whole chain, for a link of one)
    policy: str  # the prompt policy that compresses it
    # Cut between chunks, a document longer than one chunk: its row is cut at every multiple of
    # `every` (C, the server's chunk size) before D, to `between` entries (the chunk target of k,
    # `--kv-chunk-keep`); 0: it is scored once, from its D exact entries.
    every: int = 0
    between: int = 0
    # What a conversation's next document matches by (`matching.py`): a hash of the namespace and
    # settings a document is compressed with but not of how many entries it keeps (`family`), and
    # of that and its D tokens (`content`).
    family: str = ""
    content: str = ""
    kind: Kind = Kind.ROOT
    # The link it follows (by digest: in its own), which kept `parent_entries` per (layer, KV
    # head) of the chain before it: an extension keeps those, then `entries - parent_entries` of
    # its own; a turn follows it exact; a rebuild names the chain it compressed again (0 held).
    parent: str = ""
    parent_entries: int = 0
    # A reply's: the digest of the decode settings that compressed it (`plan.settings_digest`), which a
    # request must share to start from it; inherited by every document made from it (an
    # extension, a rebuild, a turn after it), whose entries its decode chose too.
    settings: str = ""


def document_entries(spec: DocumentSpec, config: KvcConfig) -> int:
    """k: never fewer than what the prompt policy always keeps (its sinks and window), + 1."""
    return spec.entries(document_floor(config))


def content_digest(tokens_digest: str, family: str) -> str:
    """`DocumentKey.content` of a document whose tokens hash to `tokens_digest` (sha256)."""
    return hashlib.sha256(f"{family}/{tokens_digest}".encode()).hexdigest()


def tokens_content(tokens: Sequence[int], family: str) -> str:
    """`DocumentKey.content` of a document of `tokens` (all of them, from the first)."""
    return content_digest(hashlib.sha256(array("q", tokens).tobytes()).hexdigest(), family)


def extension_key(own: DocumentKey, parent: DocumentKey, prompt: Sequence[int], entries: int,
                  rebuilds: bool = False) -> DocumentKey:
    """The key of the document over `own`'s tokens that keeps `parent`'s entries and `entries`
    of its own tokens (per layer and KV head): a hash of the parent's key, of its own tokens, and
    of how many it keeps. `rebuilds`: that keeps `entries` in all, chosen among the parent's
    entries and its own tokens (a chain compressed again, under the root)."""
    h = hashlib.sha256(parent.digest.encode())
    h.update(array("q", prompt[parent.tokens: own.tokens]).tobytes())
    h.update(repr(("rebuilds" if rebuilds else "extends", entries)).encode())
    return DocumentKey(digest=h.hexdigest(), tokens=own.tokens, entries=entries if rebuilds else parent.entries + entries,
                       policy=own.policy, family=own.family, content=own.content,
                       kind=Kind.REBUILD if rebuilds else Kind.EXTENSION, parent=parent.digest,
                       parent_entries=0 if rebuilds else parent.entries, settings=parent.settings)


def turn_key(parent: DocumentKey, tokens: Sequence[int]) -> DocumentKey:
    """The key of the turn of `tokens` (all of them, from the first) after the document `parent`."""
    content = tokens_content(tokens, parent.family)
    own = hashlib.sha256(parent.digest.encode())
    own.update(array("q", tokens[parent.tokens:]).tobytes())
    own.update(b"turn")
    n = len(tokens) - parent.tokens
    return DocumentKey(digest=own.hexdigest(), tokens=len(tokens), entries=parent.entries + n,
                       policy=parent.policy, family=parent.family, content=content, kind=Kind.TURN,
                       parent=parent.digest, parent_entries=parent.entries, settings=parent.settings)


def reply_key(declared: DocumentKey, tokens: Sequence[int], entries: int, settings: str, start: str) -> DocumentKey:
    """The key of a reply over `tokens` (all of them, from the first), in `declared`'s family,
    keeping `entries` per (layer, KV head) (on average, packed), compressed by the decode
    settings `settings` (`plan.settings_digest`) from a row that started from the node `start` (its
    digest; "" for none): what the reply holds follows from these alone."""
    content = tokens_content(tokens, declared.family)
    digest = hashlib.sha256(repr(("reply", content, entries, settings, start)).encode()).hexdigest()
    return DocumentKey(digest=digest, tokens=len(tokens), entries=entries, policy=declared.policy,
                       family=declared.family, content=content, kind=Kind.REPLY, settings=settings)


def node_key(key: DocumentKey, slots: int) -> Any:
    """The radix key of a document's node of `slots` slots: as many placeholder tokens, in the
    document's own namespace (`extra_key`, a `DocumentNamespace` no client's key equals), so that
    no request's tokens ever match into it and no client's node is ever under its key."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", bytes(8 * slots)), extra_key=DocumentNamespace(NAMESPACE + key.digest))


def refusal(e: RequestSettingError) -> str:
    """The 400's message of a document that cannot be served."""
    return f"Invalid {e.param}: {e}"


# How much a conversation's next document keeps where it follows a resident one: an extension of
# its own tokens, or, at the chain's budget or depth, or after a reply, the whole compressed again
# as one document. Part of every extension's key (`extension_key`).


@dataclass(frozen=True)
class ExtensionRule:
    """What a request's document keeps where it extends a resident one (`entries`), and how long
    an extension may be: on a server that compresses between chunks, one chunk (`limit`, C), which
    its request reads before any cut of its row (a longer one is compressed whole, as a document of
    its own, cut where its key says); None: any. `depth`: the most compressed links a chain holds
    (`--kv-document-depth`): a chain that deep is compressed again as one document, whatever the
    client sends, so that no chain grows without bound. `window`: what a chain compressed by a
    ratio holds at most beyond that ratio of all its tokens (`--kv-turn-window`). `settings`: the
    request's own decode settings (`plan.settings_digest`), which a reply it may start from must
    share."""

    ratio: float | None
    budget: int | None
    floor: int  # what a document always keeps (`document_floor`)
    limit: int | None
    depth: int = 16
    settings: str = ""
    window: int = DEFAULT_TURN_WINDOW

    def entries(self, parent_entries: int, parent_tokens: int, tokens: int) -> int | None:
        """Entries per (layer, KV head) an extension of `tokens` tokens after a chain over
        `parent_tokens` tokens that keeps `parent_entries` keeps of its own, or None where it may
        not extend it. A budget is of the chain: what is left of it after the parent, at least the
        floor (or all of a shorter extension). A ratio is of the chain's tokens too, as compressing
        the conversation anew keeps (`target`), and the latest turns are kept whole: an extension
        keeps all its tokens while the chain then holds at most `window` entries beyond that. The
        share of its own tokens an extension used to keep was chosen without its parent's, and
        answered unlike compressing anew (docs/quality.md, Conversations); a turn's question and
        answer are what the next question most likely reads. A chain past its budget or window is
        not extended: it is compressed again (`rebuild`), one ranking over the parent's entries and
        the extension's tokens, as compressing anew ranks the whole conversation."""
        if self.limit is not None and tokens > self.limit:
            return None
        if self.budget is not None:
            own = min(tokens, max(self.budget, self.floor) - parent_entries)
            return own if own >= min(tokens, self.floor) else None
        if parent_entries + tokens <= self.target(parent_tokens + tokens) + self.window:
            return tokens
        return None

    def target(self, tokens: int) -> int:
        """Entries per (layer, KV head) of a chain over `tokens` tokens compressed as one: the
        budget, or the ratio of them (never below the floor)."""
        if self.budget is not None:
            return max(self.budget, self.floor)
        ratio = DEFAULT_DOCUMENT_RATIO if self.ratio is None else self.ratio
        return max(self.floor, math.ceil(ratio * tokens))

    def rebuild(self, parent_entries: int, parent_tokens: int, tokens: int) -> int | None:
        """The entries per (layer, KV head) of the document that compresses a chain past its
        budget or window again, where an extension of `tokens` tokens may not extend it (`entries`
        is None): its `target`, chosen among the parent's entries and the extension's tokens
        together; else None."""
        if self.limit is not None and tokens > self.limit:
            return None
        if self.entries(parent_entries, parent_tokens, tokens) is not None:
            return None
        return min(parent_entries + tokens, self.target(parent_tokens + tokens))

    def recompress(self, parent_entries: int, tokens: int, extension: int) -> int | None:
        """The entries per (layer, KV head) of the document over `tokens` tokens that compresses a
        chain (or a reply) keeping `parent_entries` and the `extension` tokens after it again as
        one: the budget, or the ratio of them all, never more than they hold; None where the
        extension is too long to extend anything."""
        if self.limit is not None and extension > self.limit:
            return None
        return min(parent_entries + extension, self.target(tokens))
