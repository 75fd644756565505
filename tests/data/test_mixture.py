"""Data mixtures: ``torchrig.data.Mixture`` (named sources drawn by weight), ``data.sources`` / ``data.mixture``.

The draws are a pure function of (seed, epoch, position): the shares are the weights, each source is walked in its
own seeded order pass after pass, a resume is exact on one process (bitwise) and on two (the next global batch),
and the logged rows show each source's share of the samples trained.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from helpers import dist_procs
from helpers import dist_worker as W
from helpers import elastic_worker as E

from torchrig.config import ConfigError, load_config
from torchrig.data import DataError, Mixture

SIZES = {"a": 100, "b": 50, "c": 30}
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
EPOCH = 700
CUT = f"step-{E.CUT:08d}"


def _sources() -> dict:
    """Source s holds the numbers 1000 × k … (k: its place), so a sample names its source and its index."""
    return {name: TensorDataset(torch.arange(n) + 1000 * k) for k, (name, n) in enumerate(SIZES.items())}


def _drawn(mix: Mixture, count: int, start: int = 0) -> list[tuple[str, int]]:
    names = list(SIZES)
    return [(names[v // 1000], v % 1000) for v in (int(mix[g][0]) for g in range(start, start + count))]


def test_the_realised_shares_match_the_weights():
    """Over 2,000 draws (2 epochs of 700 and 600 positions of the third) each source's share is its weight within
    four binomial standard deviations, and each whole epoch holds exactly its quota."""
    mix = Mixture(_sources(), weights=WEIGHTS, samples_per_epoch=EPOCH)
    drawn = _drawn(mix, 2000)
    counts = Counter(name for name, _ in drawn)
    for name, w in WEIGHTS.items():
        sigma = math.sqrt(w * (1 - w) / 2000)  # 0.0112 for 0.5, 0.0102 for 0.3, 0.0089 for 0.2
        assert abs(counts[name] / 2000 - w) < 4 * sigma, (name, counts)
    assert mix.quotas == [350, 210, 140]
    for epoch in range(2):
        assert Counter(name for name, _ in drawn[epoch * EPOCH:(epoch + 1) * EPOCH]) == {"a": 350, "b": 210, "c": 140}
    assert mix.counts(0, 2, torch.arange(600)) == dict(Counter(name for name, _ in drawn[1400:]))


def test_each_source_is_walked_in_its_own_seeded_order_pass_after_pass():
    """Source c (30 samples, 140 draws an epoch): every 30 of its draws are a new permutation of its samples; without
    shuffle they are 0, 1, 2 …; its walk does not depend on the other sources' weights."""
    mix = Mixture(_sources(), weights=WEIGHTS, samples_per_epoch=EPOCH)
    walk = [i for name, i in _drawn(mix, 2 * EPOCH) if name == "c"]
    passes = [walk[k:k + 30] for k in range(0, 270, 30)]
    assert all(sorted(p) == list(range(30)) for p in passes)
    assert len({tuple(p) for p in passes}) == len(passes)  # a new order each pass
    plain = [mix.locate(0, e, p, shuffle=False) for e in range(2) for p in range(EPOCH)]
    assert [i for name, i in plain if name == "c"] == [k % 30 for k in range(280)]
    other = Mixture(_sources(), weights={"a": 0.7, "b": 0.1, "c": 0.2}, samples_per_epoch=EPOCH)
    assert [i for name, i in _drawn(other, 2 * EPOCH) if name == "c"] == walk


def test_the_same_seed_gives_the_same_draws_from_any_position():
    """A pure function of (seed, epoch, position): a fresh mixture asked for epoch 5 first draws what one that
    walked there draws; another seed draws otherwise."""
    seq = [Mixture(_sources(), weights=WEIGHTS, seed=3)[g] for g in (0, 1, 2)]
    walked = Mixture(_sources(), weights=WEIGHTS, seed=3)
    at = [walked.locate(3, e, p) for e in range(6) for p in range(0, 180, 7)][-26:]
    fresh = Mixture(_sources(), weights=WEIGHTS, seed=3)
    assert [fresh.locate(3, 5, p) for p in range(0, 180, 7)] == at
    assert [Mixture(_sources(), weights=WEIGHTS, seed=3)[g] for g in (0, 1, 2)] == seq
    assert _drawn(Mixture(_sources(), weights=WEIGHTS, seed=4), 50) != _drawn(walked, 50)
    assert len(Mixture(_sources())) == 180 and Mixture(_sources()).quotas == [100, 50, 30]  # default: the lengths


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize("sources, kwargs, said", [
    ({"web": _Stream()}, {}, "Mixture source 'web' is a stream (_Stream)"),
    ({"web": TensorDataset(torch.zeros(0))}, {}, "Mixture source 'web' is empty (0 samples)"),
    ({"a/b": TensorDataset(torch.zeros(3))}, {}, "Mixture source name 'a/b'"),
    ([TensorDataset(torch.zeros(3))], {}, "Mixture sources: expected a non-empty mapping"),
    (None, {"weights": {"web": 1, "cod": 1}}, "Mixture weights name 'cod', which is no source; did you mean 'code'?"),
    (None, {"weights": {"web": 1}}, "source(s) 'code' have no weight"),
    (None, {"weights": {"web": 1, "code": 0}}, "Mixture weight of 'code': expected a finite number > 0, got 0"),
    (None, {"weights": {"web": 1, "code": float("nan")}}, "Mixture weight of 'code': expected a finite number > 0"),
    (None, {"weights": {"web": 1000, "code": 1}}, "Mixture source 'code' gets no sample of an epoch of 8"),
    (None, {"samples_per_epoch": 0}, "Mixture samples_per_epoch: expected an integer >= 1"),
])
def test_a_bad_mixture_is_refused_in_one_line(sources, kwargs, said):
    sources = sources or {"web": TensorDataset(torch.zeros(5)), "code": TensorDataset(torch.zeros(3))}
    with pytest.raises(DataError) as e:
        Mixture(sources, **kwargs)
    assert said in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ training on a mixture
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted fit on one process (a checkpoint at step 11: epoch 2, 3 of its 8 steps done), that
    checkpoint resumed on one process and on two (one 2-process group)."""
    out = tmp_path_factory.mktemp("mixture")
    threads = torch.get_num_threads()
    try:
        E.fit(out, "mix", None, micro=6)
        E.fit(out, "mix_again", str(out / "mix" / "checkpoints" / CUT), micro=6)
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(out / "mix" / "checkpoints" / CUT, out / "mix_to_two" / "checkpoints" / CUT)
    results = dist_procs.processes([str(out), f"mix_to_two={out / 'mix' / 'checkpoints' / CUT}"], 2, out,
                                   out / "store", timeout=240, env={"MICRO": 3},
                                   worker=dist_procs.HELPERS / "elastic_worker.py")
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    return out


def _rows(out, name: str, world: int) -> list:
    return [row for r in range(world) for row in json.loads((out / f"{name}-rows-{r}.json").read_text())["rows"]]


def _steps(rows: list, after: int = 0) -> dict:
    """{optimizer step: sorted sample indices it trained} over every rank's rows."""
    index = {v: i for i, v in enumerate(W.train_data()[0][:, 0].tolist())}
    steps: dict = {}
    for _, step, firsts in rows:
        if step > after:
            steps.setdefault(step, []).extend(index[v] for v in firsts)
    return {s: sorted(v) for s, v in steps.items()}


def test_a_mid_epoch_resume_on_one_process_is_bitwise(runs):
    one, again = torch.load(runs / "mix.pt"), torch.load(runs / "mix_again.pt")
    assert all(torch.equal(one[k], again[k]) for k in one)
    assert _steps(_rows(runs, "mix_again", 1)) == _steps(_rows(runs, "mix", 1), after=E.CUT)


def test_a_mid_epoch_resume_on_two_processes_goes_on_with_the_next_global_batch(runs):
    one, two = torch.load(runs / "mix.pt"), torch.load(runs / "mix_to_two.pt")
    assert max((one[k].double() - two[k].double()).abs().max().item() for k in one) < 1e-6
    steps = _steps(_rows(runs, "mix_to_two", 2))
    assert min(steps) == E.CUT + 1
    assert steps == _steps(_rows(runs, "mix", 1), after=E.CUT)
    mixed = Counter(i >= E.MIX_SPLIT for s in _steps(_rows(runs, "mix", 1)).values() for i in s)
    assert mixed == {True: 2 * 70, False: 2 * 23}  # 93 a epoch at 1 : 3 → a 23, b 70 (largest remainder)


def test_the_logged_rows_show_each_sources_share(runs):
    """log.every_steps=4: each interval row holds data/share/a and /b, the fractions of its 4 steps' samples."""
    rows = [json.loads(line) for line in (runs / "mix" / "metrics.jsonl").read_text().splitlines()]
    shown = {r["step"]: (r["data/share/a"], r["data/share/b"]) for r in rows if r.get("kind") == "interval"}
    steps = _steps(_rows(runs, "mix", 1))
    assert sorted(shown) == [4, 8, 12, 16]
    for step, (a, b) in shown.items():
        trained = [i for s in range(step - 3, step + 1) for i in steps[s]]
        expected_a = sum(i < E.MIX_SPLIT for i in trained) / len(trained)
        assert (a, b) == (pytest.approx(expected_a, abs=1e-12), pytest.approx(1 - expected_a, abs=1e-12))


# ------------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("sets, said", [
    (["data.sources={web: a.txt, code: b}", "data.mixture={web: 0.7, cod: 0.3}"],
     "config key 'data.mixture': 'cod' is no name of data.sources (web, code); did you mean 'code'?"),
    (["data.sources={web: a.txt, code: b}", "data.mixture={web: 1}"], "data.sources 'code' has no weight"),
    (["data.sources={web: a.txt}", "data.mixture={web: 0}"], "config key 'data.mixture': expected a mapping "
                                                            "{source name: weight > 0}, got {'web': 0}"),
    (["data.mixture={web: 1}"], "and data.sources is empty; set data.sources"),
    (["data.sources={web: a.txt}", "data.path=c.txt"], "and data.path 'c.txt' is set too; set one of them"),
])
def test_the_config_refuses_a_mixture_that_does_not_match_its_sources(sets, said):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert said in str(e.value)


def test_the_language_model_recipe_mixes_named_sources(tmp_path):
    from torchrig.recipes import get_recipe
    from torchrig.recipes.factory import build_data

    (tmp_path / "code").mkdir()
    (tmp_path / "web.txt").write_text("\n".join(f"the fox {i} jumps over the lazy dog {i} again" for i in range(40)))
    for i in range(6):
        (tmp_path / "code" / f"f{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 3)
    sources = f"data.sources={{web: {tmp_path / 'web.txt'}, code: {tmp_path / 'code'}}}"
    cfg = load_config(None, [sources, "data.mixture={web: 3, code: 1}", "lm.block_size=8", "data.val_fraction=0",
                             f"run_dir={tmp_path / 'run'}"])
    data = build_data(get_recipe("language-model"), cfg)
    mix = data["train"]
    assert isinstance(mix, Mixture) and mix.names == ["web", "code"]
    assert mix.weights == [0.75, 0.25] and len(mix) == sum(mix.lengths)
    with pytest.raises(ConfigError, match="config key 'data.sources': recipe 'digits' does not mix named sources"):
        build_data(get_recipe("digits"), load_config(None, [sources]))
