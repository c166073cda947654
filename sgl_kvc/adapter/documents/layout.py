"""Where a row's slots stand in its request's sequence: the one place for the arithmetic between
physical indices (a row's slots) and logical positions (tokens) of a row that starts from a
document.

A row that starts from a document holds first the chain's `held` slots, standing for the
sequence's first `covers` tokens (compressed: fewer slots than tokens), then one slot per token,
in order: the token at logical position t >= covers is in slot t - offset, offset = covers -
held. SGLang knows nothing of it: it reads the request's next tokens at the row's length, so the
request's fill ids are shifted by the offset (`adapter/scheduling/requests.shifted_fill_ids`), and
`fill_skip` reads the offset back from SGLang's own fields, alike on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowLayout:
    """A row that starts with `held` slots standing for the first `covers` tokens, then one slot a
    token (0, 0: a row of its own tokens only)."""

    held: int = 0
    covers: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.held <= self.covers:
            raise ValueError(f"a row's first {self.held} slots cannot stand for {self.covers} tokens")

    @property
    def offset(self) -> int:
        """Logical minus physical position of every token after the held slots."""
        return self.covers - self.held

    def slot(self, token: int) -> int:
        """The row index of the token at logical position `token` (at least `covers`)."""
        if token < self.covers:
            raise ValueError(f"token {token} is among the {self.covers} the held slots stand for")
        return token - self.offset

    def tokens(self, slots: int) -> int:
        """Tokens a row of `slots` slots (at least the held ones) has read."""
        if slots < self.held:
            raise ValueError(f"a row of {slots} slots is shorter than its {self.held} held ones")
        return slots + self.offset

    def span(self, first: int, end: int) -> tuple[int, int]:
        """The row's slots [a, b) of the tokens [first, end), every one after the held ones."""
        return self.slot(first), self.slot(end)


def fill_skip(req: Any) -> int:
    """Tokens SGLang's fill ids of `req` start after: what its row does not hold of what it read
    (a hit's offset, or, compacted between chunks, its own)."""
    return len(req.origin_input_ids) + len(req.output_ids) - len(req.full_untruncated_fill_ids)


def prompt_read(req: Any) -> int:
    """Tokens of `req`'s prompt it has read: its matched prefix's slots, and what they stand for
    beyond themselves (`fill_skip`)."""
    return fill_skip(req) + int(req.prefix_len)
