"""Throughput: FLOPs of Linear / Conv2d against the hand formula, samples/s, tokens/s, FLOP/s and MFU rows."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchrig
from helpers import QUIET, TinyNet, make_classification
from torchrig.observe.throughput import count_flops, peak_flops, rates, tokens_of


def fwd_bwd(model: nn.Module, x: torch.Tensor):
    return lambda: model(x).sum().backward()


def test_linear_flops_match_the_hand_formula():
    B, I, H, O = 4, 8, 16, 3
    _, flops = count_flops(fwd_bwd(nn.Linear(I, O), torch.randn(B, I)))
    # forward 2·B·I·O; backward: the weight's gradient only (the input needs none), 2·B·I·O again
    assert flops == 4 * B * I * O
    _, flops = count_flops(fwd_bwd(nn.Sequential(nn.Linear(I, H), nn.ReLU(), nn.Linear(H, O)), torch.randn(B, I)))
    # second layer: forward, weight gradient and input gradient (2·B·H·O each); first: forward + weight gradient
    assert flops == 4 * B * I * H + 6 * B * H * O


def test_conv2d_flops_match_the_hand_formula():
    B, C, K, k, S = 2, 3, 5, 3, 10
    conv = nn.Conv2d(C, K, k, padding=1)
    _, flops = count_flops(fwd_bwd(conv, torch.randn(B, C, S, S)))
    forward = 2 * B * K * S * S * C * k * k  # one multiply-add per output pixel, channel in and kernel tap
    assert flops == 2 * forward  # + the weight's gradient, as many


def read_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rows_carry_samples_per_s_and_with_log_flops_the_achieved_flop_rate(tmp_path, capsys):
    x, y = make_classification(32)
    torch.manual_seed(0)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path), batch_size=8, epochs=1, log_every=1, flops=True,
                               num_workers=0, **QUIET)
    trainer.fit(TensorDataset(x, y))
    rows = [r for r in read_rows(tmp_path) if r["kind"] == "interval"]
    assert len(rows) == 4 and all(r["samples_per_s"] > 0 for r in rows)
    per_sample = 4 * 8 * 16 + 6 * 16 * 4  # TinyNet 8 -> 16 -> 4, as in the Linear test
    for r in rows:
        assert r["flops_per_s"] == pytest.approx(per_sample * r["samples_per_s"])
        assert "mfu" not in r and "tokens_per_s" not in r  # CPU: no peak to compare with; no token data
    assert trainer.step_fn is not None and trainer.step_fn.__name__ == "default_step"  # the counter stepped aside
    assert f"torchrig: {per_sample} FLOPs per sample" in capsys.readouterr().err


class BagOfWords(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.EmbeddingBag(50, 8), nn.Linear(8, 2)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_token_batches_report_tokens_per_s(tmp_path):
    ids = torch.randint(0, 50, (16, 6))
    trainer = torchrig.Trainer(BagOfWords(), run_dir=str(tmp_path), batch_size=4, epochs=1, log_every=2,
                               num_workers=0, **QUIET)
    trainer.fit(TensorDataset(ids, torch.randint(0, 2, (16,))))
    rows = [r for r in read_rows(tmp_path) if r["kind"] == "interval"]
    assert rows and all(r["tokens_per_s"] == pytest.approx(6 * r["samples_per_s"]) for r in rows)


def test_tokens_of_counts_the_attention_mask_when_there_is_one():
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert int(tokens_of({"input_ids": ids, "attention_mask": mask})) == 8
    assert int(tokens_of((ids, mask, torch.zeros_like(ids), torch.zeros(2)))) == 8  # (ids, mask, types, label)
    assert tokens_of((ids, torch.zeros(2))) == 10  # no mask: every position
    assert tokens_of((torch.randn(2, 5), torch.zeros(2))) is None  # features, not token ids


def test_mfu_is_achieved_over_the_peak_of_every_process():
    row = rates(samples=100, tokens=None, elapsed=2.0, world_size=4, flops_per_sample=1e9, peak=1e12)
    assert row["samples_per_s"] == 200 and row["flops_per_s"] == 2e11
    assert row["mfu"] == pytest.approx(2e11 / 4e12)
    # parallel.cp=2: each rank of a pair counts the pair's 100 samples once, but half of their tokens and FLOPs
    split = rates(samples=100, tokens=500, elapsed=2.0, world_size=4, flops_per_sample=0.5e9, peak=1e12, cp=2)
    assert split["samples_per_s"] == 200 and split["tokens_per_s"] == 2000 and split["flops_per_s"] == 2e11
    assert split["mfu"] == pytest.approx(2e11 / 8e12)
    assert peak_flops(torch.device("cpu"), "bf16") is None


# Dense bf16 tensor-core peaks in TFLOP/s from NVIDIA's data sheets (their headline figures are with 2:4 sparsity,
# twice these), written here apart from torchrig's own table so that MFU is checked against the vendor's number:
# H100 SXM5 1979 sparse, H100 NVL 1671, H100 PCIe 1513, H200 / GH200 1979, A100 624, L4 242; the L40S sheet gives
# its dense figure, 362.05 (733 sparse).
VENDOR_BF16_TFLOPS = [("H100 NVL", 835.5), ("H100 PCIe", 756.0), ("H100", 989.4), ("GH200", 989.4),
                      ("H200", 989.4), ("A100", 312.0), ("L40S", 362.05), ("L4", 121.0)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mfu_is_the_hand_counted_flops_over_the_vendor_peak(tmp_path, monkeypatch, device):
    """MFU = FLOPs per sample by the hand formula × samples/s ÷ the card's dense bf16 peak from its data sheet.
    The CPU has no peak: there a stand-in peak of 1 TFLOP/s is given to the run, which checks the same arithmetic."""
    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        peak = next((tflops * 1e12 for key, tflops in VENDOR_BF16_TFLOPS if key in name), None)
        if peak is None:
            pytest.skip(f"no data-sheet peak written in this test for {name}")
    else:
        peak = 1e12
        monkeypatch.setattr("torchrig.observe.throughput.peak_flops", lambda dev, precision: peak)
    x, y = make_classification(64)
    torch.manual_seed(0)
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path), batch_size=16, epochs=1, log_every=1, flops=True,
                               precision="bf16", device=device, num_workers=0, **QUIET)
    trainer.fit(TensorDataset(x, y))
    rows = [r for r in read_rows(tmp_path) if r["kind"] == "interval"]
    # TinyNet 8 -> 16 -> 4: forward 2·8·16 + 2·16·4, the weights' gradients as many again, and the input
    # gradient of the second layer only (the batch needs none): 2·16·4
    per_sample = 4 * 8 * 16 + 6 * 16 * 4
    assert len(rows) == 4
    for r in rows:
        assert r["flops_per_s"] == pytest.approx(per_sample * r["samples_per_s"], rel=1e-9)
        assert r["mfu"] == pytest.approx(per_sample * r["samples_per_s"] / peak, rel=2e-3)  # rounded data sheets


@pytest.mark.parametrize("name,precision,tf32,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4), ("NVIDIA H100 NVL", "bf16", False, 835.5),
    ("NVIDIA H100 PCIe", "fp16", False, 756.0), ("NVIDIA H800", "bf16", False, 989.4),
    ("NVIDIA GH200 480GB", "bf16", False, 989.4), ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156.0), ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7),
    ("Tesla V100-SXM2-16GB", "fp32", True, 15.7), ("NVIDIA Mystery 9000", "bf16", False, None)])
def test_peak_by_device_name_and_tf32(monkeypatch, name, precision, tf32, expected):
    """The peak a GPU's MFU divides by: the NVL and H800 entries, and fp32 at TF32's peak when TF32 is on."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr("torchrig.observe.throughput.tf32_in_force", lambda: tf32)  # see the test below
    peak = peak_flops(torch.device("cuda"), precision)
    assert (peak is None and expected is None) or peak == pytest.approx(expected * 1e12)


def test_tf32_in_force_follows_the_new_and_the_legacy_switches():
    from torchrig.runtime.accel import tf32_in_force

    matmul = torch.backends.cuda.matmul
    before = (matmul.fp32_precision, torch.get_float32_matmul_precision())
    try:
        matmul.fp32_precision = "ieee"
        assert not tf32_in_force()
        matmul.fp32_precision = "tf32"
        assert tf32_in_force()
        torch.set_float32_matmul_precision("highest")
        assert not tf32_in_force()
        torch.set_float32_matmul_precision("high")
        assert tf32_in_force()
    finally:
        torch.set_float32_matmul_precision(before[1])
        matmul.fp32_precision = before[0]


def test_the_first_row_of_an_epoch_counts_only_its_own_samples(tmp_path, monkeypatch):
    """The interval clock restarts at an epoch's start, and so do the counts measured against it: the last
    epoch's tail (after its last row) must not inflate the next row's samples/s, nor its data wait."""
    from torchrig.observe import metrics_logger as L

    clock = [0.0]
    monkeypatch.setattr(L.time, "perf_counter", lambda: clock[0])

    class Tick:  # every micro-batch takes 1 s of the fake clock
        def on_step_end(self, trainer, values):
            clock[0] += 1.0

    x, y = make_classification(40)  # 5 steps of 8 per epoch; rows every 3 steps: at 3, 6 (epoch 2), 9
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path), batch_size=8, epochs=2, log_every=3,
                               num_workers=0, shuffle=False, callbacks=[Tick()], **QUIET)
    trainer.fit(TensorDataset(x, y))
    rows = {r["step"]: r for r in read_rows(tmp_path) if r["kind"] == "interval"}
    assert sorted(rows) == [3, 6, 9]
    # step 6 is the first step of epoch 2: one step (8 samples) in the 1 s since the epoch started
    assert rows[6]["samples_per_s"] == pytest.approx(8.0)
    assert all(r["samples_per_s"] == pytest.approx(8.0) for r in rows.values())
    assert all(0 <= r["data_wait"] <= 1 for r in rows.values())


def test_meta_count_equals_the_count_of_a_real_step():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    x = torch.randn(2, 3, 6, 6)
    from torchrig.observe.throughput import meta_flops

    _, real = count_flops(fwd_bwd(model, x))
    assert meta_flops(model, x) == real > 0
    assert all(p.grad is not None for p in model.parameters())  # only the real step's: meta left none behind


def test_data_parallel_flops_are_counted_although_its_replicas_run_in_threads(tmp_path, monkeypatch):
    """nn.DataParallel runs each replica's forward in a thread of its own, which FlopCounterMode (a per-thread
    mode) does not see; torchrig counts such a model on the meta device instead."""
    import threading

    def threaded_forward(self, *inputs, **kwargs):  # what DataParallel's parallel_apply does with the replicas
        out = []
        worker = threading.Thread(target=lambda: out.append(self.module(*inputs, **kwargs)))
        worker.start()
        worker.join()
        return out[0]

    monkeypatch.setattr(nn.DataParallel, "forward", threaded_forward)
    x, y = make_classification(32)

    def flops(dp: bool):
        torch.manual_seed(0)
        trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path / str(dp)), batch_size=8, epochs=1, log_every=1,
                                   flops=True, num_workers=0, **QUIET)
        if dp:
            trainer.wrapped = nn.DataParallel(trainer.wrapped)  # on the CPU: no devices, the module itself
        trainer.fit(TensorDataset(x, y))
        return trainer.metrics_log.flops_per_sample

    assert flops(True) == flops(False) == 4 * 8 * 16 + 6 * 16 * 4
