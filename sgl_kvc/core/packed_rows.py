"""Where every request row's packed entries are, in buffers a captured decode step reads.

A decode step that a CUDA graph can replay decides nothing from the batch's contents: it reads
the batch's rows and lengths (SGLang's static inputs, copied in before every replay) and, for the
unit pool's packed requests, where each (layer, KV head) keeps its entries. That last part changes
only when a row's layout does (a compaction, a request starting from a shared document, a row
given back), never from one step to the next, so it lives here, per `req_to_token` row, written
between steps by `install` and read on the device by the step (`kernels/row_decode.py`):

* head (l, h) of row r holds first its packed entries, `lens[r, l, h]` of them, whose units are
  `table[start[r, l, h] :][: lens[r, l, h]]` (the request's `ReqKvState.packed_entries`, each head's own
  entries only, side by side in one int32 arena);
* then its tail: row positions `packed[r]` to the row's length, one slot each, in every head
  (the tokens decoded since the compaction, or the whole row of a request never packed).

The arena holds `capacity` units (sized by the pool: `adapter/memory/kv_memory.py`). A packed
table that does not fit (requests sharing one document each hold its table) is not installed:
`installed(row)` is False and a step holding that row decodes eagerly (`KvcStore.begin_decode`).
Extents are first fit over a sorted free list, coalesced when given back.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sgl_kvc.core.request_state import ReqKvState


class PackedRows:
    """The packed layout of every row (see the module doc); `rows` rows of `layers` x `heads`
    (this rank's), an arena of `capacity` units, on `device`."""

    def __init__(self, rows: int, layers: int, heads: int, capacity: int, device: torch.device | str) -> None:
        self.layers, self.heads, self.capacity = layers, heads, capacity
        # The arena, one entry more: a column past every table reads it (unit 0, finite).
        self.table = torch.zeros(capacity + 1, dtype=torch.int32, device=device)
        self.start = torch.zeros(rows, layers, heads, dtype=torch.int32, device=device)
        self.lens = torch.zeros(rows, layers, heads, dtype=torch.int32, device=device)
        self.packed = torch.zeros(rows, dtype=torch.int32, device=device)
        self._extent: dict[int, tuple[int, int]] = {}  # row -> (start, units) in the arena
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # sorted, disjoint
        self._refused: set[int] = set()  # rows whose table did not fit
        self._widths: dict[int, int] = {}  # row -> its widest head's packed entries (host)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.table, self.start, self.lens, self.packed))

    def installed(self, row: int) -> bool:
        """Whether a step can read row `row` from these buffers."""
        return row not in self._refused

    def width(self, row: int) -> int:
        """The most packed entries a head of row `row` holds (host-side)."""
        return self._widths.get(row, 0)

    def install(self, row: int, state: "ReqKvState | None") -> bool:
        """Row `row`'s layout from its state, after anything that changed it; False when its
        packed table does not fit the arena (the row then decodes eagerly). Runs between steps
        (it reads the table's size back to the host once, as the compaction that made it did)."""
        self.clear(row)
        if state is None or state.packed_entries is None:
            return True
        entries = state.packed_entries
        lens = entries.lens.to(device=self.lens.device, dtype=torch.int64)
        width = entries.width
        units = entries.units.to(device=self.table.device)  # (layer, head, column) order
        total = entries.entries
        start = self._take(row, total)
        if start is None:
            self._refused.add(row)
            return False
        self.table[start : start + total] = units.to(torch.int32)
        flat = lens.reshape(-1)
        self.start[row] = (start + torch.cumsum(flat, 0) - flat).view_as(lens).to(torch.int32)
        self.lens[row] = lens.to(torch.int32)
        self.packed[row] = int(state.packed)
        self._widths[row] = width
        return True

    def refuse(self, row: int) -> None:
        """Row `row` cannot be read from these buffers (its install failed): it decodes eagerly."""
        self.clear(row)
        self._refused.add(row)

    def clear(self, row: int) -> None:
        """Row `row` holds nothing packed (given back, or about to be installed anew)."""
        self._refused.discard(row)
        self._widths.pop(row, None)
        extent = self._extent.pop(row, None)
        if extent is not None:
            self._give(*extent)
            self.lens[row] = 0
            self.start[row] = 0
        self.packed[row] = 0

    # --- the arena's extents ---------------------------------------------------------------
    def _take(self, row: int, size: int) -> int | None:
        if size == 0:
            self._extent[row] = (0, 0)
            return 0
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                self._extent[row] = (start, size)
                return start
        return None

    def _give(self, start: int, size: int) -> None:
        if size == 0:
            return
        i = bisect.bisect(self._free, (start, size))
        self._free.insert(i, (start, size))
        # coalesce with the neighbours
        if i + 1 < len(self._free) and start + size == self._free[i + 1][0]:
            size += self._free.pop(i + 1)[1]
            self._free[i] = (start, size)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            prev_start, prev_size = self._free.pop(i - 1)
            self._free[i - 1] = (prev_start, prev_size + size)

    @property
    def free_units(self) -> int:
        return sum(size for _, size in self._free)

    def extents(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(the rows' extents, the free ones), each (start, units), sorted: what the arena holds."""
        return sorted(e for e in self._extent.values() if e[1]), list(self._free)


def graph_width(widths: list[int], floor: int = 64) -> int:
    """The columns a step's padded (torch) attention reads, from its requests' widest tables:
    the next power of two of the widest, at least `floor`, so that steps of similar lengths share
    one shape (a graph per width, as SGLang keys its graphs by batch size)."""
    most = max(widths, default=1)
    width = floor
    while width < most:
        width *= 2
    return width
