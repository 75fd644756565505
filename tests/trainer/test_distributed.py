"""Distributed training is exact: real 2-rank gloo process groups on CPU against one process.

One pair of worker processes (joined by a ``file://`` init method) runs DDP, DDP with accumulation
and FSDP2 fits plus evaluation and prediction; the tests compare each with a single process using a
batch twice as large over the same data order (rank r takes the r-th slice of each global batch, so the
two ranks' batches at a step are the single process's batch). 93 samples: each epoch's last global batch is
short (3 + 2 samples). Then a DDP run is killed with SIGKILL in epoch 2's last step and resumed, and a
``torchrig launch --max-restarts 1`` run loses a worker there and restarts itself: both end where the
uninterrupted run ends.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import dist_procs
from helpers import dist_worker as W

pytestmark = pytest.mark.slow

ATOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, batch 8 (= 2 ranks × 4): parameters, evaluation and predictions."""
    from torchrig import Trainer

    threads = torch.get_num_threads()
    d = tmp_path_factory.mktemp("reference")
    try:
        t = Trainer(W.make_model(), **W.settings(d, strategy="none", batch_size=8, threads=None,
                                                 **{"checkpoint.save_final": False}))
        t.fit(W.train_data())
        ex, ey = W.eval_data()
        return {"params": W.params(t.model), "eval": t.evaluate((ex, ey)), "pred": t.predict(ex)}
    finally:
        torch.set_num_threads(threads)


def _pair(tmp_path_factory, scenario: str, timeout: float):
    """Run one scenario of ``dist_worker.py`` as a 2-rank pair; both ranks must succeed."""
    out = tmp_path_factory.mktemp(scenario)
    results = dist_procs.pair(scenario, out, out / "init-store", timeout=timeout)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    return out, results


@pytest.fixture(scope="module")
def equiv(tmp_path_factory):
    return _pair(tmp_path_factory, "equiv", timeout=240)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """DDP options, gradient-sync counts, metrics over ranks and SyncBatchNorm on CPU, from one worker pair."""
    out, _ = _pair(tmp_path_factory, "features", timeout=180)
    return out, [json.loads((out / f"features-{rank}.json").read_text()) for rank in (0, 1)]


def test_global_batch_printed_once(equiv):
    _, (rank0, rank1) = equiv
    assert "batch 4/process × 2 × 1 accumulation = 8 global" in rank0.output
    assert "batch 2/process × 2 × 2 accumulation = 8 global" in rank0.output
    assert "strategy fsdp" in rank0.output
    assert "global" not in rank1.output, "only rank 0 prints"


def test_ddp_two_ranks_match_one_process_with_double_batch(equiv, reference):
    out, _ = equiv
    assert _max_diff(torch.load(out / "ddp.pt"), reference["params"]) < ATOL


def test_ddp_accumulation_matches(equiv, reference):
    out, _ = equiv  # 2 ranks × batch 2 × 2 micro-batches, gradient sync only on the second
    assert _max_diff(torch.load(out / "ddp_acc.pt"), reference["params"]) < ATOL


def test_fsdp_two_ranks_match_one_process(equiv, reference):
    out, _ = equiv
    assert _max_diff(torch.load(out / "fsdp.pt"), reference["params"]) < ATOL


def test_fsdp_gradient_clipping_uses_the_norm_over_all_shards(equiv, tmp_path):
    from torchrig import Trainer

    out, _ = equiv  # every Linear sharded separately; the clip must see the global norm
    threads = torch.get_num_threads()
    try:
        t = Trainer(W.make_model(), **W.settings(tmp_path, strategy="none", batch_size=8, threads=None,
                                                 clip_grad_norm=0.5, **{"checkpoint.save_final": False}))
        t.fit(W.train_data())
    finally:
        torch.set_num_threads(threads)
    assert _max_diff(torch.load(out / "fsdp_clip.pt"), W.params(t.model)) < ATOL


def test_fsdp_bf16_mixed_precision_trains(equiv, tmp_path):
    """bf16 parameters in compute, fp32 shards and gradient reduction: one epoch lands next to the fp32 one
    (bf16 keeps ~3 significant digits), but measurably off it, as computing in bf16 must be."""
    from torchrig import Trainer

    out, (rank0, _) = equiv
    p = torch.load(out / "fsdp_bf16.pt")
    assert all(v.dtype == torch.float32 for v in p.values())
    threads = torch.get_num_threads()
    try:
        t = Trainer(W.make_model(), **W.settings(tmp_path, strategy="none", batch_size=8, threads=None, epochs=1,
                                                 **{"checkpoint.save_final": False}))
        t.fit(W.train_data())
    finally:
        torch.set_num_threads(threads)
    fp32, start = W.params(t.model), W.params(W.make_model())

    def norm(a: dict, b: dict) -> float:
        return float(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a) ** 0.5)

    assert norm(p, fp32) < 0.02 * norm(fp32, start)  # measured: 0.3 % of the distance the epoch moved
    assert _max_diff(p, fp32) > 1e-5  # measured: 6e-4; an fp32 FSDP run matches to 1e-6 (ATOL)
    assert "precision bf16" in rank0.output
    assert "dist.fsdp_cpu_offload=true is ignored when training on CPU: the parameters already live in CPU memory " \
           "(the option moves GPU shards and optimizer state to the host)" in rank0.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_evaluation_of_odd_size_set_is_exact(equiv, reference, strategy):
    out, _ = equiv
    got = json.loads((out / "eval.json").read_text())[strategy]
    want = reference["eval"]
    for key in ("eval", "eval3"):  # eval3: batch 3, so rank 0 runs 7 batches and rank 1 runs 6
        assert got[key].keys() == want.keys()
        assert got[key]["accuracy"] == want["accuracy"]  # 37 samples, each counted once
        assert got[key]["loss"] == pytest.approx(want["loss"], rel=1e-6)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_predict_keeps_data_order(equiv, reference, strategy):
    out, _ = equiv
    pred = torch.load(out / f"pred_{strategy}.pt")
    assert pred.shape == reference["pred"].shape == (W.N_EVAL, W.CLASSES)
    assert torch.allclose(pred, reference["pred"], atol=ATOL)


def test_fsdp_checkpoint_is_sharded_and_consolidated(equiv):
    from torchrig.checkpoint import load_weights

    out, _ = equiv
    ckpts = out / "fsdp" / "checkpoints"
    latest = ckpts / "latest"
    assert os.readlink(latest) == "step-00000024"
    shards = latest / "sharded"
    assert (shards / ".metadata").is_file()
    assert len(list(shards.glob("*.distcp"))) == 2, "one file per rank"
    meta = json.loads((latest / "meta.json").read_text())
    assert meta["sharded"] is True and meta["world_size"] == 2
    model = W.make_model()
    load_weights(model, latest)  # model.safetensors: plain tensors, one process, no torch.distributed
    assert _max_diff(W.params(model), torch.load(out / "fsdp.pt")) == 0.0
    assert not list(ckpts.glob(".tmp-*"))


def test_fsdp_checkpoint_resumes_in_one_process(equiv, tmp_path, capsys):
    """The epoch-1 checkpoint of 2 FSDP ranks, resumed by 1 plain process: the same end point (to float
    tolerance; it says that the two ranks' random streams cannot be continued by one)."""
    import shutil

    from torchrig import Trainer

    out, _ = equiv
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "fsdp" / "checkpoints" / "step-00000012", run / "checkpoints" / "step-00000012")
    threads = torch.get_num_threads()
    try:
        t = Trainer(W.make_model(), **W.settings(run, strategy="none", batch_size=8, threads=None,
                                                 resume=str(run / "checkpoints" / "step-00000012")))
        t.fit(W.train_data())
    finally:
        torch.set_num_threads(threads)
    assert t.global_step == 24
    assert "the random number generators of 2 process(es), now 1" in capsys.readouterr().out
    # model weights and SGD momentum both came back from the DCP shards
    assert _max_diff(W.params(t.model), torch.load(out / "fsdp.pt")) < ATOL


def test_exact_resume_after_sigkill_under_ddp(equiv, tmp_path):
    out, _ = equiv
    mark = tmp_path / "killed"
    first = dist_procs.pair("resume", tmp_path, tmp_path / "init-store",
                            env={"KILL_AT_STEP": 24, "FAULT_MARK": mark})  # epoch 2's last, short step
    assert first[1].returncode == -9, first[1].output[-3000:]
    assert mark.read_text().strip() == "killed before step 24"
    survivor = first[0]
    assert survivor.returncode == 3, survivor.output[-3000:]
    assert "lost the connection to another rank" in survivor.stderr
    assert "group initialized after close: False" in survivor.stderr
    assert os.readlink(tmp_path / "run" / "checkpoints" / "latest") == "step-00000020"

    # A rank that cannot see the checkpoint (no shared file system) stops every rank with one clear error.
    apart = dist_procs.pair("resume", tmp_path, tmp_path / "init-store",
                            env={"RESUME": 1, "RANK1_RUN_DIR": tmp_path / "elsewhere"})
    for r in apart:
        assert r.returncode == 3, r.output[-3000:]
        assert "rank 0 found step-00000020 but rank(s) 1 found none" in r.stderr
        assert "shared by all machines" in r.stderr

    second = dist_procs.pair("resume", tmp_path, tmp_path / "init-store", env={"RESUME": 1},
                             init=f"tcp://127.0.0.1:{dist_procs.free_port()}")  # the other explicit init method
    for r in second:
        assert r.returncode == 0, r.output[-3000:]
    assert "resumed from" in second[0].stdout and "step-00000020 at step 24" in second[0].stdout
    resumed, uninterrupted = torch.load(tmp_path / "resumed.pt"), torch.load(out / "ddp.pt")
    assert _max_diff(resumed, uninterrupted) <= 1e-7


def test_elastic_restart_after_sigkill_resumes_and_matches(equiv, tmp_path):
    out, _ = equiv
    mark, listeners = tmp_path / "killed", tmp_path / "listeners"
    r = dist_procs.torchrig(["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--",
                             str(dist_procs.WORKER), "fit", str(tmp_path)], timeout=240,
                            env={"KILL_AT_STEP": 24, "FAULT_MARK": mark, "LISTEN_REPORT": listeners})
    assert r.returncode == 0, r.output[-5000:]
    assert mark.read_text().strip() == "killed before step 24", "the worker was not killed: nothing was tested"
    assert "restart 1 by torchrun; resumed from" in r.output
    assert "finished at step 24" in r.stdout
    assert _max_diff(torch.load(tmp_path / "final.pt"), torch.load(out / "ddp.pt")) <= 1e-7
    # A single-machine launch listens on loopback only: the rendezvous store and every worker's sockets.
    addresses = listeners.read_text().split()
    assert len(addresses) >= 3, addresses  # the store + one gloo listener per worker
    assert all(a.startswith("127.") for a in addresses), addresses


# ----------------------------------------------------------------------------- DDP options, no_sync, metrics


def test_ddp_options_reach_distributed_data_parallel(features):
    _, reports = features
    for report in reports:
        got = report["ddp_options"]
        # find_unused_parameters=true, bucket_cap_mb=1, gradient_as_bucket_view=false on a model with an unused layer
        assert (got["find_unused_parameters"], got["static_graph"], got["bucket_bytes_cap"],
                got["gradient_as_bucket_view"]) == (True, False, 1024 * 1024, False)
        assert got["unused_steps"] == 3  # DDP's reducer accepted the unused parameter at every step
        # static_graph=true; the defaults otherwise: gradient_as_bucket_view on, find_unused_parameters off
        assert (got["static_graph_set"], got["static_steps"], got["defaults_view"], got["defaults_unused"]) == \
            (True, 3, True, False)


def test_gradients_are_all_reduced_once_per_accumulation_window(features):
    """accumulate=3 over 7 micro-batches per rank: one all-reduce at the last micro-batch of each window
    (indices 2, 5 and the short window's 6), counted by a DDP communication hook; a GAN-like model
    with two DDP-wrapped networks syncs each of them once per window too."""
    _, reports = features
    for report in reports:
        syncs = report["gradient_syncs"]
        assert syncs["one/steps"] == syncs["two/steps"] == 3
        for key in ("one/model", "two/a", "two/b"):
            assert syncs[key] == [[0, 2], [0, 5], [0, 6]], key  # [bucket, micro-batch]: one bucket, three syncs


def test_metrics_over_ranks_equal_sklearn_on_all_the_data(features):
    import numpy as np
    from sklearn import metrics as skm

    out, reports = features
    saved = torch.load(out / "metrics-outputs.pt")
    logits, y = saved["logits"], saved["target"]
    assert len(y) == W.N_EVAL == 37  # 19 samples on rank 0, 18 on rank 1

    def expected(idx) -> dict:
        lg, t = logits[idx], y[idx]
        pred, true = lg.argmax(1).numpy(), t.numpy()
        scores = {"loss": float(torch.nn.functional.cross_entropy(lg, t)),
                  "accuracy": skm.accuracy_score(true, pred),
                  "top2": skm.top_k_accuracy_score(true, lg.numpy(), k=2, labels=np.arange(W.CLASSES))}
        for name, fn in (("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)):
            scores[name] = fn(true, pred, average="macro", zero_division=0)
            scores[f"{name}_weighted"] = fn(true, pred, average="weighted", zero_division=0)
        return scores

    want = expected(torch.arange(37))
    for report in reports:
        assert report["metrics"] == pytest.approx(want, rel=1e-6)
    rank0_only = expected(torch.arange(0, 37, 2))  # what a metric computed on rank 0's shard alone would say
    assert all(rank0_only[k] != pytest.approx(want[k], rel=1e-3) for k in ("f1", "precision", "recall", "top2"))


def test_sync_batchnorm_is_ignored_on_cpu_with_a_warning(features):
    _, reports = features
    for report in reports:
        assert report["sync_batchnorm"] == {
            "warnings": ["dist.sync_batchnorm=true is ignored on CPU: torch's SyncBatchNorm runs on GPUs only, so "
                         "each process normalises with its own batch statistics"],
            "norm": "BatchNorm1d", "steps": 2}


# ----------------------------------------------------------------------------- logged values; another world size


def _rows(run_dir) -> list[dict]:
    import json as _json

    return [_json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_process(model, run_dir, step_fn=None, **kw):
    """One plain process at batch 8 (= 2 ranks × 4) over W.train_data(); closed, so its run directory is free."""
    from torchrig import Trainer

    threads = torch.get_num_threads()
    try:
        with Trainer(model, step_fn=step_fn, **W.settings(run_dir, strategy="none", batch_size=8, threads=None,
                                                           **kw)) as t:
            t.fit(W.train_data())
        return t
    finally:
        torch.set_num_threads(threads)


def _order(rows: list, after: int = 0) -> list[list[int]]:
    """Sample indices per optimizer step after step ``after``, the ranks' slices joined in rank order (rank r takes
    the r-th slice of each global batch): ``rows`` from W.recording_step, one list per rank."""
    index = {v: i for i, v in enumerate(W.train_data()[0][:, 0].tolist())}
    assert len(index) == W.N_TRAIN  # feature 0 tells the samples apart
    steps: dict[int, list[int]] = {}
    for rank_rows in rows:
        for _, step, firsts in rank_rows:
            if step > after:
                steps.setdefault(step, []).extend(index[v] for v in firsts)
    return [steps[s] for s in sorted(steps)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted one-process run (no dropout, rows every 4 steps), the samples of each step recorded."""
    d = tmp_path_factory.mktemp("one_process")
    rows: list = []
    t = _one_process(W.make_model(), d, step_fn=W.recording_step(rows), **{"log.every_steps": 4})
    assert t.global_step == 24
    return d, rows


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """A one-process checkpoint stopped in epoch 2 (step 14 of 24: 16 of the epoch's 93 samples used), then one
    worker pair (``dist_worker.py worlds``) that logs a DDP run, stops another at step 14 and resumes the first."""
    out = tmp_path_factory.mktemp("worlds")
    one = out / "one"
    _one_process(W.dropout_model(), one, max_steps=14)
    results = dist_procs.pair("worlds", out, out / "init-store", timeout=240, env={"ONE_RUN": one})
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    return out, results, [json.loads((out / f"worlds-{rank}.json").read_text()) for rank in (0, 1)]


def test_logged_train_values_of_two_ranks_equal_one_process(worlds, one_process):
    """docs/scaling-out.md: "Logged training loss and metrics are reduced over all ranks". 93 samples, 12 steps of 8
    per epoch, the 12th short (3 + 2 samples): the interval rows at steps 4 … 24 (those at 12 and 24 hold the short
    batch) and both epoch rows say what one process at batch 8 says; rank 0's own numbers would not."""
    out, _, _ = worlds
    reference, _ = one_process
    keys = ("train/loss", "train/accuracy")

    def logged(run_dir) -> dict:
        return {(r["kind"], r["step"]): {k: r[k] for k in keys} for r in _rows(run_dir) if r.get("kind") in
                ("interval", "epoch")}

    got, want = logged(out / "logged"), logged(reference)
    assert sorted(want) == sorted([("interval", s) for s in (4, 8, 12, 16, 20, 24)] + [("epoch", 12), ("epoch", 24)])
    assert sorted(got) == sorted(want)
    for at in want:
        assert got[at]["train/accuracy"] == pytest.approx(want[at]["train/accuracy"], abs=1e-12), at
        assert got[at]["train/loss"] == pytest.approx(want[at]["train/loss"], rel=1e-5, abs=1e-7), at


@pytest.fixture(scope="module")
def two_to_one(worlds, tmp_path_factory):
    """The DDP checkpoint of step 14 (epoch 2, 2 of its 12 steps done), resumed by one process at batch 8: what it
    said, the samples of each step it trained, its last step."""
    import shutil

    from torchrig.checkpoint import read_checkpoint

    out, _, _ = worlds
    saved = out / "cut" / "checkpoints" / "step-00000014"
    state, _, _ = read_checkpoint(saved)
    assert (state["counters"]["epoch"], state["counters"]["batch_in_epoch"], state["counters"]["world_size"]) == (1, 2, 2)
    run = tmp_path_factory.mktemp("two_to_one")
    (run / "checkpoints").mkdir()
    shutil.copytree(saved, run / "checkpoints" / saved.name)
    rows: list = []
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        t = _one_process(W.dropout_model(), run, step_fn=W.recording_step(rows),
                         resume=str(run / "checkpoints" / saved.name))
    return said.getvalue(), rows, t.global_step


def _once(steps: list) -> bool:
    return sorted(i for s in steps for i in s) == list(range(W.N_TRAIN))


def test_a_mid_epoch_checkpoint_of_two_ranks_resumes_in_one_process_with_the_next_sample(two_to_one, one_process):
    """docs/scaling-out.md: a checkpoint records how many samples of the epoch's order were used (16: 2 of epoch 2's
    12 steps of 8). Two ranks stopped at step 14, resumed by one process at batch 8: it goes on with epoch 2's third
    global batch, in the uninterrupted run's order, to the run's end (step 24): with the two steps before the
    checkpoint, every one of the 93 samples once."""
    said, rows, step = two_to_one
    assert "resuming at the start of epoch" not in said
    epoch2, got = _order([one_process[1]], after=12), _order([rows])
    assert got == epoch2[2:] and step == 24
    assert _once(epoch2[:2] + got)


def test_a_mid_epoch_checkpoint_of_one_process_resumes_on_two_ranks_with_the_next_sample(worlds, one_process):
    """The reverse: one process at batch 8 stopped at step 14, resumed by two ranks of 4: the ranks together go on
    with epoch 2's third global batch, in order, to step 24."""
    out, results, reports = worlds
    assert "resuming at the start of epoch" not in results[0].stdout
    epoch2, got = _order([one_process[1]], after=12), _order([r["rows"] for r in reports])
    assert got == epoch2[2:] and {r["step"] for r in reports} == {24}
    assert _once(epoch2[:2] + got)
