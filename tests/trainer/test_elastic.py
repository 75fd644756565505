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
import subprocess
import sys
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
            "steps": {r["step"] for r in ranks}, "strategy": {r["strategy"] for r in ranks}, "run": out / name, "schedule": {tuple(r["schedule"]) for r in ranks}}


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
    got = {"one": _one_process(out, "one"), "fsdp_one": _one_process(out, "fsdp_one")}
    said = {3: _group(out, 3, ["three"])[0].output}
    said[2] = _group(out, 2, ["two", f"one_to_two={out / 'one' / 'checkpoints' / CUT}",
                              f"three_to_two={out / 'three' / 'checkpoints' / CUT}", "spike", "stream", "streamw", "fsdp", "spikefsdp", "l1spike",
                              f"fsdp_one_to_two={out / 'fsdp_one' / 'checkpoints' / CUT}"])[0].output
    said["two_to_three"] = _group(out, 3, [f"two_to_three={out / 'two' / 'checkpoints' / CUT}"])[0].output
    got["two_to_one"] = _one_process(out, "two_to_one", out / "two" / "checkpoints" / CUT)
    got["clean"], got["l1clean"] = _one_process(out, "clean"), _one_process(out, "l1clean")
    got["fsdp_two_to_one"] = _one_process(out, "fsdp_two_to_one", out / "fsdp" / "checkpoints" / CUT)
    said["stream"] = _said(lambda: _one_process(out, "stream_to_one", out / "stream" / "checkpoints" / CUT))
    said["streamw"] = _said(lambda: _one_process(out, "streamw_to_one", out / "streamw" / "checkpoints" / CUT))
    got.update({name: _read(out, name, 1) for name in ("stream_to_one", "streamw_to_one")})
    got["stream"] = _read(out, "stream", 2)
    got["spike"] = _read(out, "spike", 2)
    got["spikefsdp"] = _read(out, "spikefsdp", 2)
    got["l1spike"] = _read(out, "l1spike", 2)
    got.update({"three": _read(out, "three", 3), "two": _read(out, "two", 2),
                "one_to_two": _read(out, "one_to_two", 2), "three_to_two": _read(out, "three_to_two", 2),
                "two_to_three": _read(out, "two_to_three", 3), "fsdp": _read(out, "fsdp", 2),
                "fsdp_one_to_two": _read(out, "fsdp_one_to_two", 2)})
    return got, said


def test_one_global_batch_is_the_same_mathematics_on_any_number_of_processes(runs):
    got, said = runs
    assert "batch 4/process × 3 × 1 accumulation = 12 global (data.global_batch_size)" in said[3]
    assert "batch 3/process × 2 × 2 accumulation = 12 global (data.global_batch_size)" in said[2]
    for name in ("one", "two", "three", "fsdp", "fsdp_one"):
        assert got[name]["steps"] == {16}, name
    assert _max_diff(got["two"]["params"], got["one"]["params"]) < ATOL
    assert _max_diff(got["three"]["params"], got["one"]["params"]) < ATOL
    assert _max_diff(got["fsdp"]["params"], got["fsdp_one"]["params"]) < ATOL  # FSDP2 on tokens
    assert _max_diff(got["fsdp"]["params"], E.token_model().state_dict()) > 1e-2  # and it learned something


def _trained(rows_of_ranks: list, after: int = 0, upto: int = 10 ** 9, tokens: bool = False) -> dict:
    """{epoch: Counter of sample indices} over every rank's rows of the steps in (after, upto]."""
    index = {v: i for i, v in enumerate((E.token_data() if tokens else W.train_data())[0][:, 0].tolist())}
    seen: dict = {}
    for rows in rows_of_ranks:
        for epoch, step, firsts in rows:
            if after < step <= upto:
                seen.setdefault(epoch, Counter()).update(index[v] for v in firsts)
    return seen


@pytest.mark.parametrize("resumed, original", [("two_to_one", "two"), ("one_to_two", "one"),
                                               ("three_to_two", "three"), ("two_to_three", "two"),
                                               ("fsdp_two_to_one", "fsdp"), ("fsdp_one_to_two", "fsdp_one")])
def test_a_mid_epoch_checkpoint_resumes_on_another_number_of_processes_exactly(runs, resumed, original):
    """``fsdp…``: FSDP2 on 2 processes (a sharded checkpoint) and one unwrapped process, micro-batches of 3
    accumulated (2 or 4 per step), the loss normalised over the valid tokens of the whole global batch, the
    epoch's last global batch short (9 sequences)."""
    got, said = runs
    run, before = got[resumed], got[original]
    tokens = resumed.startswith("fsdp")
    two = run if resumed.endswith("two") else before  # the 2-process side: FSDP2 or DDP
    assert two["strategy"] == ({"fsdp"} if tokens else {"ddp"})
    assert run["steps"] == {16}
    assert _max_diff(run["params"], before["params"]) < ATOL  # the uninterrupted run at the original size
    # the one-cycle schedule kept its horizon (16 steps), stepped 16 times, and ended at the same learning rate
    assert run["schedule"] == before["schedule"] and {s[:2] for s in run["schedule"]} == {(16, 16)}
    first = min(step for rows in run["rows"] for _, step, _ in rows)
    assert first == E.CUT + 1, "it goes on with the step after the checkpoint's"
    # every sample once per epoch: epoch 1 and the first 3 steps of epoch 2 before the checkpoint, the rest after
    seen = _trained(before["rows"], upto=E.CUT, tokens=tokens)
    for epoch, counts in _trained(run["rows"], tokens=tokens).items():
        seen.setdefault(epoch, Counter()).update(counts)
    assert sorted(seen) == [0, 1]
    for epoch, counts in seen.items():
        assert sorted(counts) == list(range(W.N_TRAIN)) and set(counts.values()) == {1}, epoch
    # and in the uninterrupted run's order, step by step
    assert _order(run["rows"], tokens=tokens) == _order(before["rows"], after=E.CUT, tokens=tokens)
    for text in said.values():
        assert "resuming at the start of epoch" not in text


def _order(rows_of_ranks: list, after: int = 0, tokens: bool = False) -> list:
    index = {v: i for i, v in enumerate((E.token_data() if tokens else W.train_data())[0][:, 0].tolist())}
    steps: dict = {}
    for rows in rows_of_ranks:
        for _, step, firsts in rows:
            if step > after:
                steps.setdefault(step, set()).update(index[v] for v in firsts)
    return [sorted(steps[s]) for s in sorted(steps)]


@pytest.mark.parametrize("name", ["spike", "spikefsdp"])
def test_a_spike_on_two_ranks_is_rolled_back_by_both_alike(runs, name):
    """on_spike: rollback under DDP and FSDP2 (2 processes of 3, 2 accumulated): the sample scaled by -1000 makes
    step 5's loss spike; both ranks return to the snapshot of step 4 (FSDP2: each its shards of the parameters
    and optimizer state), leave the step's 12 samples out and end with the parameters of one process trained on
    the 81 others (1e-6)."""
    got, said = runs
    ledger = [json.loads(line) for line in (got[name]["run"] / "skipped_samples.jsonl").read_text().splitlines()]
    assert [(e["step"], e["rolled_back_to"], e["samples"]) for e in ledger] == [(5, 4, E.POISONED_STEP)]
    assert "torchrig: spike at step 5 (loss " in said[2]
    assert got[name]["steps"] == got["clean"]["steps"] == {14}
    assert _max_diff(got[name]["params"], got["clean"]["params"]) < ATOL
    assert got[name]["strategy"] == ({"fsdp"} if name.endswith("fsdp") else {"ddp"})


def test_a_loss_spike_on_one_rank_rolls_back_both(runs):
    """A regression under the L1 loss whose sample 58 has a target off by 1e4: only rank 1's micro-batch holding it
    spikes (its loss; the L1 gradient of that sample, and the gradient norm over the ranks, stay as any other's).
    The ranks agree on the largest loss: both return to step 4 and replay step 5 without its samples, one ledger
    line is written, and they end with the parameters of one process trained on the 81 others (1e-6)."""
    got, said = runs
    run = got["l1spike"]
    ledger = [json.loads(line) for line in (run["run"] / "skipped_samples.jsonl").read_text().splitlines()]
    assert [(e["step"], e["rolled_back_to"], e["samples"]) for e in ledger] == [(5, 4, E.POISONED_STEP)]
    assert ledger[0]["reason"].startswith("loss ")
    for rows in run["rows"]:  # each rank: step 5's 2 micro-batches, then the replayed step 5's 2
        assert Counter(step for epoch, step, _ in rows if epoch == 0)[5] == 4
    assert run["steps"] == got["l1clean"]["steps"] == {14}
    assert _max_diff(run["params"], got["l1clean"]["params"]) < ATOL


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


def _wait_for_port(port: int, proc: subprocess.Popen, seconds: float = 60) -> None:
    import socket
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"the first agent's rendezvous store did not listen on 127.0.0.1:{port}")


def test_an_elastic_launch_that_loses_a_node_resumes_mid_epoch_on_the_one_left(runs, tmp_path):
    """Two ``torchrig launch --nnodes 1:2 --nproc-per-node 1 --max-restarts 1`` agents meet in a c10d rendezvous on
    127.0.0.1 and train the poisoned data with ``on_spike: rollback`` (a rollback at step 5, the checkpoint at step
    11, in the middle of epoch 2). Before step 13 the second node dies (its agent and worker SIGKILLed); the
    first one's worker loses its peer, torchrun restarts it alone (a group of 1) and torchrig resumes from step 11
    at the same global batch of 12: the parameters of the run that never held the poisoned step's samples (1e-6),
    and the ledger names them once. ``--start`` is the script's own option (torchrun has ``--start-method``)."""
    got, _ = runs
    port = dist_procs.free_port()
    command = ["launch", "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-timeout", "60",
               "--rdzv-conf", "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2", "--",
               str(dist_procs.HELPERS / "elastic_worker.py"), "--launched", str(tmp_path), "spike_launch",
               "--start", str(E.CUT + 2)]
    env = dist_procs._env({"GLOO_SOCKET_IFNAME": "lo"})
    agents = []
    try:
        for node in (0, 1):  # the first agent hosts the rendezvous store (it must outlive the second): started first
            agents.append(subprocess.Popen([sys.executable, "-m", "torchrig", *command], stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                           env=dict(env, **({"KILL_NODE": "1"} if node else {}))))
            _wait_for_port(port, agents[0]) if node == 0 else None
        out = agents[0].communicate(timeout=180)[0]
        agents[1].communicate(timeout=30)
    finally:
        for agent in agents:
            dist_procs._kill_group(agent)
    assert (tmp_path / "killed").read_text().endswith(f"of 2 before step {E.CUT + 2}\n"), out[-4000:]
    assert agents[1].returncode == -9 and agents[0].returncode == 0, out[-4000:]
    assert "restart 1 by torchrun; resumed from" in out and "step-00000011" in out
    assert "torchrig: 1 process(es) on cpu" in out and "12 global (data.global_batch_size)" in out
    rows = json.loads((tmp_path / "spike_launch-rows-0.json").read_text())
    assert rows["step"] == 14 and min(step for _, step, _ in rows["rows"]) == E.CUT + 1
    assert _max_diff(torch.load(tmp_path / "spike_launch.pt"), got["clean"]["params"]) < ATOL
    ledger = [json.loads(line) for line in (tmp_path / "spike_launch" / "skipped_samples.jsonl").read_text().splitlines()]
    assert [(e["step"], e["samples"]) for e in ledger] == [(5, E.POISONED_STEP)]


def test_the_logged_train_values_of_a_resumed_run_count_each_sample_once(runs):
    """The checkpoint of one process at step 11 (3 steps of epoch 2 done), resumed on 2 ranks: the train loss and
    accuracy logged in epoch 2 (every 4 steps and at its end) are the uninterrupted run's. The running sums of the
    36 samples before the checkpoint go to one rank only; loaded on both, they would count twice."""
    got, _ = runs

    def epoch_2(name: str) -> dict:
        rows = [json.loads(line) for line in (got[name]["run"] / "metrics.jsonl").read_text().splitlines()]
        return {(r["kind"], r["step"]): (r["train/loss"], r["train/accuracy"]) for r in rows
                if r.get("kind") in ("interval", "epoch") and r["step"] > 8}

    resumed, whole = epoch_2("one_to_two"), epoch_2("one")
    assert sorted(resumed) == sorted(whole) == [("epoch", 16), ("interval", 12), ("interval", 16)]
    for at, (loss, accuracy) in whole.items():
        assert resumed[at] == (pytest.approx(loss, rel=1e-5), pytest.approx(accuracy, abs=1e-12)), at
