"""Capability 7: checkpoint layout, schedule, keep-last / best-k, atomic writes, safe and clear loading."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re

import pytest
import torch
import yaml
from helpers import TinyNet, drop_checksums, record_checksums
from safetensors.torch import load_file
from torch import nn

import torchrig
from torchrig.checkpoint import (CheckpointError, CheckpointManager, CheckpointWriteError, load_weights,
                                 read_checkpoint, resolve)
from torchrig.checkpoint import manager as manager_mod
from torchrig.config import from_dict
from torchrig.metrics import Metric

FILES = {"model.safetensors", "state.pt", "config.yaml", "meta.json"}


def _steps(run_dir) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


def _spy_saves(monkeypatch) -> list:
    saved = []
    real = CheckpointManager.save

    def spy(self, step, *a, **kw):
        saved.append(step)
        return real(self, step, *a, **kw)

    monkeypatch.setattr(CheckpointManager, "save", spy)
    return saved


# ----------------------------------------------------------------------------- layout and schedule


def test_checkpoint_directory_layout(make_trainer, data, run_dir):
    trainer = make_trainer(epochs=2, checkpoint_every=2, keep_last=10, scheduler="cosine")
    trainer.fit(data)
    ckpts = run_dir / "checkpoints"
    assert _steps(run_dir) == [2, 4, 5, 6, 8, 10]
    latest = ckpts / "latest"
    assert latest.is_symlink() and os.readlink(latest) == "step-00000010"
    for d in ckpts.glob("step-*"):
        assert FILES <= {p.name for p in d.iterdir()}
    state, meta, cfg = read_checkpoint(resolve("latest", run_dir))
    assert {"optimizers", "schedulers", "scaler", "counters", "rng", "tracker"} <= set(state)
    assert set(state["rng"]["ranks"][0]) >= {"python", "numpy", "torch"}  # one process: one rank's
    assert state["counters"] == {"global_step": 10, "epoch": 2, "batch_in_epoch": 0, "skipped_steps": 0,
                                 "world_size": 1, "samples_in_epoch": 0, "total_steps": 10,
                                 "run_length": 2 * 1_000_003 + 0}
    assert "default" in state["schedulers"]
    assert meta["step"] == 10 and meta["precision"] == "fp32" and meta["torch"] == torch.__version__
    assert from_dict(cfg).checkpoint.every_steps == 2
    assert yaml.safe_load((latest / "config.yaml").read_text())["epochs"] == 2
    # plain PyTorch out: the weights load into the bare model
    fresh = TinyNet()
    fresh.load_state_dict(load_file(latest / "model.safetensors"))
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), trainer.model.parameters()))


def test_every_n_steps_only(make_trainer, data, run_dir, monkeypatch):
    saved = _spy_saves(monkeypatch)
    make_trainer(epochs=2, checkpoint_every=3, checkpoint_every_epochs=0, keep_last=100).fit(data)
    assert saved == [3, 6, 9, 10]  # and the final one
    assert _steps(run_dir) == [3, 6, 9, 10]


def test_each_epoch_only(make_trainer, data, run_dir, monkeypatch):
    saved = _spy_saves(monkeypatch)
    make_trainer(epochs=3, keep_last=100).fit(data)
    assert saved == [5, 10, 15]  # the final state is the last epoch's checkpoint: not written twice


def test_final_only(make_trainer, data, run_dir, monkeypatch):
    saved = _spy_saves(monkeypatch)
    make_trainer(epochs=3, checkpoint_every_epochs=0, max_steps=12).fit(data)
    assert saved == [12]
    meta = json.loads((run_dir / "checkpoints" / "latest" / "meta.json").read_text())
    assert meta["final"] is True and meta["step"] == 12


def test_no_final_checkpoint_when_asked(make_trainer, data, run_dir, monkeypatch):
    saved = _spy_saves(monkeypatch)
    make_trainer(epochs=2, checkpoint_every_epochs=0, **{"checkpoint.save_final": False}).fit(data)
    assert saved == [] and not (run_dir / "checkpoints").exists()


def test_keep_last_k(make_trainer, data, run_dir):
    make_trainer(epochs=2, checkpoint_every=1, keep_last=3).fit(data)
    assert _steps(run_dir) == [8, 9, 10]
    index = json.loads((run_dir / "checkpoints" / "index.json").read_text())
    assert index["checkpoints"] == ["step-00000008", "step-00000009", "step-00000010"]


class Scripted(Metric):
    """A validation metric whose value per evaluation follows a script."""

    name = "score"
    script: list = []

    def update(self, output, target):
        self._add("eval" if torch.is_inference_mode_enabled() else "train", torch.tensor(1.0))

    def compute(self):
        return float(Scripted.script.pop(0)) if "eval" in self.states else 0.0


@pytest.mark.parametrize("mode,best_epochs", [("max", [2, 4]), ("min", [1, 5])])
def test_best_k_by_monitored_metric(make_trainer, data, run_dir, mode, best_epochs):
    Scripted.script = [0.5, 0.9, 0.7, 0.8, 0.6]
    trainer = make_trainer(epochs=5, metrics=[Scripted()], keep_last=1, keep_best=2, monitor="val/score",
                           monitor_mode=mode, batch_size=40)  # one step per epoch: step == epoch
    trainer.fit(data, val_data=data)
    ckpts = run_dir / "checkpoints"
    assert _steps(run_dir) == sorted(set(best_epochs) | {5})  # best 2 + the last
    assert os.readlink(ckpts / "best") == f"step-{best_epochs[0]:08d}"
    index = json.loads((ckpts / "index.json").read_text())
    assert [b["name"] for b in index["best"]] == [f"step-{e:08d}" for e in best_epochs]
    assert resolve("best", run_dir).name == f"step-{best_epochs[0]:08d}"
    meta = json.loads((ckpts / "best" / "meta.json").read_text())
    assert meta["metrics"]["val/score"] == {"max": 0.9, "min": 0.5}[mode]


def test_a_tie_of_the_monitored_value_goes_to_the_lower_validation_loss(make_trainer, data, run_dir):
    Scripted.script = [0.9, 0.9, 0.5, 0.9, 0.9]  # a small validation split saturates: ties are the rule
    trainer = make_trainer(epochs=5, metrics=[Scripted()], keep_last=1, keep_best=1, monitor="val/score",
                           batch_size=40)
    trainer.fit(data, val_data=data)
    tied = [row for row in trainer.history if row["val/score"] == 0.9]
    expected = min(tied, key=lambda row: (row["val/loss"], -row["step"]))["step"]
    assert expected != 1  # the first of the tied epochs: what the first tie kept before
    assert os.readlink(run_dir / "checkpoints" / "best") == f"step-{expected:08d}"
    best = json.loads((run_dir / "checkpoints" / "index.json").read_text())["best"]
    assert best == [{"name": f"step-{expected:08d}", "value": 0.9,
                     "loss": [r["val/loss"] for r in tied if r["step"] == expected][0]}]


@pytest.mark.parametrize("entries,expected", [
    ([("step-00000002", 1.0, None), ("step-00000004", 1.0, None)], ["step-00000004", "step-00000002"]),
    ([("step-00000002", 1.0, 0.3), ("step-00000004", 1.0, 0.5), ("step-00000006", 1.0, 0.3)],
     ["step-00000006", "step-00000002", "step-00000004"]),
    ([("step-00000002", 1.0, 0.1), ("step-00000004", 0.5, 0.01)], ["step-00000002", "step-00000004"]),
    ([("step-00000002", 1.0, float("nan")), ("step-00000004", 1.0, 0.2)], ["step-00000004", "step-00000002"]),
])
def test_best_k_ranks_by_value_then_loss_then_the_later_step(tmp_path, entries, expected):
    manager = CheckpointManager(tmp_path, keep_best=3)
    (tmp_path / "checkpoints").mkdir()
    for name, value, loss in entries:
        (tmp_path / "checkpoints" / name).mkdir()
        manager.track_best(name, value, "max", loss=loss)
    assert [b["name"] for b in manager.index["best"]] == expected
    assert os.readlink(tmp_path / "checkpoints" / "best") == expected[0]
    again = CheckpointManager(tmp_path, keep_best=3)  # read back from index.json: the same entries
    assert again.index["best"] == manager.index["best"]
    assert all(b.get("loss") == b.get("loss") for b in again.index["best"])  # no NaN written


def test_monitor_defaults_to_first_validation_metric(make_trainer, data, run_dir):
    trainer = make_trainer(epochs=2, metrics=["accuracy"])
    trainer.fit(data, val_data=data)
    assert (trainer.monitor.name, trainer.monitor.mode) == ("val/accuracy", "max")
    assert (run_dir / "checkpoints" / "best").is_symlink()
    trainer = make_trainer(epochs=1, metrics=[], run_dir=str(run_dir) + "2")
    trainer.fit(data, val_data=data)
    assert (trainer.monitor.name, trainer.monitor.mode) == ("val/loss", "min")


def test_unknown_monitor_fails_after_saving(make_trainer, data, run_dir):
    from torchrig.config import ConfigError

    trainer = make_trainer(epochs=3, metrics=["accuracy"], monitor="val/acc")
    with pytest.raises(ConfigError) as err:
        trainer.fit(data, val_data=data)
    assert "config key 'checkpoint.monitor': 'val/acc' is not a logged value; choose one of train/loss, " \
           "train/accuracy, val/loss, val/accuracy (the run is saved: resume=\"latest\")" in str(err.value)
    assert resolve("latest", run_dir).name == "step-00000005"


# ----------------------------------------------------------------------------- resolving


def test_resolve_forms(make_trainer, data, run_dir):
    make_trainer(epochs=1).fit(data)
    latest = resolve("latest", run_dir)
    assert latest.name == "step-00000005"
    assert resolve(run_dir) == latest
    assert resolve(run_dir / "checkpoints" / "latest") == latest
    assert resolve(latest / "model.safetensors") == latest
    assert resolve("latest", run_dir / "empty") is None  # nothing saved yet: a fresh start
    with pytest.raises(CheckpointError, match=r"checkpoint '.*nope' does not exist; give a checkpoint directory "
                                              r"\(RUN_DIR/checkpoints/step-N, .../latest, .../best\) or a run "
                                              r"directory"):
        resolve(run_dir / "nope")
    with pytest.raises(CheckpointError, match=r"is not a torchrig checkpoint \(no model.safetensors inside\)"):
        resolve(run_dir.parent)
    with pytest.raises(CheckpointError, match=r"'latest' names a checkpoint of a run directory: give "
                                              r"RUN_DIR/checkpoints/latest, or run_dir with resume='latest'"):
        resolve("latest")


def test_resume_latest_with_nothing_saved_starts_fresh(make_trainer, data):
    trainer = make_trainer(resume="latest")
    trainer.fit(data)
    assert trainer.global_step == 5


def test_resume_from_missing_path(make_trainer, data, tmp_path):
    with pytest.raises(CheckpointError) as err:
        make_trainer(resume=str(tmp_path / "missing")).fit(data)
    assert str(err.value) == (f"checkpoint '{tmp_path / 'missing'}' does not exist; give a checkpoint directory "
                              f"(RUN_DIR/checkpoints/step-N, .../latest, .../best) or a run directory")


def test_load_weights_public_api(make_trainer, data, run_dir):
    trainer = make_trainer(epochs=1)
    trainer.fit(data)
    for where in (run_dir, run_dir / "checkpoints" / "latest", resolve("latest", run_dir) / "model.safetensors"):
        model = TinyNet()
        torchrig.load_weights(model, where)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trainer.model.parameters()))


def test_tied_weights_are_saved(make_trainer, tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 4)
            self.out = nn.Linear(4, 4, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.emb(x))

    trainer = make_trainer(Tied())
    trainer.fit((torch.arange(4).repeat(4), torch.arange(4).repeat(4)))
    loaded = Tied()
    load_weights(loaded, tmp_path / "run")
    assert torch.equal(loaded.emb.weight, trainer.model.emb.weight)


# ----------------------------------------------------------------------------- atomic writes


def test_failure_mid_save_keeps_latest_readable(make_trainer, data, run_dir, monkeypatch):
    make_trainer(epochs=1).fit(data)  # a good checkpoint: step 5
    good = resolve("latest", run_dir)
    before = load_file(good / "model.safetensors")

    def crash(obj, path):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(manager_mod, "safe_torch_save", crash)  # weights written, then the state fails
    trainer = make_trainer(epochs=2, resume="latest")
    with pytest.raises(CheckpointWriteError) as err:
        trainer.fit(data)
    assert str(err.value) == (f"OS error (disk full (simulated)) while saving checkpoint step 10 to "
                              f"{run_dir / 'checkpoints'}; the previous checkpoint (step 5) is intact. Fix the "
                              f"storage and continue with resume=\"latest\"")
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if ".tmp-" in p.name] == []  # removed at once
    assert resolve("latest", run_dir) == good
    after = load_file(good / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
    read_checkpoint(good)
    monkeypatch.undo()
    make_trainer(epochs=2, resume="latest").fit(data)
    assert resolve("latest", run_dir).name == "step-00000010"


def test_resaving_a_step_keeps_latest_whole_at_every_instant(make_trainer, data, run_dir, monkeypatch):
    """The epoch-end checkpoint re-saves the step just saved by every_steps; a kill between the two renames
    of that swap must not leave ``latest`` dangling."""
    real = os.replace
    checks = []

    def replace(src, dst, **kwargs):
        real(src, dst, **kwargs)
        if os.path.basename(str(dst)).startswith("step-") or os.path.basename(str(src)).startswith("step-"):
            target = resolve("latest", run_dir)  # would raise if latest named a missing directory
            if target is None:  # the very first checkpoint: no latest yet
                return
            checks.append(target.name)
            read_checkpoint(target)
            load_file(target / "model.safetensors")

    monkeypatch.setattr(manager_mod.os, "replace", replace)
    make_trainer(epochs=1, checkpoint_every=5).fit(data)  # step 5 saved twice: every_steps, then epoch end
    assert len(checks) == 2  # after each of the two renames of the swap
    state, meta, _ = read_checkpoint(resolve("latest", run_dir))
    assert (meta["epoch"], meta["batch_in_epoch"]) == (1, 0)  # the epoch-end version won
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


# ----------------------------------------------------------------------------- loading never executes code


class Custom:
    def __init__(self):
        self.x = 1


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_state_with_a_pickled_custom_class_is_refused(make_trainer, data, run_dir):
    make_trainer(epochs=1).fit(data)
    latest = resolve("latest", run_dir)
    state = torch.load(latest / "state.pt", weights_only=True)
    state["extra"] = Custom()
    torch.save(state, latest / "state.pt")
    record_checksums(latest)  # crafted with care: its checksum matches
    with pytest.raises(CheckpointError) as err:
        make_trainer(epochs=2, resume="latest").fit(data)
    msg = str(err.value)
    assert msg == (f"checkpoint file '{latest / 'state.pt'}' was refused as unsafe: it pickles "
                   f"'test_checkpoint.Custom', which is not plain data (tensors, numbers, strings, lists, dicts); "
                   f"torchrig never runs code from a checkpoint. Use a checkpoint torchrig wrote, or re-save the file "
                   f"as a plain state_dict or safetensors")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_malicious_weights_file_is_refused(tmp_path, suffix):
    marker = tmp_path / "pwned"
    path = tmp_path / f"weights{suffix}"
    torch.save({"backbone.0.weight": torch.zeros(16, 8), "evil": Evil(marker)}, path)
    with pytest.raises(CheckpointError, match=f"'{path}' was refused as unsafe: it pickles 'posix.system'"):
        load_weights(TinyNet(), path)
    raw = tmp_path / f"raw{suffix}"
    raw.write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(CheckpointError, match=f"'{raw}' was refused as unsafe: it pickles 'posix.system'"):
        load_weights(TinyNet(), raw)
    assert not marker.exists()


def test_plain_state_dict_weights_file_loads(tmp_path):
    src = TinyNet()
    torch.save({"state_dict": src.state_dict()}, tmp_path / "w.pt")
    dst = TinyNet()
    load_weights(dst, tmp_path / "w.pt")
    assert all(torch.equal(p, q) for p, q in zip(src.parameters(), dst.parameters()))
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError) as err:
        load_weights(dst, tmp_path / "list.pt")
    assert str(err.value) == f"weights file '{tmp_path / 'list.pt'}' does not hold a state_dict of tensors"


# ----------------------------------------------------------------------------- clear errors


def test_key_mismatch_lists_missing_and_unexpected(make_trainer, data, run_dir):
    make_trainer(epochs=1).fit(data)

    class Other(TinyNet):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)
            del self.head
            self.classifier = nn.Linear(16, 4)

    with pytest.raises(CheckpointError) as err:
        load_weights(Other(), run_dir)
    msg = str(err.value)
    assert "does not match the model: missing keys: classifier.bias, classifier.weight, extra.bias, extra.weight; " \
           "unexpected keys: head.bias, head.weight. Was it saved from a different model or config?" in msg
    with pytest.raises(CheckpointError, match=r"shape mismatch for head.bias \(4,\) vs model \(3,\); head.weight "
                                              r"\(4, 16\) vs model \(3, 16\)"):
        load_weights(TinyNet(classes=3), run_dir)
    with pytest.raises(CheckpointError, match="missing keys: classifier.bias"):  # (another class: allowed on purpose)
        make_trainer(Other(), resume="latest", resume_changes="allow").fit(data)


def test_many_missing_keys_are_summarised(make_trainer, data, run_dir):
    make_trainer(epochs=1).fit(data)
    big = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    with pytest.raises(CheckpointError, match=r"missing keys: 0.bias, .* \(12 in all\)"):
        load_weights(big, run_dir)


CORRUPT = "' is corrupt: its bytes do not match the sha256 checksum recorded in meta.json when it was saved; " \
          "use another checkpoint (RUN_DIR/checkpoints/), or retrain"


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "saved-without-checksums"])
@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_model_safetensors(make_trainer, data, run_dir, damage, checksums):
    make_trainer(epochs=1).fit(data)
    path = resolve("latest", run_dir) / "model.safetensors"
    if not checksums:
        drop_checksums(path.parent)
    blob = path.read_bytes()
    path.write_bytes({"truncate": blob[: len(blob) - 100], "garbage": b"not a safetensors file" * 10,
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError) as err:
        load_weights(TinyNet(), run_dir, verify=checksums)  # without its record: refused unless verify=False
    if checksums:
        assert str(err.value) == f"checkpoint file '{path}{CORRUPT}"
    else:  # safetensors itself finds it out
        assert f"weights file '{path}' is corrupt or not a safetensors file" in str(err.value)
        assert "use another checkpoint" in str(err.value)
    with pytest.raises(CheckpointError, match="is corrupt: its bytes" if checksums else "is corrupt or not a safet"):
        make_trainer(resume="latest", **{"checkpoint.verify": checksums}).fit(data)


@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "saved-without-checksums"])
def test_truncated_state_and_corrupt_meta(make_trainer, data, run_dir, checksums):
    make_trainer(epochs=1).fit(data)
    latest = resolve("latest", run_dir)
    if not checksums:
        drop_checksums(latest)
    blob = (latest / "state.pt").read_bytes()
    (latest / "state.pt").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError) as err:
        make_trainer(resume="latest", **{"checkpoint.verify": checksums}).fit(data)
    if checksums:
        assert str(err.value) == f"checkpoint file '{latest / 'state.pt'}{CORRUPT}"
    else:
        assert re.fullmatch(r"checkpoint file '.*state.pt' is corrupt or truncated .*use another checkpoint",
                            str(err.value)), str(err.value)
    (latest / "state.pt").write_bytes(blob)
    (latest / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"meta.json' is corrupt \(not JSON\)"):
        read_checkpoint(latest)


def test_optimizer_state_that_does_not_fit(make_trainer, data, run_dir):
    make_trainer(epochs=1).fit(data)
    with pytest.raises(CheckpointError) as err:
        make_trainer(resume="latest", epochs=2, group_lr={"backbone": 1e-3}, resume_changes="allow").fit(data)
    assert str(err.value) == (f"checkpoint '{run_dir / 'checkpoints' / 'step-00000005'}' optimizer/scheduler state "
                              f"does not fit this run (loaded state dict has a different number of parameter groups); "
                              f"was it made with a different optimizer or model?")


def test_missing_weights_file(tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_weights(TinyNet(), tmp_path / "missing.safetensors")
    assert str(err.value) == (f"weights file '{tmp_path / 'missing.safetensors'}' does not exist; point at a "
                              f"checkpoint directory or a .safetensors file")


# ----------------------------------------------------------------------------- GPU-saved checkpoints on a CPU


@contextlib.contextmanager
def saved_as_cuda():
    """Make ``torch.save`` tag every storage with location ``cuda:0``, as a GPU run's tensors are."""
    import torch.serialization as S

    def tagger(obj):
        return "cuda:0"

    S.register_package(-100, tagger, lambda obj, location: None)
    try:
        yield
    finally:
        S._package_registry[:] = [e for e in S._package_registry if e[1] is not tagger]


def test_cuda_saved_state_loads_on_cpu(make_trainer, data, run_dir):
    make_trainer(epochs=1, optimizer="adam", lr=1e-3).fit(data)
    latest = resolve("latest", run_dir)
    state = torch.load(latest / "state.pt", weights_only=True)
    state["rng"]["cuda"] = [torch.get_rng_state()]  # a GPU run also saves the CUDA generators
    with saved_as_cuda():
        torch.save(state, latest / "state.pt")
    record_checksums(latest)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(latest / "state.pt", weights_only=True)  # what a naive loader would hit
    trainer = make_trainer(epochs=2, optimizer="adam", lr=1e-3, resume="latest")
    trainer.fit(data)
    assert trainer.global_step == 10
    exp_avg = trainer.optimizers["default"].state[next(trainer.model.parameters())]["exp_avg"]
    assert exp_avg.device.type == "cpu"


@pytest.mark.gpu
def test_gpu_trained_checkpoint_loads_on_cpu(make_trainer, data, run_dir):
    trainer = make_trainer(epochs=1, device="cuda", optimizer="adamw")
    trainer.fit(data)
    state = torch.load(resolve("latest", run_dir) / "state.pt", weights_only=True, map_location="cpu")
    assert state["counters"]["global_step"] == 5
    cpu_model = TinyNet()
    load_weights(cpu_model, run_dir)
    for p, q in zip(cpu_model.parameters(), trainer.model.parameters()):
        assert torch.equal(p, q.cpu())
    resumed = make_trainer(epochs=2, device="cpu", optimizer="adamw", resume="latest")
    resumed.fit(data)
    assert resumed.global_step == 10
