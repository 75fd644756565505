"""Iterable and streaming training data: a torch IterableDataset (as is or in a DataLoader), Hugging
Face data sets, sharding over ranks × workers, equal steps with uneven shards, and resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import QUIET, TinyNet, make_classification
from helpers.dist_procs import _env, _kill_group
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import torchrig
from torchrig.data.iterable import batches_per_rank
from torchrig.trainer.step import default_step

HERE = Path(__file__).resolve().parent


class Stream(IterableDataset):
    """``(x, y, id)`` samples in order; ``reads`` counts samples produced (in this process)."""

    def __init__(self, n: int = 40, sized: bool = True):
        self.x, self.y = make_classification(n=n)
        self.sized = sized
        self.reads = 0

    def __iter__(self):
        for i in range(len(self.x)):
            self.reads += 1
            yield self.x[i], self.y[i], i

    def __len__(self):
        if not self.sized:
            raise TypeError("a stream has no length")
        return len(self.x)


class PositionStream(Stream):
    """The same stream, able to report and restore its position (the torchdata Stateful protocol)."""

    def __init__(self, n: int = 40):
        super().__init__(n, sized=False)
        self.pos, self._resume_at = 0, 0

    def __iter__(self):
        self.pos, self._resume_at = self._resume_at, 0
        while self.pos < len(self.x):
            i = self.pos
            self.pos += 1
            self.reads += 1
            yield self.x[i], self.y[i], i

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self._resume_at = state["pos"]


def recorder(seen: dict):
    def step_fn(step, batch):
        if isinstance(batch, dict):  # a Hugging Face row: {"x": ..., "labels": ..., maybe "id": ...}
            batch = dict(batch)
            if "id" in batch:
                seen.setdefault(step.epoch, []).extend(batch.pop("id").tolist())
            return default_step(step, batch)
        x, y, ids = batch
        seen.setdefault(step.epoch, []).extend(ids.tolist())
        return default_step(step, [x, y])
    return step_fn


def _trainer(run_dir, **kw):
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=8, epochs=2, lr=0.05, optimizer="sgd", num_workers=0,
                step_fn=recorder({}))
    opts.update(kw)
    return torchrig.Trainer(TinyNet(dropout=0.2), **opts)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wrap", ["dataset", "loader"])
def test_iterable_dataset_trains_every_sample_once_per_epoch(tmp_path, workers, wrap):
    seen: dict = {}
    data = Stream(40)
    if wrap == "loader":
        data = DataLoader(data, batch_size=8, num_workers=workers)
    trainer = _trainer(tmp_path / "run", step_fn=recorder(seen), num_workers=workers)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.fit(data)
    assert sorted(seen) == [0, 1]
    for epoch in (0, 1):
        assert sorted(seen[epoch]) == list(range(40))
    assert trainer.global_step == 2 * {0: 5, 2: 6}[workers]  # 2 workers: 20 samples each, batches of 8, 8, 4
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_epoch_length_from_steps_per_epoch_or_max_steps(tmp_path, capsys):
    trainer = _trainer(tmp_path / "b", **{"data.steps_per_epoch": 3})
    trainer.fit(Stream(40, sized=False))
    assert trainer.global_step == 6 and trainer.history[-1]["epoch"] == 2
    trainer = _trainer(tmp_path / "c", max_steps=7, epochs=3)
    capsys.readouterr()
    trainer.fit(Stream(40, sized=False))  # 5 batches per pass: the stream is read again until step 7
    assert trainer.global_step == 7 and [h["step"] for h in trainer.history] == [5]
    assert "ran out" not in capsys.readouterr().err  # without a length, running out is how an epoch ends
    with pytest.raises(torchrig.config.ConfigError, match="data.steps_per_epoch"):
        _trainer(tmp_path / "d", **{"data.steps_per_epoch": 0})


def test_batches_per_rank_is_the_fewest_over_ranks():
    assert batches_per_rank(40, 8, False, 0, 1) == 5
    assert batches_per_rank(40, 8, False, 2, 1) == 6        # 20 + 20 samples: 8, 8, 4 each
    assert batches_per_rank(35, 4, False, 2, 2) == 5        # rank 0 holds 9 + 9 (6 batches), rank 1 9 + 8 (5)
    assert batches_per_rank(35, 4, True, 2, 2) == 4


def test_hugging_face_map_style_dataset_trains(tmp_path):
    datasets = pytest.importorskip("datasets")
    x, y = make_classification(n=40)
    ds = datasets.Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()})  # rows of python lists, no format
    trainer = _trainer(tmp_path / "run", epochs=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.fit(ds)
    assert trainer.global_step == 5
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_hugging_face_streaming_dataset_trains_and_resumes_exactly(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("torchdata")
    x, y = make_classification(n=40)
    stream = datasets.Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()}).to_iterable_dataset(num_shards=4)
    full = _trainer(tmp_path / "full", max_steps=8)
    full.fit(stream)
    assert full.global_step == 8
    _interrupted_then_resumed(tmp_path / "cut", stream, stop_at=3, max_steps=8)
    resumed = _trainer(tmp_path / "cut", max_steps=8, resume="latest")
    capsys.readouterr()
    resumed.fit(stream)
    assert "re-reads" not in capsys.readouterr().err  # the stream's own state_dict gave the position
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_hugging_face_stream_in_two_workers_gives_every_row_once_per_epoch(tmp_path):
    datasets = pytest.importorskip("datasets")
    x, y = make_classification(n=40)
    rows = {"x": x.tolist(), "labels": y.tolist(), "id": list(range(40))}
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=4)
    seen: dict = {}
    trainer = _trainer(tmp_path / "run", num_workers=2, step_fn=recorder(seen), **{"data.steps_per_epoch": 100})
    trainer.fit(stream)
    assert sorted(seen[0]) == sorted(seen[1]) == list(range(40))
    assert trainer.global_step == 2 * 6  # 2 shards (20 rows) per worker: batches of 8, 8, 4


class Interrupted(Exception):
    pass


class StopAfterSave:
    def __init__(self, step: int):
        self.step = step

    def on_save(self, trainer, path, metrics):
        if trainer.global_step == self.step:
            raise Interrupted


def _interrupted_then_resumed(run_dir, data, stop_at, **kw):
    trainer = _trainer(run_dir, callbacks=[StopAfterSave(stop_at)], checkpoint_every=1, **kw)
    with pytest.raises(Interrupted):
        trainer.fit(data)


def _cpu_lookahead(monkeypatch):
    """The CUDA prefetcher's reading order on the CPU: each batch is taken from the loader one batch ahead of
    the step that trains it (the copy of the next batch overlaps the current step), with no streams."""
    from torchrig.data import loaders
    import torchrig.trainer.trainer as T

    monkeypatch.setattr(T, "prefetch_to_device", lambda batches, device: loaders.lookahead(
        iter(batches), lambda b: b, lambda b: None))


@pytest.mark.parametrize("prefetch", ["none", "lookahead"])
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resume_is_exact_without_replay(tmp_path, workers, prefetch, capsys, monkeypatch):
    from torchdata.stateful_dataloader import StatefulDataLoader

    if prefetch == "lookahead":
        _cpu_lookahead(monkeypatch)

    streams = []

    def data():
        streams.append(PositionStream(40))
        return StatefulDataLoader(streams[-1], batch_size=8, num_workers=workers)

    seen_full: dict = {}
    full = _trainer(tmp_path / "full", step_fn=recorder(seen_full), **{"data.steps_per_epoch": 5})
    full.fit(data())
    seen_a: dict = {}
    _interrupted_then_resumed(tmp_path / "cut", data(), stop_at=3, step_fn=recorder(seen_a),
                              **{"data.steps_per_epoch": 5})
    seen_b: dict = {}
    resumed = _trainer(tmp_path / "cut", resume="latest", step_fn=recorder(seen_b), **{"data.steps_per_epoch": 5})
    capsys.readouterr()
    resumed.fit(data())
    assert "re-reads" not in capsys.readouterr().err
    assert seen_a[0] + seen_b[0] == seen_full[0] and seen_b[1] == seen_full[1]  # nothing read twice, nothing lost
    if workers == 0:  # the stream itself went on from sample 24: 16 samples in epoch 1, 40 in epoch 2
        assert streams[-1].reads == 16 + 40
    assert resumed.global_step == full.global_step == 10
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_plain_iterable_resume_replays_with_one_warning(tmp_path, capsys):
    full = _trainer(tmp_path / "full")
    full.fit(Stream(40))
    _interrupted_then_resumed(tmp_path / "cut", Stream(40), stop_at=2)
    stream = Stream(40)
    resumed = _trainer(tmp_path / "cut", resume="latest")
    capsys.readouterr()
    resumed.fit(stream)
    out = capsys.readouterr().err
    assert out.count("re-reads the 2 batches already used") == 1
    assert stream.reads == 2 * 40  # the 16 samples of the first 2 batches were read again, then both epochs
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Both ranks' results of every run of ``iterable_worker.py`` (one launch serves the tests below)."""
    import subprocess

    pytest.importorskip("torchdata")
    out = tmp_path_factory.mktemp("two_ranks")
    procs = []
    try:
        for rank in (0, 1):
            env = _env(dict(TEST_INIT=f"file://{out / 'store'}", TEST_RANK=rank, PYTHONPATH=":".join(sys.path)))
            procs.append(subprocess.Popen([sys.executable, str(HERE / "iterable_worker.py"), str(out)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [dict(json.loads((out / f"rank-{r}.json").read_text()), log=logs[r]) for r in (0, 1)]


def test_two_ranks_two_workers_see_every_sample_once(two_ranks):
    ranks = [r["even"] for r in two_ranks]
    for epoch in ("0", "1"):
        ids = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert sorted(ids) == list(range(40))
    assert ranks[0]["steps"] == ranks[1]["steps"] == 2 * 6  # 10 samples per (rank, worker): 4, 4, 2


def test_uneven_shards_end_the_epoch_on_every_rank(two_ranks):
    # No length, a long nominal epoch: rank 0 holds 9 + 9 samples (6 batches), rank 1 9 + 8 (5); the ranks
    # agree to end each epoch after 5 batches, when rank 1 runs out, and rank 0's last batch (1 sample) is unused.
    ranks = [r["uneven"] for r in two_ranks]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 2 * 5
    for epoch in ("0", "1"):
        ids = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert len(ids) == len(set(ids)) == 34
    assert two_ranks[0]["log"].count("uneven shards") == 1


def test_two_ranks_resume_from_stateful_loader_is_exact(two_ranks):
    for rank in two_ranks:
        full, cut, resumed = rank["full"], rank["cut"], rank["resumed"]
        assert cut["steps"] == 2 and resumed["steps"] == full["steps"] == 8
        assert cut["seen"]["0"] + resumed["seen"]["0"] == full["seen"]["0"]  # each rank's own position restored
        assert resumed["seen"]["1"] == full["seen"]["1"]
        assert resumed["params"] == full["params"]
        assert "re-reads" not in rank["log"]


def test_partial_accumulation_window_at_stream_end_is_not_used(tmp_path, capsys):
    # 5 batches per pass, windows of 2: the 5th batch is left over each epoch and must not leak into the next
    stream = _trainer(tmp_path / "a", accumulate=2, **{"data.steps_per_epoch": 10})
    stream.fit(Stream(40, sized=False))
    out = capsys.readouterr().err
    assert out.count("ended with 1 batch(es) left, fewer than one accumulation window (accumulate=2)") == 1
    short = Stream(40)
    short.x, short.y = short.x[:32], short.y[:32]  # the same first 4 batches, a length that ends on a window
    exact = _trainer(tmp_path / "b", accumulate=2)
    exact.fit(short)
    assert stream.global_step == exact.global_step == 4
    for a, b in zip(stream.model.parameters(), exact.model.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- evaluate / predict
class PairStream(Stream):
    """``(x, y)`` samples in order: what the default evaluation step expects."""

    def __iter__(self):
        for i in range(len(self.x)):
            self.reads += 1
            yield self.x[i], self.y[i]


def _evaluator(run_dir, **kw):
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=4, num_workers=0, metrics=["accuracy"])
    return torchrig.Trainer(TinyNet(), **dict(opts, **kw))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wrap", ["dataset", "loader"])
def test_evaluate_and_predict_read_a_stream_once_in_stream_order(tmp_path, workers, wrap):
    x, y = make_classification(n=37)
    trainer = _evaluator(tmp_path / "run", num_workers=workers)
    expected_metrics = trainer.evaluate((x, y))
    expected = trainer.predict(x)
    stream = PairStream(37, sized=False)
    data = DataLoader(stream, batch_size=5, num_workers=workers) if wrap == "loader" else stream
    metrics = trainer.evaluate(data)
    assert metrics.keys() == expected_metrics.keys()
    for k in metrics:
        assert metrics[k] == pytest.approx(expected_metrics[k], abs=1e-6)
    if workers == 0:
        assert stream.reads == 37  # one pass, every sample once
    got = trainer.predict(data)
    assert got.shape == expected.shape == (37, 4)
    assert torch.allclose(got, expected, atol=1e-6)  # every row at its sample's place in the stream


def test_predict_restores_stream_order_for_tuple_outputs_and_custom_collate(tmp_path):
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x):  # x: the custom collate's stacked inputs alone
            return x.sum(dim=1) * self.scale, x[:, :2]

    x, _ = make_classification(n=23)
    trainer = torchrig.Trainer(Pair(), **dict(QUIET, run_dir=str(tmp_path / "run"), batch_size=3, num_workers=2))

    def collate(samples):
        return torch.stack([s[0] for s in samples])

    total, first = trainer.predict(DataLoader(PairStream(23, sized=False), batch_size=3, num_workers=2,
                                              collate_fn=collate), activation="none", outputs="all")
    assert torch.allclose(total, x.sum(dim=1)) and torch.equal(first, x[:, :2])


def test_evaluate_a_hugging_face_stream_equals_the_in_memory_data(tmp_path):
    datasets = pytest.importorskip("datasets")
    x, y = make_classification(n=30)
    stream = datasets.Dataset.from_dict({"x": x.tolist(), "labels": y.tolist()}).to_iterable_dataset(num_shards=3)
    trainer = _evaluator(tmp_path / "run", num_workers=2)
    expected = trainer.evaluate((x, y))
    got = trainer.evaluate(stream)
    for k in expected:
        assert got[k] == pytest.approx(expected[k], abs=1e-6)
    assert torch.allclose(trainer.predict(stream), trainer.predict(x), atol=1e-6)


def test_stream_notes_go_through_the_trainer_print(tmp_path):
    printed = []
    trainer = _trainer(tmp_path / "run", epochs=3, **{"data.steps_per_epoch": 7})  # longer than the stream
    trainer.print = printed.append
    trainer.fit(Stream(40, sized=False))
    assert any("the training data ran out after 5 of the 7 batches" in line for line in printed)


def test_two_ranks_evaluate_and_predict_a_stream_as_one_process(two_ranks, tmp_path):
    x, y = make_classification(n=35)
    one = _evaluator(tmp_path / "one")
    expected_metrics, expected = one.evaluate((x, y)), one.predict(x)
    for name in ("eval_ddp", "eval_fsdp"):
        for rank in two_ranks:
            run = rank[name]
            assert run["metrics"].keys() == expected_metrics.keys()
            for k in expected_metrics:
                assert run["metrics"][k] == pytest.approx(expected_metrics[k], abs=1e-5), (name, k)
            assert torch.allclose(torch.tensor(run["predict"]), expected, atol=1e-5), name


def test_fit_validates_on_a_stream_each_epoch(tmp_path):
    x, y = make_classification(n=37)
    trainer = _trainer(tmp_path / "run", epochs=2, metrics=["accuracy"])
    trainer.fit(Stream(40), PairStream(37, sized=False))
    assert [row["epoch"] for row in trainer.history] == [1, 2]
    assert trainer.history[-1]["val/accuracy"] == pytest.approx(trainer.evaluate((x, y))["accuracy"], abs=1e-6)
