"""What the moments' modules read of the compressor that runs them (`compressor.Compressor`), and
nothing more: they take it as a `Host`, so none of them imports the compressor, which imports
them all.

The compressor's shared parts: its settings, the observation store, the counters, the failure
ledger (and the ranks' vote in it), the shared documents' wiring (`document_pass.Host`, which this
extends), the per-head compactions due in the current moment (`due`) and the compression work in
this scheduler step so far (`step_seconds`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from sgl_kvc.adapter.documents.document_pass import Host as DocumentHost

if TYPE_CHECKING:
    from sgl_kvc.adapter.safety.tp import ScoreReducer
    from sgl_kvc.adapter.telemetry.metrics import CompressionStats
    from sgl_kvc.core.passes import DueCompaction


class Host(DocumentHost, Protocol):
    """The compressor, as the moments see it (`document_pass.Host` for the documents they publish)."""

    stats: CompressionStats
    first_layer: int
    num_layers: int
    # Requests that may hold prompt moments at once (None: not bounded, `Compressor.__init__`).
    moment_slots: int | None
    # Averages a shared selection's scores over the tensor-parallel group (None: one rank).
    reduce_scores: ScoreReducer | None
    due: list[DueCompaction]  # per-head and shared compactions of the current moment
    step_seconds: float  # compression work in this step so far

    def layers(self) -> range: ...
