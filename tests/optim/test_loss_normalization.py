"""A step's loss is the mean over the samples (or valid tokens) of its whole global batch.

Sizes here never divide evenly: a short last micro-batch must weigh by its samples, two ranks must
equal one process with no sample used twice, and padded sequences must weigh by their valid tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import dist_procs
from helpers import lossnorm_worker as W

ATOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _fit(make_model, data, run_dir, **kw):
    from torchrig import Trainer

    with Trainer(make_model(), **W.settings(run_dir, **kw)) as t:
        t.fit(data)
        return W.params(t.model), t.history


def _custom_step(step, batch):
    """A step function that calls step.backward(loss) without a count: the batch's samples are used."""
    x, y = batch
    with step.autocast():
        loss = torch.nn.functional.cross_entropy(step.model(x), y)
    step.backward(loss)
    step.optimizer_step()
    return {"loss": loss.detach()}


@pytest.mark.parametrize("step_fn", [None, _custom_step], ids=["default_step", "custom_step"])
def test_uneven_accumulation_equals_one_batch(tmp_path, step_fn):
    data = W.classification(38)  # micro-batches of 4: windows of 16, 16 and 6 samples (4 + 2)
    big, big_hist = _fit(W.mlp, data, tmp_path / "big", batch_size=16)
    acc, acc_hist = _fit(W.mlp, data, tmp_path / "acc", batch_size=4, accumulate=4, step_fn=step_fn)
    assert _max_diff(acc, big) < ATOL
    # the logged loss is a per-sample mean too: the epoch means agree
    for a, b in zip(acc_hist, big_hist):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    # dividing by the number of micro-batches weighs the last 2 samples as much as 4: visibly different
    per_micro, _ = _fit(W.mlp, data, tmp_path / "micro", batch_size=4, accumulate=4, step_fn=step_fn,
                        loss_normalization="micro_batches")
    assert _max_diff(per_micro, big) > 1e-3


def test_padded_sequences_weigh_by_valid_tokens(tmp_path):
    pytest.importorskip("transformers")
    data = W.Sequences(22)  # micro-batches of 3: windows of 12 and 10 sequences, 2 to 12 tokens each
    big, _ = _fit(W.gpt2, data, tmp_path / "big", batch_size=12, loss=W.next_token_loss)
    acc, _ = _fit(W.gpt2, data, tmp_path / "acc", batch_size=3, accumulate=4, loss=W.next_token_loss)
    assert _max_diff(acc, big) < ATOL
    # the model's own loss (loss="auto": GPT-2 given labels) is a token mean too, and counted as such
    own_big, _ = _fit(W.gpt2, data, tmp_path / "own_big", batch_size=12)
    own_acc, _ = _fit(W.gpt2, data, tmp_path / "own_acc", batch_size=3, accumulate=4)
    assert _max_diff(own_acc, own_big) < ATOL
    assert _max_diff(own_big, big) < ATOL  # the same mathematics as the hand-written token loss
    samples, _ = _fit(W.gpt2, data, tmp_path / "samples", batch_size=3, accumulate=4, loss=W.next_token_loss,
                      loss_normalization="samples")  # a short sequence would weigh as much as a long one
    assert _max_diff(samples, big) > 1e-4


def test_token_counts_follow_the_causal_shift():
    pytest.importorskip("transformers")
    from torchrig.optim import normalize

    labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    assert normalize.shifts_labels(W.gpt2()) and not normalize.shifts_labels(W.mlp())
    assert int(normalize.count_items("auto", labels, 2, shift=True)) == 3  # position 0 is never predicted
    assert int(normalize.count_items("auto", labels, 2, shift=False)) == 5
    assert normalize.count_items("auto", torch.tensor([1, 2]), 2, shift=False) == 2  # class labels: samples
    with pytest.raises(ValueError, match="loss_normalization=tokens needs a tensor target"):
        normalize.count_items("tokens", None, 2, shift=False)


def test_a_step_without_a_count_counts_the_target_under_data_label_key(tmp_path):
    """``step.backward(loss)`` without a count takes the batch's target where ``data.label_key`` says."""
    from torch import nn

    from torchrig import Trainer

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 3)

        def forward(self, ids):
            return self.emb(ids)

    ids = torch.randint(0, 10, (4, 5))
    tags = torch.randint(0, 3, (4, 5)).masked_fill(torch.arange(5) >= 3, -100)  # 3 valid tokens a row
    data = [{"ids": ids[i], "tags": tags[i]} for i in range(4)]
    counts = []

    def step_fn(step, batch):
        counts.append(int(step.count_of()))
        inputs, target = step.split(batch)
        with step.autocast():
            loss = nn.functional.cross_entropy(step.forward(inputs).transpose(1, 2), target, ignore_index=-100)
        step.backward(loss)
        step.optimizer_step()
        return {"loss": loss.detach()}

    with Trainer(Tagger(), step_fn=step_fn, label_key="tags", **W.settings(tmp_path, epochs=1, batch_size=4)) as t:
        t.fit(data)
    assert counts == [12]  # the valid tokens of "tags", not the 4 samples of a batch with no "labels" key


def test_loss_normalization_is_validated(tmp_path):
    from torchrig import Trainer
    from torchrig.config import ConfigError

    with pytest.raises(ConfigError) as err:
        Trainer(W.mlp(), **W.settings(tmp_path, loss_normalization="batch"))
    assert str(err.value) == ("config key 'loss_normalization': expected one of auto, samples, tokens, "
                              "micro_batches, got 'batch'")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lossnorm")
    results = dist_procs.pair("ddp", out, out / "init-store", timeout=180,
                              worker=dist_procs.HELPERS / "lossnorm_worker.py")
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    return out, [json.loads((out / f"seen-{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(W.runs()))
def test_two_ranks_equal_one_process_with_double_batch(two_ranks, tmp_path, name):
    make_model, make_data, extra = W.runs()[name]
    if make_model is W.gpt2:
        pytest.importorskip("transformers")  # the MLP and FSDP runs do not need it
    out, _ = two_ranks
    one = dict(extra, batch_size=2 * extra["batch_size"])
    want, _ = _fit(make_model, make_data(), tmp_path, **one)
    assert _max_diff(torch.load(out / f"{name}.pt"), want) < ATOL


@pytest.mark.slow
def test_a_fused_head_on_two_ranks_equals_the_plain_head_in_one_process(two_ranks, tmp_path):
    """model.fused_head under DDP: the valid tokens (label smoothing, -100 padding) counted over both ranks and a window
    of two micro-batches give one process's plain head and loss with a batch twice as large."""
    out, _ = two_ranks
    want, _ = _fit(W.TokenLM, W.padded_tokens(), tmp_path, **dict(W.FUSED, batch_size=6))
    assert _max_diff(torch.load(out / "fused_head.pt"), want) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name,n", [("mlp37", 37), ("mlp33", 33), ("mlp37_acc", 37), ("fsdp33_clip", 33)])
def test_two_ranks_use_every_sample_once_per_epoch(two_ranks, name, n):
    _, seen = two_ranks
    for epoch in (0, 1):
        used = sorted(i for rank in seen for e, w, ids in rank[name] if e == epoch and w == 1 for i in ids)
        assert used == list(range(n))
    fillers = [(r, len(ids)) for r, rank in enumerate(seen) for e, w, ids in rank[name] if w == 0]
    batches = [sum(1 for row in rank[name]) for rank in seen]
    assert batches[0] == batches[1]  # every rank runs every step
    assert fillers == ([] if name == "mlp37" else [(1, 1), (1, 1)])  # one zero-weight sample per epoch


@pytest.mark.parametrize("clip", [False, True], ids=["scaler_step", "unscale_then_clip"])
def test_fp16_scaler_sees_the_global_batch_mean(clip):
    """Under a GradScaler the optimizer gets the mean over the window's samples (3 + 1), unscaled."""
    from torch import nn

    from torchrig.runtime.precision import Precision
    from torchrig.trainer.step import Step, StepOptions

    torch.manual_seed(0)
    model, x, y = nn.Linear(3, 1), torch.randn(4, 3), torch.randn(4, 1)
    want = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append([p.grad.clone() for p in model.parameters()]))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    step = Step(model, {"default": opt}, None, Precision("fp16", torch.device("cpu"), None, scaler),
                torch.device("cpu"), StepOptions(clip_grad_norm=1e6 if clip else None, loss_normalization="samples",
                                                 count_unit=3))
    step.begin_window(2)
    for rows, last in ((slice(0, 3), False), (slice(3, 4), True)):
        step.begin_micro_batch((x[rows], y[rows]), last=last)
        step.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
        step.optimizer_step()
    assert step.end_window() and len(seen) == 1
    assert max((g - w).abs().max().item() for g, w in zip(seen[0], want)) < ATOL


def test_gradients_of_a_backward_outside_the_step_are_left_alone():
    """A step function that calls loss.backward() itself keeps its own scaling: nothing was counted."""
    from torch import nn

    from torchrig.runtime.precision import Precision
    from torchrig.trainer.step import Step, StepOptions

    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append(model.weight.grad.clone()))
    step = Step(model, {"default": opt}, None, Precision("fp32", torch.device("cpu"), None, None),
                torch.device("cpu"), StepOptions(count_unit=8))
    step.begin_window(1)
    step.begin_micro_batch((torch.ones(3, 2), torch.zeros(3)))
    model(torch.tensor([[3.0, 4.0]])).sum().backward()
    assert step.optimizer_step() and torch.equal(seen[0], torch.tensor([[3.0, 4.0]]))


def test_a_second_loss_with_its_own_count_weighs_count_over_the_batch_count(tmp_path):
    """In a window of one whole batch (no accumulation, one process) torchrig leaves a loss over the
    batch's own count as it is; a further loss given ``count=c`` still weighs ``c / batch count``."""
    x, y = W.classification(20)  # batches of 16 and 4: the short one weighs its own samples too

    def two_losses(step, batch):
        inputs, target = batch
        out = step.model(inputs)
        loss = torch.nn.functional.cross_entropy(out, target)
        step.backward(loss, retain_graph=True)
        step.backward((out ** 2).mean(), count=3)  # weighs 3 / (16 or 4) of the first loss
        step.optimizer_step()
        return {"loss": loss.detach()}

    got, _ = _fit(W.mlp, (x, y), tmp_path / "t", batch_size=16, shuffle=False, epochs=1, step_fn=two_losses)
    hand = W.mlp()
    opt = torch.optim.SGD(hand.parameters(), lr=0.2, momentum=0.9)  # torchrig's "sgd"
    for s in (slice(0, 16), slice(16, 20)):
        out = hand(x[s])
        n = out.shape[0]
        (torch.nn.functional.cross_entropy(out, y[s]) + (out ** 2).mean() * (3 / n)).backward()
        opt.step()
        opt.zero_grad()
    assert _max_diff(got, W.params(hand)) < ATOL


def _dropout_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(W.mlp(), torch.nn.Dropout(0.2))


def test_a_step_function_that_wraps_default_step_trains_as_default_step(tmp_path):
    """The step is never recognised by identity: a user's step function that calls ``default_step`` (to add a
    value to log) takes the same path and gets bitwise the same parameters and logs, with dropout, uneven windows
    (93 samples, 3 batches of 4 per step) and micro-batches cut from the loaded ones."""
    from torchrig.trainer.step import default_step

    def wrapped(step, batch):
        values = default_step(step, batch)
        return dict(values, extra=values["loss"] * 0)

    data = W.classification(93)
    for k, kw in enumerate(({"batch_size": 4, "accumulate": 3}, {"batch_size": 8, "micro_batch_size": 3})):
        plain, plain_hist = _fit(_dropout_mlp, data, tmp_path / f"plain{k}", **kw)
        mine, mine_hist = _fit(_dropout_mlp, data, tmp_path / f"mine{k}", step_fn=wrapped, **kw)
        assert all(torch.equal(plain[k], mine[k]) for k in plain)
        assert [h["train/loss"] for h in plain_hist] == [h["train/loss"] for h in mine_hist]


def test_counts_that_are_not_samples_are_summed_not_taken_from_the_sampler():
    """When the sampler knows a window's samples, the step uses that count only if every micro-batch was counted by
    its samples; a step function that counts otherwise (here 1 item for a batch of 3, 1 for a batch of 1) gets the
    mean over its own counts (2 items), not over the window's 4 samples."""
    from torch import nn

    from torchrig.runtime.precision import Precision
    from torchrig.trainer.step import Step, StepOptions

    torch.manual_seed(0)
    model, x, y = nn.Linear(3, 1), torch.randn(4, 3), torch.randn(4, 1)
    counts = ((slice(0, 3), 1), (slice(3, 4), 1))
    mse = torch.nn.functional.mse_loss
    want = torch.autograd.grad(sum(mse(model(x[r]), y[r]) * c for r, c in counts) / 2, list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append([p.grad.clone() for p in model.parameters()]))
    step = Step(model, {"default": opt}, None, Precision("fp32", torch.device("cpu"), None, None),
                torch.device("cpu"), StepOptions(loss_normalization="samples", count_unit=3))
    step.begin_window(2, samples=4)  # the sampler's count: 4 samples, which these counts do not add up to
    for (rows, count), last in zip(counts, (False, True)):
        step.begin_micro_batch((x[rows], y[rows]), last=last)
        step.backward(mse(model(x[rows]), y[rows]), count)
        step.optimizer_step()
    step.end_window()
    assert max((g - w).abs().max().item() for g, w in zip(seen[0], want)) < ATOL
