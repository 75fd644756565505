"""Bad inputs end in one line that names the key or file, the bad value and what to do (exit 1, no
traceback): losses and optimizer options, thread counts, YAML files, metrics, dist keys, batches that do
not fit the model or the loss, data sets and factories that raise, damaged checkpoint files, ranks with
different data."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import record_checksums
from torchrig.cli import main



def one_line_error(capsys, argv: list[str], *fragments: str) -> str:
    """Run ``torchrig ARGV``: exit 1, stderr ends in one ``torchrig: error:`` line holding every fragment, and
    holds no traceback (the lines before it are torchrig's own, such as the line that starts training)."""
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1, (out, err)
    assert lines and lines[-1].startswith("torchrig: error: "), err
    assert all(line.startswith("torchrig: ") for line in lines) and "Traceback" not in err, err
    assert sum(line.startswith("torchrig: error: ") for line in lines) == 1, err
    for f in fragments:
        assert f in lines[-1], lines[-1]
    return lines[-1]

QUICK = ["--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none",
         "--set", "log.summary=false", "--set", "epochs=1"]  # the model summary's table is not a message
PKG = "msgtask"  # a module name no other test uses

TASK = '''
import torch
from torch import nn
from torch.utils.data import Dataset


def model(cfg):
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _xy(n=64, width=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, width, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g)


def data(cfg):
    return _xy()


def wide(cfg):
    return _xy(width=5)


def double(cfg):
    return _xy(dtype=torch.float64)


def float_labels(cfg):
    x, y = _xy()
    return x, y.float()


def big_labels(cfg):
    x, y = _xy()
    return x, y + 5


def labels_2d(cfg):
    x, y = _xy()
    return x, y[:, None].repeat(1, 2)


class Bad(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 7:
            raise ValueError("sample 7 is broken")
        return torch.zeros(4), 0


def raising_dataset(cfg):
    return Bad()


def raises(cfg):
    raise RuntimeError("cannot reach the data server")


def by_rank(cfg):
    return _xy(n=64 + 7 * cfg.dist.rank)
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("messages")
    (root / f"{PKG}.py").write_text(textwrap.dedent(TASK))
    (root / "nested.yaml").write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    (root / "dup.yaml").write_text("epochs: 1\nseed: 3\nepochs: 3\n")
    np.save(root / "x.npy", np.zeros((3, 8, 8), dtype=np.float32))
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    mp.setattr(sys, "path", list(sys.path))
    yield root
    mp.undo()
    sys.modules.pop(PKG, None)


@pytest.fixture(scope="module")
def digits_run(workdir):
    assert main(["train", *QUICK, "--set", "max_steps=2", "--set", f"run_dir={workdir / 'digits'}"]) == 0
    return workdir / "digits"


def _own(model: str, data: str) -> list[str]:
    return ["--model", f"{PKG}:{model}", "--data", f"{PKG}:{data}"]


CASES = {
    "loss=mse on class labels": (["--set", "loss=mse"], [
        "the loss mse (config key 'loss')", "output is float32 (32, 10)", "targets int64 (32,)",
        "use loss=cross_entropy"]),
    "loss=bce_with_logits on class labels": (["--set", "loss=bce_with_logits"], [
        "the loss bce_with_logits (config key 'loss')", "targets int64 (32,)", "use loss=cross_entropy"]),
    "optim.options naming no keyword": (["--set", "optim.options={foo: 1}"], [
        "config key 'optim.options'", "takes no keyword 'foo'", "Valid keywords: betas"]),
    "optim.options repeating a key": (["--set", "optim.options={momentum: 0.5}", "--set", "optim.name=sgd"], [
        "config key 'optim.options'", "'momentum' has its own key, optim.momentum"]),
    "threads=100000": (["--set", "threads=100000"], ["threads=100000", "set threads to at most"]),
    "nested YAML": (["nested.yaml"], ["config file 'nested.yaml'", "nests lists or mappings deeper"]),
    "duplicate YAML keys": (["dup.yaml"], ["config file 'dup.yaml' sets the key 'epochs' twice (lines 1 and 3)"]),
    "metrics=top0": (["--set", "metrics=[top0]"], ["metric 'top0': k must be at least 1"]),
    "metrics=top1000": (["--set", "metrics=[top1000]"], [
        "metric 'top1000': the model scores 10 classes", "use k below 10"]),
    "dist.rank without a world size": (["--set", "dist.rank=3"], [
        "config key 'dist.rank': 3", "dist.world_size and dist.init_method are not set"]),
    "data.input_keys on tuple batches": ([*_own("model", "data"), "--set", "data.input_keys=[nope]"], [
        "data.input_keys=['nope']", "batches are float32 (64, 4), not a dict",
        "remove data.input_keys"]),
    "inputs too wide": (_own("model", "wide"), [
        "inputs float32 (64, 5)", "first layer '0' (Linear) takes float32 inputs with 4 features"]),
    "inputs of another dtype": (_own("model", "double"), [
        "inputs float64 (64, 4)", "must have the same dtype", "x.float()"]),
    "float labels": (_own("model", "float_labels"), [
        "the loss cross_entropy (config key 'loss') takes integer class indices", "float32 (64,)", "y.long()"]),
    "labels out of range": (_own("model", "big_labels"), [
        "the loss cross_entropy (config key 'loss')", "class 7, outside the model's 3 outputs"]),
    "2-D labels": (_own("model", "labels_2d"), [
        "the loss cross_entropy (config key 'loss')", "targets are int64 (64, 2)", "one label per sample"]),
    "a data set raising in a worker": ([*_own("model", "raising_dataset"), "--set", "data.num_workers=1"], [
        "the data set Bad raised in DataLoader worker 0: ValueError: sample 7 is broken", "data.num_workers=0"]),
    "a data factory raising": (_own("model", "raises"), [
        f"data.factory '{PKG}:raises' raised RuntimeError: cannot reach the data server"]),
    "a model factory raising": (_own("raises", "data"), [
        f"model.factory '{PKG}:raises' raised RuntimeError: cannot reach the data server"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_errors_are_one_line_naming_key_and_value(workdir, tmp_path, capsys, case):
    args, fragments = CASES[case]
    config = [a for a in args if a.endswith(".yaml")]
    rest = [a for a in args if not a.endswith(".yaml")]
    one_line_error(capsys, ["train", *config, *QUICK, "--set", "max_steps=2", "--set", f"run_dir={tmp_path / 'r'}",
                            *rest], *fragments)


@pytest.mark.parametrize("topk", ["-1", "0"])
def test_predict_topk_below_one(digits_run, capsys, topk):
    one_line_error(capsys, ["predict", "--checkpoint", str(digits_run), "--input", "x.npy", "--output", "p.csv",
                            "--topk", topk],
                   f"predict --topk {topk}: expected an integer >= 1")


def _corrupted(state: Path) -> None:
    """Flip one byte of the pickle inside ``state`` where torch's weights_only loader then fails to parse it
    (the damage a bad disk does; it names no function to import)."""
    with zipfile.ZipFile(state) as z:
        files = {n: z.read(n) for n in z.namelist()}
    pkl = next(n for n in files if n.endswith("data.pkl"))
    for i in range(2, len(files[pkl])):
        data = bytearray(files[pkl])
        data[i] ^= 0xFF
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for n, b in files.items():
                z.writestr(n, bytes(data) if n == pkl else b)
        try:
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        except Exception as exc:
            if type(exc).__name__ == "UnpicklingError" and "GLOBAL" not in str(exc):
                state.write_bytes(buf.getvalue())
                return
    raise AssertionError("no byte flip made the pickle unreadable")


@pytest.mark.parametrize("damage", ["empty", "flipped byte"])
@pytest.mark.parametrize("way", ["evaluate", "resume"])
def test_a_damaged_state_file_is_corrupt_not_unsafe(digits_run, tmp_path, capsys, damage, way):
    run = tmp_path / "run"
    shutil.copytree(digits_run, run, symlinks=True)
    state = (run / "checkpoints" / "latest").resolve() / "state.pt"
    if damage == "empty":
        state.write_bytes(b"")
        detail = "(it is empty, 0 bytes)"
    else:
        _corrupted(state)
        record_checksums(state.parent)  # damaged before it was hashed: the pickle itself must say so
        detail = "(its pickled data cannot be read: "
    argv = ["evaluate", "--checkpoint", str(run)] if way == "evaluate" else \
        ["train", *QUICK, "--set", f"run_dir={run}", "--set", "resume=latest", "--set", "max_steps=4"]
    line = one_line_error(capsys, argv, f"checkpoint file '{state}' is corrupt or truncated {detail}",
                          "use another checkpoint")
    assert "unsafe" not in line


@pytest.mark.slow
def test_ranks_with_different_data_lengths_stop_at_once(workdir, tmp_path):
    """Two ranks whose data factory gives 64 and 71 samples: both stop before the first step, saying so."""
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "torchrig.cli", "train", *_own("model", "by_rank"), *QUICK,
           "--set", f"run_dir={tmp_path / 'r'}", "--set", f"dist.init_method=file://{store}",
           "--set", "dist.world_size=2", "--set", "dist.timeout=60"]
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    procs = [subprocess.Popen([*cmd, "--set", f"dist.rank={rank}"], cwd=workdir, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 1, err
        assert err.strip().splitlines()[-1] == (
            f"torchrig: error: the training data has 64 samples on one rank and 71 on another (this rank: "
            f"{64 + 7 * rank}); every rank must hold the same data set, which the sampler splits among them: build "
            f"it the same way on every rank (the same files, data.path and data.factory)")
