"""Each mixture source's share of the samples trained, for the logged rows of a fit on a ``Mixture``.

The loop notes which batches each optimizer step trained (a few integers); a logged row turns them into
``data/share/NAME``, each source's fraction of the samples trained since the last row. The source of every sample
follows from the mixture's draws and the sampler's global positions, the same on every rank: no collective.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class SourceShares:
    """Does nothing when the training data is no Mixture (one early return per step)."""

    def __init__(self, batches: Any):
        self.batches = batches
        self.active = getattr(batches, "mixture", None) is not None
        self._spans: list = []  # (epoch, first batch, end batch) trained since the last row

    def add(self, epoch: int, first: int, count: int) -> None:
        """Batches ``first … first + count - 1`` of ``epoch`` were trained (one step's window)."""
        if not self.active:
            return
        if self._spans and self._spans[-1][0] == epoch and self._spans[-1][2] == first:
            self._spans[-1] = (epoch, self._spans[-1][1], first + count)
        else:
            self._spans.append((epoch, first, first + count))

    def take(self) -> dict:
        """``{"data/share/NAME": fraction}`` of the samples trained since the last call; {} when none were."""
        totals: Counter = Counter()
        for epoch, first, end in self._spans:
            totals.update(self.batches.source_counts(epoch, first, end - first))
        self._spans = []
        n = sum(totals.values())
        return {f"data/share/{name}": count / n for name, count in totals.items()} if n else {}
