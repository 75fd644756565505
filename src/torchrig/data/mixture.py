"""A mixture of named data sets drawn by weight: ``Mixture({"web": a, "code": b}, weights={"web": 0.7, "code": 0.3})``.

An **epoch** of a mixture holds ``samples_per_epoch`` samples (default: the sources' lengths added up, so each
source is seen about once per epoch at weights proportional to their lengths, the default weights). Position ``p`` of
epoch ``e`` (global position ``e × samples_per_epoch + p``) is mapped to a sample by a pure function of
``(seed, e, p)``, with no state:

* **which source** – every epoch holds each source's quota, ``weight × samples_per_epoch`` rounded (largest
  remainders), laid out in an order drawn by a generator seeded from ``(seed, e)``. An epoch's shares are the
  weights exactly; within a part of an epoch (a logged window) they vary as draws without replacement do.
* **which sample of it** – the ``j``-th draw of source ``s`` over the run (``e × quota`` plus the draw's rank in the
  epoch) is item ``j mod len(s)`` of that source's pass ``j // len(s)``, a permutation seeded from ``(seed, the
  source's name, pass)``: each source is walked in its own seeded order, pass after pass, whatever the others hold.
* **shuffle** – ``data.shuffle`` (``Trainer(..., shuffle=...)``) is about the sources' walks: false walks each in its
  own order (0, 1, 2 …), pass after pass. The layout of the sources in an epoch is drawn by weight either way (that
  draw is the mixture), and the sampler takes an epoch's positions in order instead of shuffling them again.

Because the map holds no state, the sampler's global positions are the whole data position: a resume is exact on
the same and on another number of processes, and every rank knows the source of every sample of a step without
communicating (the logged ``data/share/NAME``).

Streams (``IterableDataset``) cannot be sources: a mixture draws its samples by position, which a stream has not,
and a stream's checkpointed position is one per reader, not one per source.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from ..errors import suggest
from .common import DataError, as_dataset, is_iterable_source, torch_format
from .workers import seed_sample

_LAYOUT, _WALK = 0x6D6978, 0x77616C6B  # keep a layout's generator apart from a walk's with the same numbers


def _generator(*parts: int) -> torch.Generator:
    s = 0
    for p in parts:
        s = (s * 1_000_003 + int(p)) % (2**63 - 1)
    g = torch.Generator()
    g.manual_seed(s)
    return g


class Mixture(Dataset):
    """Named map-style sources drawn by weight (see the module's text); what ``Trainer.fit`` takes as training data.

    ``sources``: ``{name: Dataset or tensors}``; ``weights``: ``{name: weight > 0}`` (any scale; default: the sources'
    lengths); ``samples_per_epoch``: samples in an epoch (default: the sources' lengths added up); ``seed``: the draws'
    seed (default: the run's). ``mixture[g]`` is the sample at global position ``g`` (with ``seed``, or 0)."""

    def __init__(self, sources: Mapping[str, Any], weights: Optional[Mapping[str, float]] = None, *,
                 samples_per_epoch: Optional[int] = None, seed: Optional[int] = None):
        self.names, self.sources = _sources(sources)
        self.lengths = [len(s) for s in self.sources]
        self.weights = _weights(weights, self.names, self.lengths)
        if samples_per_epoch is not None and (isinstance(samples_per_epoch, bool) or not isinstance(
                samples_per_epoch, int) or samples_per_epoch < 1):
            raise DataError(f"Mixture samples_per_epoch: expected an integer >= 1 or None, got {samples_per_epoch!r}")
        self.samples_per_epoch = samples_per_epoch or sum(self.lengths)
        self.quotas = _quotas(self.names, self.weights, self.samples_per_epoch)
        self.seed = seed
        self._layouts: dict = {}  # (seed, epoch) -> (source, rank) of each position: the last two epochs asked
        self._walks: dict = {}  # source -> ((seed, pass), its order): the pass being read

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, position: int) -> Any:
        epoch, p = divmod(int(position), self.samples_per_epoch)
        return self.sample(self.seed or 0, epoch, p, shuffle=True)

    def layout(self, seed: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(source number, rank among the epoch's draws of that source)`` of every position of ``epoch``."""
        key = (seed, epoch)
        if key not in self._layouts:
            quotas = torch.tensor(self.quotas)
            source = torch.repeat_interleave(torch.arange(len(self.names), dtype=torch.int32), quotas)
            source = source[torch.randperm(self.samples_per_epoch, generator=_generator(_LAYOUT, seed, epoch))]
            rank = torch.empty_like(source)
            for s, quota in enumerate(self.quotas):
                rank[source == s] = torch.arange(quota, dtype=torch.int32)
            if len(self._layouts) >= 2:  # the last two epochs asked: a logged window may end in the previous one
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = (source, rank)
        return self._layouts[key]

    def locate(self, seed: int, epoch: int, position: int, shuffle: bool = True) -> tuple[str, int]:
        """``(source name, index in that source)`` of ``position`` of ``epoch``."""
        source, rank = self.layout(seed, epoch)
        s = int(source[position])
        walk, at = divmod(epoch * self.quotas[s] + int(rank[position]), self.lengths[s])
        return self.names[s], int(self._walk(seed, s, walk)[at]) if shuffle else at

    def _walk(self, seed: int, s: int, walk: int) -> torch.Tensor:
        held = self._walks.get(s)
        if held is None or held[0] != (seed, walk):
            g = _generator(_WALK, seed, zlib.crc32(self.names[s].encode()), walk)
            held = self._walks[s] = ((seed, walk), torch.randperm(self.lengths[s], generator=g))
        return held[1]

    def sample(self, seed: int, epoch: int, position: int, shuffle: bool = True) -> Any:
        name, index = self.locate(seed, epoch, position, shuffle)
        return self.sources[self.names.index(name)][index]

    def counts(self, seed: int, epoch: int, positions: torch.Tensor) -> dict[str, int]:
        """How many of ``positions`` of ``epoch`` each source holds, by name."""
        source, _ = self.layout(seed, epoch)
        found = torch.bincount(source[positions].long(), minlength=len(self.names)).tolist()
        return dict(zip(self.names, found))


class MixtureSamples(Dataset):
    """A Mixture as the loader reads it: items are the sampler's ``(position, epoch)``, drawn with the run's seed
    (unless the mixture has its own); ``seeded``: the random generators are seeded from ``(seed, epoch, position)``
    before each sample, as :class:`SeededSamples` does, so that augmentation does not depend on the workers."""

    def __init__(self, mixture: Mixture, seed: int, shuffle: bool, seeded: bool):
        self.mixture, self.seed, self.shuffle, self.seeded = mixture, seed, shuffle, seeded
        self.draws = mixture.seed if mixture.seed is not None else seed

    def __len__(self) -> int:
        return len(self.mixture)

    def __getitem__(self, item: tuple) -> Any:
        position, epoch = item
        if self.seeded:
            seed_sample(self.seed, epoch, position)
        return self.mixture.sample(self.draws, epoch, position, self.shuffle)

    def counts(self, epoch: int, positions: torch.Tensor) -> dict[str, int]:
        return self.mixture.counts(self.draws, epoch, positions)


def _sources(sources: Any) -> tuple[list[str], list[Any]]:
    if not isinstance(sources, Mapping) or not sources:
        raise DataError(f"Mixture sources: expected a non-empty mapping {{name: data set}}, got "
                        f"{type(sources).__name__}")
    names, out = [], []
    for name, data in sources.items():
        if not isinstance(name, str) or not name.strip() or "/" in name:
            raise DataError(f"Mixture source name {name!r}: expected a non-empty string without '/' (it names the "
                            f"logged data/share/NAME)")
        if is_iterable_source(data):
            raise DataError(f"Mixture source '{name}' is a stream ({type(data).__name__}): a mixture draws its "
                            f"samples by position, which a stream has not; give a map-style data set (with __len__ "
                            f"and __getitem__)")
        data = as_dataset(torch_format(data))
        try:
            n = len(data)
        except TypeError:
            raise DataError(f"Mixture source '{name}' ({type(data).__name__}) has no length; give a map-style "
                            f"data set") from None
        if n == 0:
            raise DataError(f"Mixture source '{name}' is empty (0 samples); remove it or give it data")
        names.append(name)
        out.append(data)
    return names, out


def _weights(weights: Any, names: list[str], lengths: list[int]) -> list[float]:
    """The weights in the sources' order, summing to 1; default: proportional to the sources' lengths."""
    if weights is None:
        return [n / sum(lengths) for n in lengths]
    if not isinstance(weights, Mapping):
        raise DataError(f"Mixture weights: expected a mapping {{name: weight}}, got {type(weights).__name__}")
    for name in weights:
        if name not in names:
            raise DataError(f"Mixture weights name '{name}', which is no source{suggest(str(name), names)} "
                            f"(sources: {', '.join(names)})")
    missing = [n for n in names if n not in weights]
    if missing:
        raise DataError(f"Mixture weights: source(s) {', '.join(repr(n) for n in missing)} have no weight; give "
                        f"every source one (sources: {', '.join(names)})")
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise DataError(f"Mixture weight of '{name}': expected a finite number > 0, got {w!r}; leave a source "
                            f"out instead of weighing it 0")
    total = float(sum(weights[n] for n in names))
    return [weights[n] / total for n in names]


def _quotas(names: list[str], weights: list[float], samples: int) -> list[int]:
    """Each source's samples per epoch: ``weight × samples`` rounded by largest remainders (they add up)."""
    exact = [w * samples for w in weights]
    quotas = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(names)), key=lambda s: (quotas[s] - exact[s], s))
    for s in by_remainder[:samples - sum(quotas)]:
        quotas[s] += 1
    for name, w, q in zip(names, weights, quotas):
        if q == 0:
            raise DataError(f"Mixture source '{name}' gets no sample of an epoch of {samples} at weight {w:.3g} "
                            f"(of 1); raise its weight or samples_per_epoch (at least {math.ceil(1 / w)})")
    return quotas
