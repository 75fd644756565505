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
    wide = torch.zeros(4, Metric.QUEUE_LIMIT[1] // 3), torch.zeros(4, dtype=torch.long)
    for _ in range(3):
        big.feed(*wide)
        assert len(big._queue) <= 1  # 4 × elements/3 is past the element limit: held at most once
    assert big.compute() == 1.0


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

    assert not LastBatch.batchable and Counted.batchable
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
