"""Parity you can check: a hand-written loop and ``Trainer`` give bitwise-equal weights (fp32, CPU).

The same model, data order (the permutation of ``(seed, epoch)``, rank ``r`` of ``W`` taking samples
``r, r+W, …``) and optimizer, in one process and in a two-rank DDP group over gloo. The two-rank pair
also checks that the ranks agree when only one of them meets a NaN, and that every tensor torchrig
all-reduces after a mid-epoch resume lives on the run's device.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch
from helpers import QUIET, dist_procs
from torch import nn
from torch.utils.data import TensorDataset

import torchrig

from helpers import parity_worker as W


def _hand_loop_one_process(model: nn.Module, x, y, accumulate: int = 1, batch: int = W.BATCH) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=W.LR, momentum=0.9)
    for epoch in range(W.EPOCHS):
        order = W.epoch_order(epoch)
        batches = [order[s:s + batch] for s in range(0, len(order), batch)]
        for i, idx in enumerate(batches):
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                opt.step()
                opt.zero_grad(set_to_none=True)


# batch 7 leaves a short last batch of 6 in each epoch of 48 samples: the hand loop's mean over those 6
# is what the Trainer's step applies too, bitwise (fast path and DataLoader path)
@pytest.mark.parametrize("accumulate, batch, fast_path", [(1, W.BATCH, True), (2, W.BATCH, True),
                                                          (1, 7, True), (1, 7, False)])
def test_one_process_matches_the_hand_written_loop(tmp_path, accumulate, batch, fast_path):
    x, y = W.make_data()
    hand = W.make_model()
    _hand_loop_one_process(hand, x, y, accumulate, batch)
    model = W.make_model()
    trainer = torchrig.Trainer(model, "sgd", lr=W.LR, momentum=0.9, epochs=W.EPOCHS, batch_size=batch,
                               seed=W.SEED, accumulate=accumulate, num_workers=0, **QUIET, run_dir=str(tmp_path),
                               metrics=["accuracy"], checkpoint={"every_epochs": 0, "save_final": False},
                               fast_path=fast_path)
    trainer.fit(TensorDataset(x, y))
    assert trainer.global_step == W.EPOCHS * math.ceil(math.ceil(W.N / batch) / accumulate)
    for (name, a), b in zip(model.state_dict().items(), hand.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs by {(a - b).abs().max():.3g}"


def test_parity_is_not_vacuous():
    """One step of a different learning rate changes the weights: bitwise equality means something."""
    x, y = W.make_data()
    a, b = W.make_model(), W.make_model()
    _hand_loop_one_process(a, x, y)
    b_copy = copy.deepcopy(b)
    opt = torch.optim.SGD(b.parameters(), lr=W.LR * 1.001, momentum=0.9)
    nn.functional.cross_entropy(b(x[:W.BATCH]), y[:W.BATCH]).backward()
    opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(b.parameters(), b_copy.parameters()))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    init = f"file://{out / 'store'}"
    cmds = [[sys.executable, str(W.__file__), str(rank), init, str(out)] for rank in (0, 1)]
    results = dist_procs.run_many(cmds, timeout=120, logs=out)
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
    return out, [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_two_rank_ddp_matches_the_hand_written_ddp_loop(pair):
    out, ranks = pair
    weights = torch.load(out / "parity.pt", weights_only=True)
    assert ranks[0]["parity_steps"] == W.EPOCHS * -(-(W.N // 2) // W.BATCH)
    for name, a in weights["trainer"].items():
        assert torch.equal(a, weights["hand"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["input", "loss"])
def test_nan_on_one_rank_keeps_the_ranks_equal(pair, kind):
    _, ranks = pair
    r0, r1 = (r[f"skip_{kind}"] for r in ranks)
    assert r0["checksums"][0] == r0["checksums"][1] == r1["checksums"][0]  # the same weights everywhere
    assert r0["step"] == r1["step"] and r0["skipped"] == r1["skipped"]
    # NaN gradients (all-reduced) skip the window on both ranks; a NaN loss with finite gradients skips none
    assert r0["skipped"] == (1 if kind == "input" else 0)


@pytest.mark.slow
def test_nan_on_one_rank_raises_on_both(pair):
    _, ranks = pair
    for r in ranks:  # micro-batch 3 of rank 1 held the NaN: optimizer step 3 on both ranks
        assert r["error"].startswith("gradients are not finite") and "optimizer step 3 " in r["error"], r["error"]
    assert "(the loss is)" in ranks[0]["error"] and "(this process's loss is not finite)" in ranks[1]["error"]


@pytest.mark.slow
def test_all_reduced_states_live_on_the_run_device(pair):
    _, ranks = pair
    for r in ranks:
        assert r["reductions"] > 0 and r["devices"] == [r["device"]]
        assert r["score"] == pytest.approx(0.5) and r["resumed_step"] > 3
