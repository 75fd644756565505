"""Capability 2: Dataset / DataLoader / tensors in, resumable order, fast path, device moves, worker seeding."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from helpers import AugmentedDataset, DictDataset, DictNet, SlowSamples, TinyNet, make_classification
from torch.utils.data import DataLoader, Dataset, SequentialSampler, TensorDataset

from torchrig.data import Batches, DataError, ResumableSampler, TensorBatches, prepare_eval, prepare_train, to_device

CPU = torch.device("cpu")


def _kw(**extra):
    kw = dict(batch_size=4, seed=7, rank=0, world_size=1, device=CPU, num_workers=0)
    kw.update(extra)
    return kw


def _epoch(batches: Batches, epoch: int) -> list:
    batches.set_epoch(epoch)
    return [[t.clone() for t in b] for b in batches]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y))
                                    for x, y in zip(a, b))


# ----------------------------------------------------------------------------- moving batches


def test_to_device_keeps_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), "text", 3)], "c": Pair(torch.ones(1), None)}
    moved = to_device(batch, CPU)
    assert set(moved) == {"a", "b", "c"}
    assert isinstance(moved["b"], list) and isinstance(moved["b"][1], tuple)
    assert moved["b"][1][1:] == ("text", 3)
    assert isinstance(moved["c"], Pair) and moved["c"].y is None
    assert torch.equal(moved["a"], batch["a"])


@pytest.mark.gpu
def test_to_device_moves_to_cuda():
    cuda = torch.device("cuda")
    moved = to_device({"x": torch.ones(2).pin_memory(), "y": [torch.zeros(1)]}, cuda)
    assert moved["x"].is_cuda and moved["y"][0].is_cuda


def test_dict_batches_train_and_evaluate(make_trainer):
    x, y = make_classification()
    trainer = make_trainer(DictNet(), metrics=["accuracy"], epochs=2)
    trainer.fit(DictDataset(x, y), val_data=DictDataset(x, y))
    res = trainer.evaluate(DictDataset(x, y))
    with torch.no_grad():
        logits = trainer.model(x=x)  # the model is called with the dict's inputs as keywords
    assert res == pytest.approx({"loss": float(torch.nn.functional.cross_entropy(logits, y)),
                                 "accuracy": float((logits.argmax(1) == y).float().mean())}, rel=1e-6)
    probs = trainer.predict(DictDataset(x, y))
    assert torch.allclose(probs, logits.softmax(1), atol=1e-6)


def test_tuple_batches_with_several_inputs(make_trainer):
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

        def forward(self, x1, x2):
            return self.a(x1) + self.b(x2)

    x, y = make_classification()
    trainer = make_trainer(TwoInputs())
    trainer.fit((x, x.flip(1), y))  # tensors: (input1, input2, target)
    assert trainer.global_step == 5
    assert trainer.predict((x, x.flip(1), y)).shape == (40, 4)  # the target is dropped


def test_training_batch_without_target(make_trainer):
    x, _ = make_classification()
    trainer = make_trainer()
    with pytest.raises(ValueError, match="training batches carry no target: give \\(inputs, target\\) pairs"):
        trainer.fit(x)


# ----------------------------------------------------------------------------- order and the fast path


def test_fast_path_gives_the_dataloader_batches():
    x, y = make_classification(n=43)
    ds = TensorDataset(x, y)
    for drop_last in (False, True):
        fast = prepare_train(ds, **_kw(fast_path=True, drop_last=drop_last))
        slow = prepare_train(ds, **_kw(fast_path=False, drop_last=drop_last))
        assert isinstance(fast.source, TensorBatches) and isinstance(slow.source, DataLoader)
        assert len(fast) == len(slow) == (10 if drop_last else 11)
        for epoch in range(3):
            assert _same(_epoch(fast, epoch), _epoch(slow, epoch))
        fast.set_epoch(1)
        fast.skip_batches(4)
        slow.set_epoch(1)
        slow.skip_batches(4)
        assert _same(list(fast), list(slow))


def test_fast_path_and_dataloader_path_train_identically(make_trainer, data, tmp_path):
    a = make_trainer(fast_path=True, epochs=2, run_dir=str(tmp_path / "a"))
    a.fit(data)
    b = make_trainer(fast_path=False, epochs=2, run_dir=str(tmp_path / "b"))
    b.fit(data)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)


def test_order_depends_on_seed_and_epoch_only():
    ds = TensorDataset(torch.arange(30))
    a = prepare_train(ds, **_kw())
    b = prepare_train(ds, **_kw())
    torch.manual_seed(123)  # the global RNG plays no part
    assert _same(_epoch(a, 0), _epoch(b, 0))
    e0, e1 = torch.cat([t[0] for t in _epoch(a, 0)]), torch.cat([t[0] for t in _epoch(a, 1)])
    assert not torch.equal(e0, e1)
    assert sorted(e0.tolist()) == list(range(30))
    c = prepare_train(ds, **_kw(seed=8))
    assert not torch.equal(e0, torch.cat([t[0] for t in _epoch(c, 0)]))
    assert torch.equal(torch.cat([t[0] for t in _epoch(prepare_train(ds, **_kw(shuffle=False)), 0)]),
                       torch.arange(30))


def test_eval_keeps_order_and_every_sample():
    ds = TensorDataset(torch.arange(30))
    ev = prepare_eval(ds, **_kw(batch_size=7))
    assert torch.equal(torch.cat([b[0] for b in ev]), torch.arange(30))


def test_sampler_sharding():
    # training shards split each global batch (world_size × batch_size consecutive samples of the epoch's
    # order) across the ranks, never repeating a sample; a rank with nothing left in the short last global
    # batch gets one filler sample, weighed 0 by the loop; evaluation shards cover every sample exactly once
    shards = [ResumableSampler(10, shuffle=True, seed=1, rank=r, world_size=3, pad=True) for r in range(3)]
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()  # seed + epoch 0
    assert [s.indices().tolist() for s in shards] == [perm[0:9:3] + [perm[9]], perm[1:9:3] + [perm[9]],
                                                      perm[2:9:3] + [perm[9]]]
    assert [s.filler_batch for s in shards] == [None, 3, 3] and {len(s) for s in shards} == {4}
    shards[1].set_epoch(4)
    perm4 = torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()
    assert shards[1].indices().tolist() == perm4[1:9:3] + [perm4[9]]
    # batch 2 on 2 ranks, 11 samples: global batches of 4; the short one (3 samples) splits 2 + 1
    b2 = [ResumableSampler(11, shuffle=False, rank=r, world_size=2, batch_size=2) for r in range(2)]
    assert [s.indices().tolist() for s in b2] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10]]
    assert [s.filler_batch for s in b2] == [None, None]
    dl = [ResumableSampler(11, shuffle=False, rank=r, world_size=2, batch_size=2, drop_last=True) for r in range(2)]
    assert [s.indices().tolist() for s in dl] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    ev = [ResumableSampler(10, shuffle=False, rank=r, world_size=3, pad=False) for r in range(3)]
    assert [s.indices().tolist() for s in ev] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    s = ResumableSampler(10, shuffle=True, seed=1)
    full = s.indices().tolist()
    s.skip = 6
    assert s.indices().tolist() == full[6:] and len(s) == 4
    with pytest.raises(ValueError) as err:
        ResumableSampler(0)
    assert str(err.value) == "the data set is empty (0 samples); check the data path or split"


def _position(samples: int, batch: int, world: int = 1, accumulate: int = 1, n: int = 40, drop_last: bool = False):
    """The batch a resumed run of ``world`` ranks of ``batch`` (``accumulate`` per step) starts at after ``samples``
    samples of an epoch of ``n``: ``Batches.batch_after`` on rank 0's sampler."""
    sampler = ResumableSampler(n, shuffle=True, seed=1, world_size=world, batch_size=batch, drop_last=drop_last)
    return Batches(None, sampler, batch).batch_after(samples, accumulate)


@pytest.mark.parametrize("samples, batch, world, accumulate, drop_last, expected", [
    (36, 12, 1, 1, False, 3),    # three global batches of 12
    (36, 6, 2, 1, False, 3),     # the same 12 per step over two ranks
    (36, 9, 1, 2, False, 4),     # four batches of 9: the start of a window of two
    (36, 12, 1, 2, False, None),  # three batches of 12: inside a window of two
    (36, 8, 1, 1, False, None),  # inside the fifth batch of 8 (32 … 39): no batch starts there
    (36, 8, 1, 2, False, None),  # not the epoch's end: samples 36 … 39 are still to train
    (32, 8, 1, 2, False, 4),
    (40, 8, 1, 2, False, 5),     # the epoch's end (5 batches) closes a window of one batch
    (36, 12, 1, 2, True, 3),     # drop_last: the short batch of 4 is not trained, 36 is the epoch's end
    (0, 12, 1, 2, False, 0),
], ids=["whole", "two-ranks", "window-start", "mid-window", "mid-batch", "mid-batch-at-window", "window",
        "epoch-end", "epoch-end-drop-last", "start"])
def test_a_position_in_samples_is_found_only_at_a_windows_start(samples, batch, world, accumulate, drop_last, expected):
    """A checkpoint records the samples of the epoch used over all ranks; a run with another global batch goes on
    there only where one of its optimizer steps starts (or at the epoch's end): never inside a step, never past a
    sample not trained yet."""
    assert _position(samples, batch, world, accumulate, drop_last=drop_last) == expected


# ----------------------------------------------------------------------------- DataLoaders


def _collate(samples):
    xs, ys = zip(*samples)
    return {"x": torch.stack(xs), "labels": torch.stack(ys)}


def test_dataloader_is_rebuilt_around_the_resumable_sampler():
    x, y = make_classification(n=23)
    init = lambda worker_id: None  # noqa: E731
    user = DataLoader(AugmentedDataset(x, y), batch_size=5, shuffle=True, drop_last=True, collate_fn=_collate,
                      worker_init_fn=init, timeout=0)
    b = prepare_train(user, **_kw())
    loader = b.source
    assert isinstance(loader, DataLoader) and loader is not user
    assert isinstance(loader.sampler, ResumableSampler) and loader.sampler is b.sampler
    assert loader.sampler.shuffle
    assert (loader.batch_size, loader.drop_last, loader.collate_fn, loader.worker_init_fn) == (5, True, _collate, init)
    assert len(b) == 4
    batch = next(iter(b))
    assert set(batch) == {"x", "labels"} and batch["x"].shape == (5, 8)
    # a sequential loader stays sequential; evaluation never drops the last batch
    seq = prepare_train(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), **_kw(fast_path=False))
    assert not seq.sampler.shuffle
    ev = prepare_eval(DataLoader(TensorDataset(torch.arange(10)), batch_size=4, drop_last=True, shuffle=True),
                      **_kw())
    assert torch.equal(torch.cat([t[0] for t in ev]), torch.arange(10))


def test_a_dataloader_gives_the_batches_of_its_dataset():
    ds = [(x, t) for x, t in zip(*make_classification(n=23))]  # a plain sequence, not a TensorDataset
    direct = prepare_train(ds, **_kw(batch_size=5, drop_last=True))
    rebuilt = prepare_train(DataLoader(ds, batch_size=5, shuffle=True, drop_last=True), **_kw())
    assert isinstance(rebuilt.source, DataLoader) and len(direct) == len(rebuilt) == 4
    for epoch in (0, 1):
        assert _same(_epoch(direct, epoch), _epoch(rebuilt, epoch))
    for b in (direct, rebuilt):
        b.set_epoch(1)
        b.skip_batches(3)
    assert _same(list(direct), list(rebuilt)) and len(list(direct)) == 1


def test_tensor_dataloader_takes_the_fast_path():
    ds = TensorDataset(*make_classification(n=20))
    b = prepare_train(DataLoader(ds, batch_size=6, shuffle=True), **_kw())
    assert isinstance(b.source, TensorBatches) and b.batch_size == 6 and len(b) == 4


def test_a_collate_function_named_default_collate_is_the_users():
    """Only torch's own default_collate (by identity) lets the fast path gather the batch; a user's function
    that happens to carry the name keeps the DataLoader, and its batches are not taken as torchrig's own."""
    def default_collate(samples):  # the user's, e.g. adding a mask
        return [torch.stack([s[0] for s in samples]) * 2, torch.stack([s[1] for s in samples])]

    ds = TensorDataset(*make_classification(n=20))
    b = prepare_train(DataLoader(ds, batch_size=6, collate_fn=default_collate), **_kw())
    assert isinstance(b.source, DataLoader) and not b.fresh
    b.set_epoch(0)
    x, _ = next(iter(b))
    assert torch.equal(x, ds.tensors[0][x.new_tensor(list(b.sampler)[:6], dtype=torch.long)] * 2)


def test_custom_sampler_is_kept():
    ds = TensorDataset(torch.arange(10))
    user = DataLoader(ds, batch_size=3, sampler=list(reversed(range(10))))
    b = prepare_train(user, **_kw())
    assert b.source is user and b.sampler is None
    b.set_epoch(0)
    b.skip_batches(2)  # cannot fast-forward a user sampler: consumed instead
    assert len(b) == 2
    assert [t[0].tolist() for t in b] == [[3, 2, 1], [0]]


def test_dataloader_trains_through_trainer(make_trainer):
    x, y = make_classification()
    trainer = make_trainer(DictNet())
    trainer.fit(DataLoader(AugmentedDataset(x, y), batch_size=8, shuffle=True, collate_fn=_collate))
    assert trainer.global_step == 5


# ----------------------------------------------------------------------------- worker seeding


def _augmented_epoch(workers: int, epoch: int = 0) -> torch.Tensor:
    x, y = make_classification(n=24)
    b = prepare_train(AugmentedDataset(x, y), **_kw(num_workers=workers, batch_size=6, persistent_workers=False))
    b.set_epoch(epoch)
    return torch.cat([xb for xb, _ in b])


@pytest.mark.slow
def test_worker_seeding_is_reproducible_and_independent_of_worker_count():
    torch.manual_seed(0)
    two = _augmented_epoch(2)
    torch.manual_seed(99)
    again = _augmented_epoch(2)
    assert torch.equal(two, again)  # the same augmentation, whatever the global RNG
    assert torch.equal(two, _augmented_epoch(1))  # and whatever the number of workers
    assert not torch.equal(two, _augmented_epoch(2, epoch=1))  # but new randomness each epoch


# num_workers="auto" for samples that are slow to make: the cores this process may use, shared by the
# processes of the machine, less one for the training loop itself, at most 16 (e.g. 1 worker on 2 cores).
# Cheap samples get none (tests/data/test_workers.py).
AUTO_WORKERS = [  # (usable cores, processes on the machine, workers per process)
    (1, 1, 0), (2, 1, 1), (3, 1, 2), (5, 1, 4), (16, 1, 15), (64, 1, 16), (8, 2, 3), (16, 4, 3), (4, 4, 0),
    (6, 4, 0),
]


@pytest.mark.parametrize("cores,local_world_size,workers", AUTO_WORKERS)
def test_worker_count_auto(monkeypatch, cores, local_world_size, workers):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    x, y = make_classification(n=12)
    b = prepare_train(SlowSamples(AugmentedDataset(x, y)), **_kw(num_workers="auto", local_world_size=local_world_size,
                                                                 persistent_workers=False))
    assert b.source.num_workers == workers


def test_pin_memory_default():
    x, y = make_classification(n=12)
    b = prepare_train(AugmentedDataset(x, y), **_kw(num_workers=0))
    assert b.source.pin_memory is False  # auto: only when training on CUDA


# ----------------------------------------------------------------------------- bad data


class NoLen(Dataset):
    def __getitem__(self, i):
        return torch.zeros(1)


@pytest.mark.parametrize("data,message", [
    (TensorDataset(torch.zeros(0, 3)), "the training data set is empty (0 samples)"),
    ((torch.zeros(4, 2), torch.zeros(5)), "tensors given as data have different lengths [4, 5]; they must match"),
    (3.5, "data of type float is not a Dataset, DataLoader or tensors"),
    (NoLen(), "the data set NoLen has no length; give a DataLoader instead"),
])
def test_bad_training_data(data, message):
    with pytest.raises(DataError) as err:
        prepare_train(data, **_kw())
    assert message in str(err.value)


def test_empty_evaluation_data(make_trainer):
    with pytest.raises(DataError, match=r"the evaluation data set is empty \(0 samples\)"):
        make_trainer().evaluate(TensorDataset(torch.zeros(0, 8), torch.zeros(0)))


def test_no_batch_with_drop_last(make_trainer, data):
    from torchrig.config import ConfigError

    n = len(data)
    with pytest.raises(ConfigError, match=rf"config key 'data.batch_size': 64 per process is more than the {n} "
                                          r"training samples give each process \(data.drop_last=true drops the only, "
                                          r"partial batch\); lower data.batch_size or set data.drop_last=false"):
        make_trainer(batch_size=64, drop_last=True).fit(data)


def test_sequential_sampler_loader_is_not_shuffled():
    ds = TensorDataset(torch.arange(6))
    loader = DataLoader(ds, batch_size=2, sampler=SequentialSampler(ds))
    b = prepare_train(loader, **_kw(fast_path=False))
    b.set_epoch(3)
    assert torch.equal(torch.cat([t[0] for t in b]), torch.arange(6))


def test_model_trains_on_plain_tensors(make_trainer):
    x, y = make_classification()
    trainer = make_trainer(TinyNet())
    trainer.fit((x, y))
    assert trainer.global_step == 5
