"""data.num_workers=auto: no worker process for cheap samples, and the same samples whatever it chose."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from helpers import AugmentedDataset, SlowSamples, TinyNet, make_classification
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset, TensorDataset

from torchrig.data import DataError, prepare_eval, prepare_train, workers
from torchrig.data.workers import RngKept, SeededSamples

CPU = torch.device("cpu")


def _kw(**extra):
    kw = dict(batch_size=6, seed=7, rank=0, world_size=1, device=CPU, num_workers="auto", persistent_workers=False)
    kw.update(extra)
    return kw


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)


def _rng_draws() -> tuple:
    return random.random(), float(np.random.uniform()), float(torch.rand(()))


def _epoch(batches, epoch: int = 0) -> torch.Tensor:
    batches.set_epoch(epoch)
    return torch.cat([xb for xb, _ in batches])


def test_cheap_samples_get_no_worker_and_are_seeded_here(four_cores, monkeypatch):
    monkeypatch.setattr(workers, "CHEAP_BATCH_S", 1.0)  # cheap, however loaded this machine is
    x, y = make_classification(n=24)
    b = prepare_train(AugmentedDataset(x, y), **_kw())
    assert isinstance(b.source, RngKept)
    assert b.source.num_workers == 0 and isinstance(b.source.dataset, SeededSamples)
    assert len(b) == 4 and b.source.sampler is b.sampler  # what the loop reads goes through


def test_slow_samples_get_a_worker_per_core_but_one(four_cores):
    x, y = make_classification(n=24)
    slow = SlowSamples(AugmentedDataset(x, y), seconds=2e-3)
    b = prepare_train(slow, **_kw())
    assert isinstance(b.source, DataLoader) and b.source.num_workers == 3
    assert slow.fetched == 0  # the probe timed two samples of a copy (2 ms each: clearly slow) and stopped
    assert workers.batch_fetch_s(slow, 6, 0) > workers.CHEAP_BATCH_S


@pytest.mark.parametrize("make", [
    lambda x, y: TensorDataset(x, y),
    lambda x, y: Subset(TensorDataset(x, y), list(range(0, 24, 2))),
    lambda x, y: ConcatDataset([TensorDataset(x, y), Subset(TensorDataset(x, y), [0, 1])]),
])
def test_in_memory_tensors_get_no_worker_and_no_seeding(four_cores, make):
    x, y = make_classification(n=24)
    b = prepare_train(make(x, y), **_kw(fast_path=False))
    assert type(b.source) is DataLoader and b.source.num_workers == 0
    assert not isinstance(b.source.dataset, SeededSamples)  # nothing random to seed
    e = prepare_eval(make(x, y), **_kw(fast_path=False))
    assert type(e.source) is DataLoader and e.source.num_workers == 0


@pytest.mark.slow
def test_auto_draws_the_samples_a_worker_draws_and_leaves_training_randomness_alone(four_cores, monkeypatch):
    monkeypatch.setattr(workers, "CHEAP_BATCH_S", 1.0)  # cheap, however loaded this machine is
    x, y = make_classification(n=24)
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    here = prepare_train(AugmentedDataset(x, y), **_kw())
    assert isinstance(here.source, RngKept)
    epochs_here = [_epoch(here, e) for e in (0, 1)]
    after = _rng_draws()
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    assert after == _rng_draws()  # fetching moved none of the training process's generators
    worker = prepare_train(AugmentedDataset(x, y), **_kw(num_workers=1))
    assert worker.source.num_workers == 1
    for e, got in enumerate(epochs_here):
        assert torch.equal(got, _epoch(worker, e))  # bitwise the samples a worker process makes
    assert not torch.equal(epochs_here[0], epochs_here[1])  # new randomness each epoch


class _Lazy(Dataset):
    """Opens its 'file' on first access, as a data set meant for worker processes does, and draws noise
    from a generator of its own."""

    def __init__(self):
        self.handle, self.rng = None, torch.Generator().manual_seed(0)

    def __len__(self):
        return 50

    def __getitem__(self, i):
        if self.handle is None:
            self.handle = object()
        return torch.randn(3, generator=self.rng), i


@pytest.mark.parametrize("wrap", [lambda d: d, lambda d: Subset(d, list(range(40)))])
def test_the_probe_runs_apart_from_the_training_process(wrap):
    data = _Lazy()
    rng_before = data.rng.get_state()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    fetch = workers.batch_fetch_s(wrap(data), 8, seed=0)
    after = _rng_draws()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    assert after == _rng_draws()  # no global generator moved
    assert data.handle is None  # opened in the probe's process: worker processes open their own
    assert torch.equal(data.rng.get_state(), rng_before)  # and the data set's own generator did not move
    assert 0 < fetch < 1.0


def test_an_empty_data_set_is_named_under_auto(four_cores):
    class Empty(Dataset):
        def __len__(self):
            return 0

        def __getitem__(self, i):
            raise IndexError(i)

    assert workers.batch_fetch_s(Empty(), 4, seed=0) is None
    with pytest.raises(DataError, match=r"the training data set is empty \(0 samples\)"):
        prepare_train(Empty(), **_kw())


def test_the_probe_gives_up_on_a_failing_sample(four_cores):
    class Broken(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            raise ValueError("bad sample")

    assert workers.batch_fetch_s(Broken(), 4, seed=0) is None
    assert workers.auto_workers(Broken(), 4, seed=0) == 3  # workers, as before: the loader reports the error


@pytest.mark.slow
def test_fit_is_bitwise_the_same_whatever_auto_chooses(make_trainer, four_cores, tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "CHEAP_BATCH_S", 10.0)  # auto: no worker, whatever this machine's timing
    x, y = make_classification(n=48)
    weights = []
    for num_workers in ("auto", 1):
        torch.manual_seed(0)
        trainer = make_trainer(TinyNet(dropout=0.3), num_workers=num_workers, epochs=2, seed=11,
                               run_dir=str(tmp_path / str(num_workers)))
        trainer.fit(AugmentedDataset(x, y), val_data=AugmentedDataset(x, y))
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        weights[-1]["val_loss"] = torch.tensor(trainer.history[-1]["val/loss"])
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


class _Pids(Dataset):
    """Rows of tensors; each fetch leaves a file named after the fetching process's id in ``folder``."""

    def __init__(self, x, y, folder):
        self.x, self.y, self.folder = x, y, folder

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        (self.folder / str(os.getpid())).touch()
        return self.x[i], self.y[i]


class _Growing(Dataset):
    """Validation rows; each fetch leaves a file named after the row index; ``n`` rows for now."""

    def __init__(self, x, y, folder, n):
        self.x, self.y, self.folder, self.n = x, y, folder, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        (self.folder / str(i)).touch()
        return self.x[i], self.y[i]


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 1])
def test_validation_data_that_grows_between_epochs_is_read_whole(make_trainer, tmp_path, num_workers):
    x, y = make_classification(n=48)
    seen = tmp_path / "rows"
    seen.mkdir()
    val = _Growing(x, y, seen, 16)

    class Grow:
        def on_eval_end(self, trainer, results):
            val.n += 16

    trainer = make_trainer(TinyNet(), num_workers=num_workers, epochs=3, run_dir=str(tmp_path / "run"),
                           callbacks=[Grow()])
    trainer.fit((x, y), val_data=val)
    assert sorted(int(p.name) for p in seen.iterdir()) == list(range(48))  # 16, then 32, then 48 rows


@pytest.mark.slow
def test_validation_workers_serve_every_epoch_of_a_fit_and_stop_with_it(make_trainer, tmp_path):
    x, y = make_classification(n=32)
    seen = tmp_path / "val-pids"
    seen.mkdir()
    val = _Pids(x, y, seen)
    trainer = make_trainer(TinyNet(), num_workers=1, epochs=3, run_dir=str(tmp_path / "run"))
    trainer.fit((x, y), val_data=val)
    pids = {int(p.name) for p in seen.iterdir()} - {os.getpid()}  # here: the two samples checked before training
    assert len(pids) == 1  # one worker process for the three validations
    assert len([h for h in trainer.history if "val/loss" in h]) == 3
    again = trainer.evaluate(val)  # after fit: a loader of its own, with a worker of its own
    assert again["loss"] == trainer.history[-1]["val/loss"]
    worker = pids.pop()
    with pytest.raises(ProcessLookupError):  # fit's validation worker was stopped and reaped
        os.kill(worker, 0)


class WorkerSeeds(Dataset):
    """Each sample is the seed of the worker process that fetched it (what a worker_init_fn sees)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        return torch.utils.data.get_worker_info().seed


def test_worker_seeds_depend_on_the_epoch_not_on_where_the_run_started():
    """A run resumed in epoch 3 starts its workers with the seeds an unbroken run gives them in epoch 3."""
    def seeds(batches, epoch):
        batches.set_epoch(epoch)
        return [int(s) for b in batches for s in b]

    unbroken = prepare_train(WorkerSeeds(), **_kw(num_workers=1, shuffle=False))
    by_epoch = [seeds(unbroken, e) for e in range(3)]
    assert len({s[0] for s in by_epoch}) == 3  # new seeds each epoch
    resumed = prepare_train(WorkerSeeds(), **_kw(num_workers=1, shuffle=False))
    assert seeds(resumed, 2) == by_epoch[2]
