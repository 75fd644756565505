"""Capabilities 3 and 4: device selection, CPU threads, backends flags, precision."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from helpers import PYTHON, TinyNet, subprocess_env

from torchrig.config import ConfigError
from torchrig.runtime import RuntimeSetupError, configure_threads, make_precision, select_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")

THREADS_SCRIPT = """
import json, sys, torch, torchrig
seen = []
for kw in json.loads(sys.argv[1]):  # Trainers one after the other in a fresh process
    trainer = torchrig.Trainer(torch.nn.Linear(2, 2), run_dir=sys.argv[2], tensorboard=False, **kw)
    seen.append([trainer.threads, torch.get_num_threads(), torch.get_num_interop_threads()])
print(json.dumps(seen))
"""


def _threads(tmp_path, kws: list, **env) -> list:
    out = subprocess.run([PYTHON, "-c", THREADS_SCRIPT, json.dumps(kws), str(tmp_path)], env=subprocess_env(**env),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_torch_thread_num_and_threads_set_intra_and_inter_op_threads(tmp_path):
    # TORCH_THREAD_NUM sets both pools; then the `threads` key wins over it (inter-op threads can only be
    # set once per process, before parallel work, so they stay as first set)
    assert _threads(tmp_path, [{}, {"threads": 2}], TORCH_THREAD_NUM=3) == [[3, 3, 3], [2, 2, 3]]


@pytest.mark.slow
def test_interop_threads_key(tmp_path):
    import os

    n = (os.cpu_count() or 1) + 3  # not torch's default (the core count)
    # interop_threads alone sets the inter-op pool (intra-op stays at OMP_NUM_THREADS=1); a later Trainer's
    # `threads` cannot change the inter-op pool any more
    assert _threads(tmp_path, [{"interop_threads": n}, {"threads": 2}]) == [[1, 1, n], [2, 2, n]]


def test_threads_key_wins_over_the_environment(monkeypatch):
    # inter-op threads can be set once per process (checked in the subprocess above); intra-op here
    monkeypatch.setenv("TORCH_THREAD_NUM", "3")
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
        assert configure_threads(None) == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value,message", [
    ("abc", "TORCH_THREAD_NUM='abc' is not an integer; set it to a thread count like 4"),
    ("0", "TORCH_THREAD_NUM='0' must be at least 1"),
    ("-2", "TORCH_THREAD_NUM='-2' must be at least 1"),
])
def test_bad_torch_thread_num(monkeypatch, value, message, tmp_path):
    import torchrig

    monkeypatch.setenv("TORCH_THREAD_NUM", value)
    before = torch.get_num_threads()
    with pytest.raises(RuntimeSetupError) as err:
        configure_threads(None)
    assert message in str(err.value)
    with pytest.raises(RuntimeSetupError) as err:
        torchrig.Trainer(torch.nn.Linear(2, 2), run_dir=str(tmp_path), tensorboard=False)
    assert str(err.value) == message
    assert torch.get_num_threads() == before


def test_no_thread_setting_leaves_torch_alone(monkeypatch):
    monkeypatch.delenv("TORCH_THREAD_NUM", raising=False)
    before = torch.get_num_threads()
    assert configure_threads(None) == before


# ----------------------------------------------------------------------------- devices


def test_auto_and_cpu_devices():
    assert select_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    mps = getattr(torch.backends, "mps", None)
    if not torch.cuda.is_available() and mps is not None and mps.is_available():
        expected = "mps"
    assert select_device("auto").type == expected


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1", "CUDA"])
def test_cuda_without_cuda_is_explained(name):
    with pytest.raises(RuntimeSetupError) as err:
        select_device(name)
    msg = str(err.value)
    assert f"device '{name.lower()}' asked for, but CUDA is not available on this machine" in msg
    assert "use device=cpu" in msg


@no_cuda
def test_cuda_without_cuda_through_trainer(tmp_path):
    import torchrig

    with pytest.raises(RuntimeSetupError) as err:
        torchrig.Trainer(TinyNet(), device="cuda", run_dir=str(tmp_path))
    assert str(err.value).startswith(f"device 'cuda' asked for, but CUDA is not available on this machine (torch "
                                     f"{torch.__version__}: ")
    assert str(err.value).endswith("); use device=cpu or device=auto")


def test_unknown_device_name():
    with pytest.raises(RuntimeSetupError, match="device 'gpu' is not a device name; use auto, cpu, cuda, cuda:N or mps"):
        select_device("gpu")


@pytest.mark.skipif(getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
                    reason="MPS present")
def test_mps_without_mps():
    with pytest.raises(RuntimeSetupError, match="device 'mps' asked for, but MPS is not available on this machine"):
        select_device("mps")


@pytest.mark.gpu
def test_gpu_marked_tests_run_only_where_cuda_is():
    assert torch.cuda.is_available()  # fails on a CPU-only machine unless the marker skips it


@pytest.mark.gpu
def test_cuda_index_out_of_range():
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeSetupError, match=f"only {n} CUDA device"):
        select_device(f"cuda:{n}")


def test_deterministic_and_cudnn_flags(make_trainer):
    was_det = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_bench, was_cudnn_det = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    try:
        make_trainer(cudnn_benchmark=True)
        assert torch.backends.cudnn.benchmark is True
        make_trainer(deterministic=True, cudnn_benchmark=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(was_det, warn_only=was_warn)
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = was_bench, was_cudnn_det


# ----------------------------------------------------------------------------- precision


def test_bf16_autocast_trains_on_cpu(make_trainer, data):
    dtypes = []

    def step_fn(step, batch):
        from torchrig.trainer.step import default_step

        x, _ = batch
        with step.autocast():
            dtypes.append(step.model(x).dtype)
        return default_step(step, batch)

    trainer = make_trainer(precision="bf16", step_fn=step_fn, epochs=4, lr=0.2)
    assert trainer.precision.dtype is torch.bfloat16 and trainer.precision.scaler is None
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data)
    after = trainer.evaluate(data)["loss"]
    assert set(dtypes) == {torch.bfloat16}
    assert after < before
    assert all(p.dtype is torch.float32 for p in trainer.model.parameters())  # weights stay fp32
    probs = trainer.predict(data)
    assert probs.dtype is torch.float32 and torch.allclose(probs.sum(1), torch.ones(40), atol=1e-3)


def test_fp16_on_cpu_fails_clearly(tmp_path):
    import torchrig

    with pytest.raises(RuntimeSetupError) as err:
        make_precision("fp16", torch.device("cpu"))
    assert "precision 'fp16' needs a CUDA device (it uses a gradient scaler), but the device is cpu; " \
           "use precision=bf16 on CPU or fp32" in str(err.value)
    with pytest.raises(RuntimeSetupError, match="precision 'fp16' needs a CUDA device"):
        torchrig.Trainer(TinyNet(), precision="fp16", device="cpu", run_dir=str(tmp_path))


def test_unknown_precision(tmp_path):
    import torchrig

    with pytest.raises(RuntimeSetupError, match="precision 'fp8' is not one of fp32, bf16, fp16"):
        make_precision("fp8", torch.device("cpu"))
    with pytest.raises(ConfigError, match="config key 'precision': expected one of fp32, bf16, fp16, got 'fp8'"):
        torchrig.Trainer(TinyNet(), precision="fp8", run_dir=str(tmp_path))


@pytest.mark.parametrize("alias,name", [("bfloat16", "bf16"), ("float32", "fp32"), ("32", "fp32")])
def test_precision_aliases(alias, name):
    assert make_precision(alias, torch.device("cpu")).name == name


class InfGradAtThirdBatch(TinyNet):
    """TinyNet whose third forward's output gets an infinite gradient in backward: the overflow fp16 gradients
    meet, with a finite loss."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        out = super().forward(x)
        self.calls += 1
        if self.calls == 3:
            out.register_hook(lambda g: g * float("inf"))
        return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp16_scales_the_loss_unscales_the_update_and_backs_off_after_an_overflow(make_trainer, data, monkeypatch,
                                                                                   device):
    """precision=fp16 (a GradScaler): the gradient backward puts on a weight is the loss's gradient times the scale;
    the optimizer's update is that of the gradient divided back (SGD's first step: lr × the hand gradient); a window
    whose gradients overflow changes no weight and halves the scale. precision=fp16 needs CUDA; on the CPU the
    GradScaler torch has for it stands in (float16 autocast and a CPU scaler)."""
    import torchrig
    from helpers import fp16_precision

    if device == "cpu":
        monkeypatch.setattr(torchrig.runtime, "make_precision", lambda name, dev: fp16_precision(2.0 ** 16))
    torch.manual_seed(0)
    scales, weights = [], []

    class Watch:  # after each window: the scale it left and the head's weight
        def on_step_end(self, trainer, outputs):
            scales.append(trainer.precision.scaler.get_scale())
            weights.append(trainer.model.head.weight.detach().float().cpu().clone())

    trainer = make_trainer(InfGradAtThirdBatch(), precision="fp16", device=device, batch_size=4, shuffle=False,
                           log_every=1, callbacks=[Watch()])
    scaler = trainer.precision.scaler
    assert trainer.precision.dtype is torch.float16 and scaler is not None and scaler.is_enabled()
    assert scaler.get_scale() == 2.0 ** 16  # torch's starting scale
    # a scale at which this net's first gradients fit in fp16 (at 2^16 they may not, and the first window would
    # be skipped too): set through the scaler's public state, as a checkpoint would
    scaler.load_state_dict(dict(scaler.state_dict(), scale=2.0 ** 10))
    w = trainer.model.head.weight
    w0 = w.detach().float().cpu().clone()
    reference = TinyNet()  # the hand gradient of the first batch, in fp32 on the CPU
    reference.load_state_dict({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()})
    x, y = data.tensors[0][:4], data.tensors[1][:4]
    hand = torch.autograd.grad(torch.nn.functional.cross_entropy(reference(x), y), reference.head.weight)[0]
    in_backward = []
    w.register_hook(lambda g: in_backward.append(g.detach().float().cpu().clone()))
    trainer.fit(data)

    def close(a, b):  # fp16 products: a few parts in a thousand
        return (a - b).abs().max().item() <= 1e-2 * b.abs().max().item()

    assert len(in_backward) == 10 and trainer.global_step == 10
    assert close(in_backward[0], hand * 2.0 ** 10), "backward's gradient is not the loss's times the scale"
    assert close((w0 - weights[0]) / 0.05, hand), "the update is not the unscaled gradient's (lr 0.05)"
    assert not torch.isfinite(in_backward[2]).all() and torch.equal(weights[2], weights[1])  # the overflow: no update
    assert not torch.equal(weights[3], weights[2])  # the next window updates again
    assert scales == [2.0 ** 10] * 2 + [2.0 ** 9] * 8  # halved once (growth needs 1000 or more good windows)
    assert trainer.skipped_steps == 1


def _draws() -> tuple:
    import random

    import numpy as np

    return random.random(), random.gauss(0, 1), float(np.random.uniform()), float(np.random.normal()), \
        float(torch.rand(()))


@pytest.mark.parametrize("gauss_pending", [False, True])
def test_a_ranks_generators_travel_as_bytes_and_come_back_whole(gauss_pending):
    """What the ranks send each other at a save is a byte tensor (never a pickle); unpacked it restores
    every generator, a pending Gaussian and CUDA-sized device states included."""
    import random

    from torchrig.runtime import seed

    seed.seed_everything(3)
    if gauss_pending:
        random.gauss(0, 1)  # leaves the second value of the pair pending
    state = dict(seed.rng_state(), cuda=[torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)])
    data = seed._pack(state)
    assert data.dtype == torch.uint8 and data.dim() == 1
    back = seed._unpack(torch.cat([data, torch.zeros(40, dtype=torch.uint8)]))  # padded to a longer rank's
    assert [torch.equal(a, b) for a, b in zip(back["cuda"], state["cuda"])] == [True, True]
    expected = _draws()
    seed.seed_everything(99)
    seed.set_rng_state({k: v for k, v in back.items() if k != "cuda"})
    assert _draws() == expected


def test_each_rank_restores_its_own_generators_and_another_world_size_is_said(tmp_path):
    from torchrig.runtime import seed
    from torchrig.trainer.state import RNGState

    states = []
    for s in (1, 2):
        seed.seed_everything(s)
        states.append(seed.rng_state())
    after = []
    for s in (1, 2):
        seed.seed_everything(s)
        after.append(float(torch.rand(())))
    rank1 = RNGState(rank=1, world_size=2)
    rank1.load_state_dict({"ranks": states})
    assert float(torch.rand(())) == after[1] and rank1.note == ""
    alone = RNGState(rank=0, world_size=1)
    alone.load_state_dict({"ranks": states})
    assert float(torch.rand(())) == after[0]
    assert alone.note == ("torchrig: the checkpoint holds the random number generators of 2 process(es), now 1; "
                          "dropout and augmentation streams cannot be restored exactly (every process continues "
                          "from rank 0's)")
    old = RNGState(rank=0, world_size=1)
    old.load_state_dict(states[1])  # an older checkpoint: one process's generators, not a list
    assert float(torch.rand(())) == after[1] and old.note == ""
