"""Checkpoints across layouts (tp=2, one process, DDP, dp_shard=2 × tp=2) and loss parallelism.

Real gloo process groups on the CPU (tests/helpers/layouts_worker.py): one pair of processes for the runs that
need two, one group of four for FSDP2 × TP, one pair for DDP after it; the one-process runs here.
"""

from __future__ import annotations

import json

import pytest
import torch

import torchrig

from helpers import dist_procs
from helpers import layouts_worker as L
from helpers import parallel_worker as W

WORKER = dist_procs.HELPERS / "layouts_worker.py"


worst = dist_procs.worst


def group(scenario: str, out, n: int) -> None:
    dist_procs.group_ok(scenario, out, n, WORKER)


def fit_one(make_model, data, run_dir, capsys=None, **kw):
    t = torchrig.Trainer(W.build(make_model), **W.settings(run_dir, **kw))
    t.fit(data)
    return t


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process run that the pair resumes at tp=2, then the pair, the four and the DDP pair after them."""
    out = tmp_path_factory.mktemp("layouts")
    t = fit_one(W.Block, L.blocks(), out / "one", **L.EVERY)
    torch.save(W.params(t.model), out / "one-whole.pt")
    group("pair", out, 2)
    group("fsdp_tp", out, 4)
    group("to_ddp", out, 2)
    return out


@pytest.mark.slow
def test_tp2_checkpoint_resumes_in_one_process_within_1e_6(runs, tmp_path, capsys):
    """Stopped mid-epoch (step 7 of 10) at tp=2, resumed in one process: the run ends within 1e-6 of the
    uninterrupted tp=2 run; model and optimizer state resharded by DCP, the data position and counters kept, and
    the start says so in one line."""
    ckpt = runs / "tp" / "checkpoints" / "step-00000007"
    t = fit_one(W.Block, L.blocks(), tmp_path / "resumed", resume=str(ckpt), epochs=2)
    assert t.global_step == 20
    gap = worst(W.params(t.model), torch.load(runs / "tp-whole.pt"))
    assert gap < 1e-6, f"tp=2 → one process: {gap:.3g} from the uninterrupted tp=2 run"
    said = [line for line in capsys.readouterr().out.splitlines() if "resumed a" in line]
    assert said == ["torchrig: resumed a checkpoint saved at tp=2 (step-00000007) in one process: model and optimizer "
                    "state resharded, step counters and the data position kept; equal to the run in its saved "
                    "layout up to float rounding, not bitwise"]


@pytest.mark.slow
def test_one_process_checkpoint_resumes_at_tp2(runs):
    """A one-process checkpoint (weights and AdamW moments by position) resumed at tp=2 ends where the
    uninterrupted one-process run ends, within tensor parallelism's 1e-5."""
    got, steps = torch.load(runs / "one-to-tp.pt")
    assert steps == 20
    assert worst(got, torch.load(runs / "one-whole.pt")) < 1e-5


@pytest.mark.slow
def test_ddp_and_fsdp_tp_checkpoints_load_into_each_other_and_one_process(runs, tmp_path):
    """DDP (2 processes) step 7 → dp_shard=2 × tp=2 (4 processes) → its step 14 → DDP, and → one process: each
    ends within 1e-5 of the uninterrupted DDP run (the same global batch of 8 throughout)."""
    whole = torch.load(runs / "ddp-whole.pt")
    for name in ("ddp-to-fsdp_tp", "fsdp_tp-to-ddp"):
        got, steps = torch.load(runs / f"{name}.pt")
        assert steps == 20 and worst(got, whole) < 1e-5, name
    ckpt = runs / "fsdp_tp" / "checkpoints" / "step-00000014"
    assert (ckpt / "sharded" / ".metadata").is_file()
    t = fit_one(W.TokenBlock, L.tokens(2), tmp_path / "one", loss=W.token_loss, batch_size=8, epochs=2,
                resume=str(ckpt))
    assert t.global_step == 20 and worst(W.params(t.model), whole) < 1e-5


@pytest.mark.slow
def test_a_checkpoint_of_other_shapes_is_one_line_naming_the_parameter(runs, tmp_path):
    """A tp=2 checkpoint of a block 16 wide into one 32 wide: one line naming the first parameter and both
    whole shapes, before anything is loaded."""
    ckpt = runs / "tp" / "checkpoints" / "step-00000007"
    t = torchrig.Trainer(W.build(lambda: W.Block(dim=32)), **W.settings(tmp_path / "wide", resume=str(ckpt),
                                                                       epochs=2, resume_changes="allow"))
    with pytest.raises(torchrig.checkpoint.CheckpointError) as err:
        t.fit(L.blocks())
    assert str(err.value) == (f"checkpoint '{ckpt}' does not fit the model: parameter 'attn.k.weight' has shape "
                              f"(16, 16) in the checkpoint and (32, 32) in the model; was it saved from a different "
                              f"model or config?")


@pytest.mark.slow
def test_loss_parallel_matches_one_process_and_halves_the_logits(runs, tmp_path):
    """tp=2 with the output layer split by class (colwise_loss_parallel) and loss_parallel on (auto, for
    cross_entropy): 20 AdamW steps within 1e-5 of one process, and each rank holds half of the logits."""
    seen = json.loads((runs / "lp.json").read_text())
    assert seen["on"] is True
    captured = []
    model = W.build(L.VocabBlock)
    model.head.register_forward_hook(lambda m, a, out: captured.append(out.untyped_storage().nbytes()))
    t = torchrig.Trainer(model, **W.settings(tmp_path / "one-lp", loss="cross_entropy", metrics=["accuracy"]))
    t.fit(L.vocab_data(W.BATCH * W.STEPS))
    assert worst(W.params(t.model), torch.load(runs / "lp.pt")) < 1e-5
    assert seen["bytes"] * 2 == captured[0] == W.BATCH * L.VOCAB * 4
    assert abs(seen["accuracy"] - t.evaluate(L.vocab_data(16))["accuracy"]) < 1e-6


def test_the_layout_may_change_on_resume_and_the_global_batch_counts_data_parallel_ranks():
    """parallel.* layout keys pass a resume without resume_changes=allow; data.batch_size is per data-parallel
    rank (tensor-parallel ranks share their samples), so 4 per rank at dp_shard=2 × tp=2 is 8 in one process."""
    from torchrig.trainer import changes, saving

    saved = {"parallel": {"tp": 2, "dp_shard": 2, "tp_plan": {"attn.q": "colwise"}, "loss_parallel": True,
                          "pp_schedule": "1f1b"},
             "data": {"batch_size": 4}}
    now = {"parallel": {"tp": 1, "dp_shard": "auto", "tp_plan": None, "loss_parallel": "auto"}, "data": {"batch_size": 8}}
    meta = {"world_size": 4, "layout": {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1, "world_size": 4}}
    dp = saving.data_parallel(saving.layout_of(meta), 4)
    assert dp == 2 and changes.changed(saved, now, (dp, 1)) == ([], [])
    assert changes.changed(saved, now, (4, 1))[0] == [("data.batch_size", 4, 8, " (global batch 16 → 8 over 4 → 1 "
                                                                              "data-parallel ranks)")]
    # the same 32 per process on 1 instead of 2: the global batch halves, so it is no exact resume
    assert changes.changed({"data": {"batch_size": 32}}, {"data": {"batch_size": 32}}, (2, 1))[0] == [
        ("data.batch_size", 32, 32, " (global batch 64 → 32 over 2 → 1 data-parallel ranks)")]
    assert changes.changed({"data": {"batch_size": 32}}, {"data": {"batch_size": 32}}, (2, 2)) == ([], [])
    assert saving.data_parallel(saving.layout_of({"world_size": 3}), 1) == 3  # saved before layouts were recorded
    assert [saving.describe_layout(saving.layout_of({"world_size": w, "layout": d})) for w, d in [
        (4, meta["layout"]), (2, {"dp_replicate": 2, "world_size": 2}), (1, {"world_size": 1})]] == [
        "at dp_shard=2 × tp=2", "under DDP on 2 processes", "in one process"]


def test_a_plain_optimizer_state_of_other_groups_is_refused_before_anything_loads():
    """An optimizer saved with two parameter groups does not go into one with one group: the state is keyed by
    position within each group, so it would land on the wrong parameters."""
    from torchrig.checkpoint.sharded import load_full_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    saved_opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    model(torch.randn(3, 4)).sum().backward()
    saved_opt.step()
    opt = torch.optim.AdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter groups of \[2, 2\] parameters, this run's \[4\]"):
        load_full_optimizer(model, opt, saved_opt.state_dict())
    assert not opt.state and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_two_trainers_in_one_process_each_reduce_over_their_own_ranks(tmp_path):
    """A DDP Trainer and a tp=2 Trainer made one after the other in the same two processes (a notebook, lr-find
    then fit): the layout's process groups are handed to what reduces, never kept process-wide, so the first one's
    evaluation still sums both ranks' shards after the second one built a mesh, and the second counts each sample
    once. Every evaluation equals plain PyTorch's on all 93 samples, on both ranks."""
    out = tmp_path / "out"
    for r in dist_procs.pair("two_layouts", out, tmp_path / "store", timeout=300,
                             worker=dist_procs.HELPERS / "world_worker.py"):
        assert r.returncode == 0, r.output[-3000:]
    ranks = [json.loads((out / f"two_layouts-{rank}.json").read_text()) for rank in (0, 1)]
    for found in ranks:
        assert (found["ddp"]["dp"], found["tp"]["dp"]) == (2, 1)
        for name in ("ddp", "tp", "ddp_again"):
            got, want = found[name]["got"], found[name]["want"]
            assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6), name
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), name
    assert ranks[0] == ranks[1]
