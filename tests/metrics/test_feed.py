"""``Metric.feed``: batchable metrics queue CPU batches and update once on their concatenation; the totals
are exactly those of one ``update`` per batch, and nothing about errors or states changes."""

from __future__ import annotations

import pytest
import torch

from torchrig.metrics import Accuracy, Metric, MetricError, get_metric

BATCHABLE = ["accuracy", "top3", "f1", "precision_weighted", "recall"]


def _batches(n_batches=23, c=5, seed=0, tokens=False):
    """Random (output, target) batches of varying sizes (the last one short), as a loader gives."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        n = 16 if i < n_batches - 1 else 5
        if tokens:  # (B, C, T) logits, (B, T) labels with ignored positions
            target = torch.randint(0, c, (n, 7), generator=g)
            target[torch.rand(n, 7, generator=g) < 0.3] = -100
            out.append((torch.randn(n, c, 7, generator=g), target))
        else:
            out.append((torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)))
    return out


def _states(m: Metric) -> dict:
    return {k: v.clone() for k, v in m.states.items()}


# top-k takes (batch, classes) scores only
@pytest.mark.parametrize("name, tokens", [(n, False) for n in BATCHABLE]
                         + [(n, True) for n in BATCHABLE if not n.startswith("top")])
def test_fed_equals_updated_bitwise(name, tokens):
    fed, updated = get_metric(name), get_metric(name)
    assert fed.batchable
    queued = 0
    for output, target in _batches(tokens=tokens):
        fed.feed(output, target)
        updated.update(output, target)
        queued = max(queued, len(fed._queue))
    assert queued > 10  # the batches really waited (the comparison is not between two immediate updates)
    a, b = _states(fed), _states(updated)
    assert not fed._queue and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert fed.compute() == updated.compute()


def test_single_logit_binary_targets():
    g = torch.Generator().manual_seed(1)
    fed, updated = Accuracy(), Accuracy()
    for _ in range(9):
        out, y = torch.randn(8, 1, generator=g), torch.randint(0, 2, (8, 1), generator=g).float()
        fed.feed(out, y)
        updated.update(out, y)
    assert fed.compute() == updated.compute()


def test_every_reader_sees_the_queued_batches():
    m = Accuracy()
    batches = _batches(n_batches=6)
    for output, target in batches:
        m.feed(output, target)
    assert len(m._queue) == 5  # the first batch was updated at once
    assert m.compute() == pytest.approx(
        sum(int((o.argmax(1) == t).sum()) for o, t in batches) / sum(len(t) for _, t in batches))
    m.feed(*batches[0])
    m.reset()
    assert not m._queue and not m.states


def test_queue_limits():
    m = Accuracy()
    n, _ = Metric.QUEUE_LIMIT
    for output, target in _batches(n_batches=n + 10):
        m.feed(output, target)
        assert len(m._queue) < n
    big = Accuracy()
    wide = torch.zeros(4, Metric.FEED_LIMIT // 8), torch.zeros(4, dtype=torch.long)  # FEED_LIMIT / 2 elements
    most = Metric.QUEUE_LIMIT[1] // (Metric.FEED_LIMIT // 2)
    for _ in range(most + 5):
        big.feed(*wide)
        assert len(big._queue) < most  # the element limit folds the queue before the batch limit does
    assert big.compute() == 1.0
    huge = Accuracy()
    for _ in range(3):
        huge.feed(torch.zeros(4, Metric.FEED_LIMIT), torch.zeros(4, dtype=torch.long))  # too big to copy
        assert not huge._queue
    assert huge.compute() == 1.0


def test_what_is_queued_is_a_copy():
    """A loader or a model may reuse its buffers: a queued batch must not change with them."""
    m, updated = Accuracy(), Accuracy()
    batches = [(o, t) for o, t in _batches(n_batches=5) if len(t) == 16]
    output, target = torch.empty_like(batches[0][0]), torch.empty_like(batches[0][1])
    for o, t in batches:
        output.copy_(o)
        target.copy_(t)  # the same tensors, filled in place each batch
        m.feed(output, target)
        updated.update(o, t)
    assert m.states["correct"] == updated.states["correct"]


def test_a_bad_first_batch_fails_at_once_and_a_later_one_with_its_own_shapes():
    m = Accuracy()
    with pytest.raises(MetricError, match=r"shape \(16,\) do not match targets of shape \(15,\)"):
        m.feed(torch.randn(16, 3), torch.zeros(15, dtype=torch.long))
    m = Accuracy()
    for output, target in _batches(n_batches=3, c=3):
        m.feed(output, target)
    m.feed(torch.randn(16, 3), torch.zeros(15, dtype=torch.long))  # queued: reported when the states are read
    with pytest.raises(MetricError, match=r"shape \(16,\) do not match targets of shape \(15,\)"):
        m.compute()


def test_a_subclass_with_its_own_update_is_updated_at_once():
    calls = []

    class LastBatch(Accuracy):  # keeps only the last batch: concatenating batches would change it
        def update(self, output, target):
            calls.append(len(target))
            self.states = {}
            super().update(output, target)

    class Counted(Accuracy):  # says its update may be batched
        batchable = True

        def update(self, output, target):
            calls.append(len(target))
            super().update(output, target)

    class LastBatchMixin:
        def update(self, output, target):
            calls.append(len(target))
            self.states = {}
            Accuracy.update(self, output, target)

    class Mixed(LastBatchMixin, Accuracy):  # the mixin's update is the one used: Accuracy's flag does not cover it
        pass

    class Inherits(Accuracy):  # Accuracy's own update
        pass

    assert not LastBatch.batchable and Counted.batchable and not Mixed.batchable and Inherits.batchable
    m = Mixed()
    for output, target in _batches(n_batches=4):
        m.feed(output, target)
    assert calls == [16, 16, 16, 5] and not m._queue
    calls.clear()
    m = LastBatch()
    for output, target in _batches(n_batches=4):
        m.feed(output, target)
    assert calls == [16, 16, 16, 5] and not m._queue
    calls.clear()
    m = Counted()
    for output, target in _batches(n_batches=4):
        m.feed(output, target)
    m.compute()
    assert calls == [16, 16 * 2 + 5]


def test_no_accelerator_tensor_is_held():
    m = Accuracy()
    out, y = torch.randn(4, 3, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    for _ in range(3):
        m.feed(out, y)
        assert not m._queue


def test_fed_in_inference_mode_and_read_outside():
    """Evaluation feeds inference tensors; the queued update runs as they were fed."""
    m, updated = Accuracy(), Accuracy()
    with torch.inference_mode():
        for output, target in _batches(n_batches=5):
            m.feed(output, target)
            updated.update(output, target)
    assert m.compute() == updated.compute()


def test_a_normal_tensor_fed_in_inference_mode_is_folded_in_inference_mode():
    """In evaluation a model may return a view of a normal tensor (a parameter expanded over the batch): the
    queued update runs in the mode it was fed in, where the inference-tensor states may be updated."""
    scores, target = torch.randn(8, 3), torch.randint(0, 3, (8,))
    m, updated = Accuracy(), Accuracy()
    with torch.inference_mode():
        for output in (scores * 1, scores[:], scores * 1):  # an inference tensor, a normal view, …
            m.feed(output, target)
            updated.update(output, target)
    assert m.compute() == updated.compute()
    m.reset()
    m.feed(scores, target)
    with torch.inference_mode():  # a change of mode folds what was queued in the other mode first
        m.feed(scores * 1, target)
    m.feed(scores, target)
    assert m.states["total"] == 24


def test_evaluate_a_model_whose_output_is_a_view_of_a_parameter(tmp_path):
    import torchrig
    from torch import nn
    from torch.utils.data import TensorDataset

    class Prior(nn.Module):  # learnt class scores, the same for every sample
        def __init__(self):
            super().__init__()
            self.logits = nn.Parameter(torch.tensor([0.1, 0.5, -0.2]))

        def forward(self, x):
            return self.logits.expand(x.shape[0], -1)

    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(0))
    t = torchrig.Trainer(Prior(), epochs=1, batch_size=8, run_dir=str(tmp_path), metrics=["accuracy"],
                         plot=False, tensorboard=False, progress="none")
    assert t.evaluate(TensorDataset(x, y))["accuracy"] == (y == 1).float().mean().item()


def test_an_owned_target_is_queued_without_a_copy_and_the_output_always_copied():
    """The forward's output is never kept (autograd frees it in backward); a target made for the step is."""
    m, updated = Accuracy(), Accuracy()
    batches = _batches(n_batches=6)
    for o, t in batches:
        m.feed(o, t, owned=True)
        updated.update(o, t)
    assert m._queue[-1][0].data_ptr() != batches[-1][0].data_ptr() and m._queue[-1][1] is batches[-1][1]
    assert _states(m) == _states(updated)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_class_metrics_read_low_precision_scores_as_float32_ones(dtype):
    """Accuracy, top-k and F1 are given a bf16 / fp16 prediction as it is (no float32 copy of an LM's logits): the
    same counts as from its float32 cast."""
    from torchrig.metrics import get_metric

    g = torch.Generator().manual_seed(0)
    out = torch.randn(64, 7, generator=g).to(dtype)
    out[::5, 3] = out[::5, 1]  # ties: the first index wins in either dtype
    y = torch.randint(0, 7, (64,), generator=g)
    for name in ("accuracy", "top3", "f1", "mse"):
        a, b = get_metric(name), get_metric(name)
        target = y if name != "mse" else torch.randn(64, 7, generator=g)
        a.update(out, target)
        b.update(out.float(), target)
        assert a.float32_scores is False and a.compute() == b.compute(), name


def _train_accuracy(model, loader, lr=0.5):
    """Per-step train accuracy of a hand loop: the predictions each step makes before its update."""
    from torch.nn import functional as F

    opt, correct, total = torch.optim.SGD(model.parameters(), lr=lr), 0, 0
    for x, y in loader:
        out = model(x)
        correct += int((out.argmax(dim=1) == y).sum())
        total += len(y)
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()
    return correct / total


class _Prior(torch.nn.Module):
    """Learnt class scores, the same for every sample: its output is a view of its parameter."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor([0.3, 0.0, -0.3]))

    def forward(self, x):
        return self.logits.expand(x.shape[0], -1)


class _FilledBuffer(torch.nn.Module):
    """A model that fills the same output buffer on every forward (a preallocated workspace)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("out", torch.zeros(8, 3), persistent=False)

    def forward(self, x):
        return self.out.detach_().copy_(self.lin(x))


def _reusing_collate():
    """A collate function that fills the same two tensors for every batch."""
    buffers = {}

    def collate(samples):
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        if x.shape not in buffers:
            buffers[x.shape] = torch.empty_like(x), torch.empty_like(y)
        bx, by = buffers[x.shape]
        return [bx.copy_(x), by.copy_(y)]
    return collate


@pytest.mark.parametrize("case", ["output_a_view_of_a_parameter", "output_a_buffer_filled_in_place",
                                  "a_collate_that_reuses_its_buffers"])
def test_training_metrics_are_exact_when_the_model_or_the_loader_reuses_memory(case, tmp_path):
    """Training queues a batch uncopied only when the loop made it and this forward computed the output;
    here one or the other changes after the step, and the train accuracy is still the hand loop's."""
    import json

    import torchrig
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 4, generator=g), torch.randint(0, 3, (96,), generator=g)
    collate = _reusing_collate() if case == "a_collate_that_reuses_its_buffers" else None

    def model():
        torch.manual_seed(0)
        return {"output_a_view_of_a_parameter": _Prior, "output_a_buffer_filled_in_place": _FilledBuffer}.get(
            case, lambda: torch.nn.Linear(4, 3))()

    def loader():
        return DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=collate)

    expected = _train_accuracy(model(), loader())
    m = model()
    t = torchrig.Trainer(m, torch.optim.SGD(m.parameters(), lr=0.5), epochs=1, run_dir=str(tmp_path),
                         metrics=["accuracy"], plot=False, tensorboard=False, progress="none", num_workers=0)
    t.fit(loader())
    row = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["train/accuracy"] == expected
