"""Where a document compressed between chunks is cut (`Role.SPLIT`): as its key says, never as the
pool's pressure or its publisher's own budget would (`cut_at`).

On a server that compresses between chunks, the request reads the document in chunks, one of
which ends exactly at D (`chunk_cap`), and its row is cut to the document's k entries there,
before any of its question is read; a document longer than one chunk (C, `--chunked-prefill-size`)
is also cut at every multiple of C before D, to `DocumentKey.between` entries. Everything here is
read from SGLang's fields (the chunk's end in the row, the tokens its fill ids skip), alike on
every tensor-parallel rank.
"""

from __future__ import annotations

from typing import Any

from sgl_kvc import req_state
from sgl_kvc.adapter.documents.keys import DocumentKey
from sgl_kvc.adapter.documents.layout import fill_skip, prompt_read
from sgl_kvc.adapter.documents.plan import declared, splits


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
    it, 0 elsewhere before it (not cut); None where the document decides nothing (the request
    does not compress one between chunks, or `end` is past it)."""
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
    end = fill_skip(req) + int(req.extend_end)
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


def ends_here(req: Any) -> DocumentKey | None:
    """The document whose end the chunk of `req` that just ran ended at, or None."""
    if not splits(req):
        return None
    key = declared(req)
    return key if fill_skip(req) + int(req.extend_end) == key.tokens else None


def match_limit(req: Any) -> int | None:
    """The most prompt tokens `req` may match in the tree, or None (no limit): one that compresses
    its document between chunks matches fewer than D, so that a chunk of it ends at D, and fewer
    than its first cut (`every`), so that its row is cut there as its key says."""
    if not splits(req):
        return None
    key = declared(req)
    return min(key.tokens, key.every or key.tokens) - 1
