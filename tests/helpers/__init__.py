"""What the tests share: tiny models and data (a whole fit takes milliseconds), paths, subprocess set-up.

Test modules import these with ``from helpers import ...``; the child scripts the tests start
(``dist_worker.py``, ``resume_child.py``, ``signal_child.py`` …) live beside this file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import Dataset

# Tiny models run fastest on one thread, and the machine's cores are shared with other test processes.
torch.set_num_threads(1)

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
REPO = TESTS.parent

QUIET = dict(plot=False, tensorboard=False, progress="none")


class TinyNet(nn.Module):
    """8 features -> 4 classes, with a dropout so that RNG handling matters."""

    def __init__(self, in_features: int = 8, hidden: int = 16, classes: int = 4, dropout: float = 0.0):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.drop(self.backbone(x)))


def fp16_precision(init_scale: float = 2.0 ** 16):
    """precision=fp16 as on CUDA (a GradScaler, float16 autocast), built for the CPU, where torch has both too:
    ``monkeypatch.setattr(torchrig.runtime, "make_precision", lambda name, device: fp16_precision())``."""
    from torchrig.runtime.precision import Precision

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
    return Precision("fp16", torch.device("cpu"), torch.float16, scaler)


def make_classification(n: int = 40, features: int = 8, classes: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w).argmax(dim=1)
    return x, y


class AugmentedDataset(Dataset):
    """A map-style data set whose samples get random noise (torch), a random sign (python) and a
    random scale (numpy): random augmentation drawn from every global RNG."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        import random

        import numpy as np

        sign = 1.0 if random.random() < 0.5 else -1.0
        scale = float(np.random.uniform(0.9, 1.1))
        return self.x[i] * sign * scale + 0.05 * torch.randn_like(self.x[i]), self.y[i]


class SlowSamples(Dataset):
    """``dataset``'s samples, each taking ``seconds`` more (a decoded image, say); counts its fetches."""

    def __init__(self, dataset: Dataset, seconds: float = 2e-3):
        self.dataset, self.seconds, self.fetched = dataset, seconds, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        import time

        self.fetched += 1
        time.sleep(self.seconds)
        return self.dataset[i]


class DictDataset(Dataset):
    """Samples as dicts with a ``labels`` key, like Hugging Face batches."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class DictNet(TinyNet):
    def forward(self, x):  # called as model(**inputs) with inputs = {"x": ...}
        return super().forward(x)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def record_checksums(checkpoint) -> None:
    """Re-record in a checkpoint's meta.json the checksums of its files as they are now: what someone who
    edits a checkpoint by hand (or crafts one) and fixes meta.json too leaves behind."""
    import hashlib

    folder = Path(checkpoint)
    meta = json.loads((folder / "meta.json").read_text())
    meta["checksums"] = {f.relative_to(folder).as_posix(): "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
                         for f in sorted(folder.rglob("*")) if f.is_file() and f.name != "meta.json"}
    (folder / "meta.json").write_text(json.dumps(meta))


def drop_checksums(checkpoint) -> None:
    """Remove the checksums from a checkpoint's meta.json, as in a checkpoint saved before they were recorded."""
    path = Path(checkpoint) / "meta.json"
    meta = json.loads(path.read_text())
    meta.pop("checksums", None)
    path.write_text(json.dumps(meta))


def subprocess_env(**extra) -> dict:
    """Environment for child Python processes: the package importable, one thread, no stray config."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(TESTS), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TORCH_THREAD_NUM", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


PYTHON = sys.executable


def one_line_error(capsys, argv, *fragments) -> str:
    """Run the ``torchrig`` command ``argv``: it must exit 1 with exactly one ``torchrig: error:`` line on
    stderr holding every fragment; returns that line."""
    from torchrig.cli import main

    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchrig: error: "), err
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- a custom step: GAN


def gan_models():
    torch.manual_seed(0)
    return nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)),
                          "D": nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))})


def gan_step(step, batch):
    """Two optimizers, one step each per window; torchrig supplies precision, accumulation and clipping."""
    (real,) = batch
    G, D = step.models["G"], step.models["D"]
    z = torch.randn(real.shape[0], 4)
    with step.autocast():
        fake = G(z)
        d_real, d_fake = D(real), D(fake.detach())
        loss_d = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real)) + \
            F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake))
    step.backward(loss_d)
    step.optimizer_step("D")
    D.requires_grad_(False)
    with step.autocast():
        d_fake = D(fake)
        loss_g = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
    step.backward(loss_g)
    D.requires_grad_(True)
    step.optimizer_step("G")
    return {"loss_d": loss_d.detach(), "loss_g": loss_g.detach()}


# ----------------------------------------------------------------------------- trackers

TRACKED_FINAL = {"test/accuracy": 0.625, "test/loss": 1.25}  # the test metrics tracked_fit ends with


def tracked_fit(run_dir: Path, **kw):
    """A tiny run (4 optimizer steps per epoch, a row every 2, validation each epoch) whose trackers end
    with TRACKED_FINAL; ``kw`` sets Trainer keywords (``trackers=``, ``tensorboard=`` …)."""
    import torchrig
    from torch.utils.data import TensorDataset

    x, y = make_classification(32)
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=8, epochs=2, log_every=2, num_workers=0)
    opts.update(kw)
    trainer = torchrig.Trainer(TinyNet(), **opts)
    trainer.fit(TensorDataset(x, y), TensorDataset(x[:8], y[:8]))
    trainer.logger.finish(TRACKED_FINAL)
    trainer.close()
    return trainer


class UserProject:
    """A user's project folder: package ``package`` with ``task.py`` holding ``source``, made the current
    directory with a copy of ``sys.path`` (the CLI puts the current directory on it), as when a user runs
    ``torchrig`` from their project. ``close()`` gives both back and forgets the package's modules, so
    another test's package of the same name is imported afresh."""

    def __init__(self, root: Path, package: str, source: str):
        import textwrap

        import pytest

        self.root, self.package = root, package
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
        (root / package / "task.py").write_text(textwrap.dedent(source))
        self._mp = pytest.MonkeyPatch()
        self._mp.chdir(root)
        self._mp.setattr(sys, "path", list(sys.path))

    def close(self) -> None:
        self._mp.undo()
        forget_modules(self.package)


def forget_modules(*packages: str) -> None:
    """Drop ``packages`` and their submodules from ``sys.modules``."""
    for name in [m for m in sys.modules if m.split(".")[0] in packages]:
        del sys.modules[name]
