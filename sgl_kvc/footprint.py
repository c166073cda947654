"""The most KV slots one compressing request holds at once, under a server's compression moments.

Admission (a new request, and the next chunk of a prompt read in chunks), the reservation of a
running request (what SGLang's next prefill round leaves room for) and the chunk moment's trigger
all ask this one function, so they agree. It counts, in slots:

- the prompt as it is read: whole, or, compressed between chunks, one chunk on top of what a pass
  between chunks keeps;
- the fresh slots a compaction copies its kept entries into: SGLang publishes what a request has
  read to the radix tree, so until a request's first compaction every entry it holds is the
  tree's, which is never written, and a compaction to `target` entries that holds `tree` of the
  tree's entries peaks at `max(held, target + tree)`
  (`adapter/moments/compaction.py`);
- the generated tokens: with the decode or the preempt moment on, what a pass brings back to the
  budget (budget + buffer + 1 at most); with neither, every token it may still generate.

Plain integers; no SGLang. `adapter/scheduling/admission.py` reads them from SGLang's requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_kvc.config import KvcConfig


@dataclass(frozen=True)
class Moments:
    """Which compression moments a server runs, as far as memory is concerned."""

    prefill: bool = True  # a prompt over its budget is cut to it after its last chunk
    between_chunks: bool = False  # a prompt read in chunks is cut back between them
    generation: bool = True  # the decode or the preempt moment bring generated tokens back to the budget

    @classmethod
    def of(cls, config: KvcConfig) -> "Moments":
        moments = config.compress_on
        return cls(prefill="prefill" in moments, between_chunks=config.chunk_moment is not None,
                   generation="decode" in moments or "preempt" in moments)


@dataclass(frozen=True)
class Sizes:
    """A request's sizes, in tokens: `budget` at its longest (a ratio budget grows with the
    length), the decode `buffer`, what a pass between chunks `keep`s, the `chunk` its prompt is
    read in when it is compressed between chunks (None: it is not), and whether what it reads is
    `published` to the radix tree (not with `--disable-radix-cache`), the slots one
    `reconstruction` forward holds at a prompt moment (0: its prompt policy reads none), and those
    the forward of its `question` holds at a cut between chunks (0: its window is the chunk's)."""

    budget: int
    buffer: int
    keep: int
    chunk: int | None = None
    published: bool = True
    reconstruction: int = 0
    question: int = 0

    @property
    def cut_forward(self) -> int:
        """Slots a forward holds at a cut between chunks, before the cut's pass copies (freed
        first): its reconstruction's or its question's."""
        return max(self.reconstruction, self.question)


@dataclass(frozen=True)
class Now:
    """Where a request stands: the slots its row `held` (a cached prefix it locks included),
    `tree` of them the radix tree's, the prompt tokens still to read, the tokens it may still
    generate, and whether its pass after prefill is still to come (a prompt over its budget
    that has not been compacted yet)."""

    held: int = 0
    tree: int = 0
    prompt_left: int = 0
    out_left: int = 0
    prefill_due: bool = True


def most_held(moments: Moments, sizes: Sizes, now: Now) -> int:
    """Most slots the request's row holds at once from `now` to its end, the fresh slots of its
    compactions included (at least `now.held`)."""
    n, tree = now.held, now.tree
    publishing = sizes.published and tree >= n  # not compacted yet: everything it reads goes to the tree
    peak = n
    left = now.prompt_left
    if left > 0:
        chunk = sizes.chunk
        if moments.between_chunks and chunk is not None and left > chunk:
            # Its first pass between chunks comes once it holds more than it keeps; it then
            # holds at most one chunk beyond that (or beyond its cached prefix).
            first = min(max(n, sizes.keep) + chunk, n + left)
            tree_first = tree + (first - n) if publishing else tree
            if first < n + left:
                # A pass between chunks (each later one holds at most what this one does).
                peak = max(peak, first, sizes.keep + tree_first, first + sizes.cut_forward)
                # Every later chunk lands on what the previous pass kept, all of it its own.
                n, tree = sizes.keep + min(n + left - first, chunk), 0
            else:
                if first > sizes.keep:  # a pass may still come before its last chunk
                    peak = max(peak, sizes.keep + tree_first)
                n, tree = first, tree_first
        else:
            n, tree = n + left, (tree + left if publishing else tree)
        peak = max(peak, n)
    if moments.prefill and now.prefill_due and sizes.reconstruction:
        peak = max(peak, n + sizes.reconstruction)  # its reconstruction forward, before the pass chooses
    if moments.prefill and now.prefill_due and n > sizes.budget:
        # Every policy's pass after prefill keeps at most the budget.
        peak = max(peak, sizes.budget + tree)
        n, tree = sizes.budget, 0
    out = now.out_left
    if out > 0:
        if moments.generation:
            # A decode pass starts by budget + buffer (Batch-Max: at the budget) and keeps at most
            # the budget; the step after the last pass allocates one more slot.
            peak = max(peak, min(n + out, max(n, sizes.budget + sizes.buffer + 1)))
            if n + out > sizes.budget:
                peak = max(peak, sizes.budget + tree)
        else:
            peak = max(peak, n + out)
    return peak


def compaction_copies(held: int, tree: int, target: int) -> int:
    """Fresh slots a compaction to `target` entries of a row that holds `held` slots, `tree` of
    them the radix tree's, needs: the kept entries go to slots the request owns, and it owns
    `held - tree`."""
    return max(0, target - (held - tree))
