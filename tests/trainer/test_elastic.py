"""Elastic runs: one global batch on 1, 2 and 3 processes, and a mid-epoch checkpoint resumed on another number.

``data.global_batch_size`` 12 over 93 samples: 8 optimizer steps per epoch, the last of 9 samples, on 1 process
(micro-batches of 6: 2 accumulated per step), 2 processes (micro-batches of 3: 2 per step, the short last global
batch dealt 2 + 1 and a filler) and 3 processes (4 each). Each run also saves a checkpoint at step 11: epoch 2,
3 of its 8 steps (36 samples) done. Resumed on another number of processes (2 → 1, 1 → 2, 3 → 2, 2 → 3; real gloo
process groups), it goes on with sample 37 of the epoch's order: the parameters equal the uninterrupted run's
(1e-6), and every sample is trained exactly once in each epoch (counted from the samples each rank trained).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from helpers import dist_procs
from helpers import dist_worker as W
from helpers import elastic_worker as E

pytestmark = pytest.mark.slow

ATOL = 1e-6
CUT = f"step-{E.CUT:08d}"
MICRO = {1: 6, 2: 3, 3: None}  # 1 × 6 × 2 accumulated, 2 × 3 × 2, 3 × 4 × 1


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _one_process(out, name, checkpoint=None) -> dict:
    threads = torch.get_num_threads()
    try:
        E.fit(out, name, checkpoint, micro=MICRO[1])
    finally:
        torch.set_num_threads(threads)
    return _read(out, name, 1)


def _said(fn) -> str:
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        fn()
    return text.getvalue()


def _read(out, name, world) -> dict:
    ranks = [json.loads((out / f"{name}-rows-{r}.json").read_text()) for r in range(world)]
    return {"params": torch.load(out / f"{name}.pt"), "rows": [r["rows"] for r in ranks],
            "steps": {r["step"] for r in ranks}, "run": out / name, "schedule": {tuple(r["schedule"]) for r in ranks}}


def _group(out, world, specs) -> list:
    for spec in specs:  # every rank must find the checkpoint it resumes from: copied before they start
        name, _, checkpoint = spec.partition("=")
        if checkpoint:
            shutil.copytree(checkpoint, out / name / "checkpoints" / CUT)
    results = dist_procs.processes([str(out), *specs], world, out, out / "store", timeout=240,
                                   env={"MICRO": MICRO[world] or ""}, worker=dist_procs.HELPERS / "elastic_worker.py")
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} of {world} failed:\n{r.output[-4000:]}"
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted runs on 1, 2 and 3 processes and the resumed ones: 1 → 2 and 3 → 2 in one 2-process
    group, 2 → 3 in a second 3-process group, 2 → 1 in this process."""
    out = tmp_path_factory.mktemp("elastic")
    got = {"one": _one_process(out, "one")}
    said = {3: _group(out, 3, ["three"])[0].output}
    said[2] = _group(out, 2, ["two", f"one_to_two={out / 'one' / 'checkpoints' / CUT}",
                              f"three_to_two={out / 'three' / 'checkpoints' / CUT}", "spike", "stream", "streamw"])[0].output
    said["two_to_three"] = _group(out, 3, [f"two_to_three={out / 'two' / 'checkpoints' / CUT}"])[0].output
    got["two_to_one"] = _one_process(out, "two_to_one", out / "two" / "checkpoints" / CUT)
    got["clean"] = _one_process(out, "clean")
    said["stream"] = _said(lambda: _one_process(out, "stream_to_one", out / "stream" / "checkpoints" / CUT))
    said["streamw"] = _said(lambda: _one_process(out, "streamw_to_one", out / "streamw" / "checkpoints" / CUT))
    got.update({name: _read(out, name, 1) for name in ("stream_to_one", "streamw_to_one")})
    got["stream"] = _read(out, "stream", 2)
    got["spike"] = _read(out, "spike", 2)
    got.update({"three": _read(out, "three", 3), "two": _read(out, "two", 2),
                "one_to_two": _read(out, "one_to_two", 2), "three_to_two": _read(out, "three_to_two", 2),
                "two_to_three": _read(out, "two_to_three", 3)})
    return got, said


def test_one_global_batch_is_the_same_mathematics_on_any_number_of_processes(runs):
    got, said = runs
    assert "batch 4/process × 3 × 1 accumulation = 12 global (data.global_batch_size)" in said[3]
    assert "batch 3/process × 2 × 2 accumulation = 12 global (data.global_batch_size)" in said[2]
    for name in ("one", "two", "three"):
        assert got[name]["steps"] == {16}, name
    assert _max_diff(got["two"]["params"], got["one"]["params"]) < ATOL
    assert _max_diff(got["three"]["params"], got["one"]["params"]) < ATOL


def _trained(rows_of_ranks: list, after: int = 0, upto: int = 10 ** 9) -> dict:
    """{epoch: Counter of sample indices} over every rank's rows of the steps in (after, upto]."""
    index = {v: i for i, v in enumerate(W.train_data()[0][:, 0].tolist())}
    seen: dict = {}
    for rows in rows_of_ranks:
        for epoch, step, firsts in rows:
            if after < step <= upto:
                seen.setdefault(epoch, Counter()).update(index[v] for v in firsts)
    return seen


@pytest.mark.parametrize("resumed, original", [("two_to_one", "two"), ("one_to_two", "one"),
                                               ("three_to_two", "three"), ("two_to_three", "two")])
def test_a_mid_epoch_checkpoint_resumes_on_another_number_of_processes_exactly(runs, resumed, original):
    got, said = runs
    run, before = got[resumed], got[original]
    assert run["steps"] == {16}
    assert _max_diff(run["params"], before["params"]) < ATOL  # the uninterrupted run at the original size
    # the one-cycle schedule kept its horizon (16 steps), stepped 16 times, and ended at the same learning rate
    assert run["schedule"] == before["schedule"] and {s[:2] for s in run["schedule"]} == {(16, 16)}
    first = min(step for rows in run["rows"] for _, step, _ in rows)
    assert first == E.CUT + 1, "it goes on with the step after the checkpoint's"
    # every sample once per epoch: epoch 1 and the first 3 steps of epoch 2 before the checkpoint, the rest after
    seen = _trained(before["rows"], upto=E.CUT)
    for epoch, counts in _trained(run["rows"]).items():
        seen.setdefault(epoch, Counter()).update(counts)
    assert sorted(seen) == [0, 1]
    for epoch, counts in seen.items():
        assert sorted(counts) == list(range(W.N_TRAIN)) and set(counts.values()) == {1}, epoch
    # and in the uninterrupted run's order, step by step
    assert _order(run["rows"]) == _order(before["rows"], after=E.CUT)
    for text in said.values():
        assert "resuming at the start of epoch" not in text


def _order(rows_of_ranks: list, after: int = 0) -> list:
    index = {v: i for i, v in enumerate(W.train_data()[0][:, 0].tolist())}
    steps: dict = {}
    for rows in rows_of_ranks:
        for _, step, firsts in rows:
            if step > after:
                steps.setdefault(step, set()).update(index[v] for v in firsts)
    return [sorted(steps[s]) for s in sorted(steps)]


def test_a_spike_on_two_ranks_is_rolled_back_by_both_alike(runs):
    """on_spike: rollback under DDP (2 processes of 3, 2 accumulated): the sample scaled by -1000 makes step 5's
    loss spike; both ranks return to the snapshot of step 4, leave the step's 12 samples out and end with
    the parameters of one process trained on the 81 others (1e-6)."""
    got, said = runs
    ledger = [json.loads(line) for line in (got["spike"]["run"] / "skipped_samples.jsonl").read_text().splitlines()]
    assert [(e["step"], e["rolled_back_to"], e["samples"]) for e in ledger] == [(5, 4, E.POISONED_STEP)]
    assert "torchrig: spike at step 5 (loss " in said[2]
    assert got["spike"]["steps"] == got["clean"]["steps"] == {14}
    assert _max_diff(got["spike"]["params"], got["clean"]["params"]) < ATOL


def test_a_stream_read_in_order_resumes_on_another_number_of_processes_exactly(runs):
    """A stream read by each process itself (data.num_workers=0): sample i goes to rank i mod W, so after 6 batches
    of 3 on 2 ranks the first 36 samples are used. Resumed in one process (batches of 6) it re-reads them and goes
    on with sample 37: the parameters of the uninterrupted 2-process run, every sample once in epoch 2."""
    got, said = runs
    run, before = got["stream_to_one"], got["stream"]
    assert "torchrig: resuming in epoch 2 re-reads the 6 batches already used" in said["stream"]
    assert "starts over" not in said["stream"]
    assert run["steps"] == before["steps"] == {16}
    assert _max_diff(run["params"], before["params"]) < ATOL
    seen = _trained(before["rows"], upto=E.CUT)[1] + _trained(run["rows"])[1]
    assert sorted(seen) == list(range(W.N_TRAIN)) and set(seen.values()) == {1}


def test_a_stream_read_by_workers_starts_its_epoch_over_in_one_line(runs):
    """Read by DataLoader workers, a stream's readers hold no prefix of it: resumed on another number of processes
    its epoch starts over, said in one line with why, and the run ends where it was planned to end."""
    got, said = runs
    assert ("torchrig: epoch 2 starts over: the checkpoint stopped 6 batches into it on 2 process(es), now 1, and a "
            "stream read by DataLoader workers or split by its shards keeps a position per reader, which cannot be "
            "re-split over another number of processes (with data.num_workers=0 it can); the run still ends at step "
            "16") in said["streamw"]
    assert got["streamw_to_one"]["steps"] == {16}
    assert min(step for rows in got["streamw_to_one"]["rows"] for _, step, _ in rows) == E.CUT + 1
