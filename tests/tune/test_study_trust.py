"""A study folder is a stranger's file, like a checkpoint: ``torchrig tune --resume`` takes from ``study.json`` and
``study.db`` only what a resume needs, each field by its rule. Each attack is planted as a real artefact (a package
with a payload that leaves a marker, a RUNNING trial written through Optuna's storage API, listeners on
127.0.0.1, a storage URL outside the folder, a trial folder linked to a victim run), and nothing it asks for
happens. The studies are made without a trial where the refusal comes first, and run one-epoch trials otherwise."""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

import torchrig  # noqa: E402
from torchrig.recipes.run import build_config, run_train  # noqa: E402
from torchrig.tune import TuneError  # noqa: E402
from torchrig.tune.study import open_study  # noqa: E402

QUIET = ["log.progress=none", "log.plot=false", "log.tensorboard=false"]
SPACE = {"optim.lr": {"choice": [3e-3, 2e-3]}}

pytestmark = pytest.mark.usefixtures("restore_threads")


def new_study(folder: Path, trials: int = 1, epochs: int = 1, **config) -> Path:
    """A study as ``torchrig tune`` creates it, before its first trial; ``config`` (section -> keys) is then
    written into its study.json, as a stranger would."""
    base = build_config(None, [f"epochs={epochs}", *QUIET])
    session = open_study(folder, base=base, space=SPACE, trials=trials, sampler=None, pruner=None, storage=None,
                         resume=False, out=lambda s: None)
    session.lock.release()

    def plant(manifest: dict) -> None:
        for key, value in config.items():
            if isinstance(value, dict):
                manifest["config"][key].update(value)
            else:
                manifest["config"][key] = value

    edit(folder, plant)
    return folder


def edit(folder: Path, change) -> None:
    manifest = json.loads((folder / "study.json").read_text())
    change(manifest)
    (folder / "study.json").write_text(json.dumps(manifest))


def storage_of(folder: Path) -> tuple:
    url = f"sqlite:///{folder / 'study.db'}"
    return optuna.load_study(study_name="torchrig", storage=url), optuna.storages.RDBStorage(url)


def plant_package(root: Path, marker: Path) -> None:
    """``pkg.payload:build`` under the current directory: importing it writes ``marker``."""
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "payload.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                             "def build(cfg):\n    raise SystemExit('payload')\n")


def resume_cli(capsys, *args: str) -> tuple[int, str]:
    from torchrig.cli import main

    code = main(["tune", "--study-dir", "s", "--resume", *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("key", ["model.factory", "data.factory", "loss", "metrics[0]"])
def test_a_factory_named_by_study_json_is_never_imported(tmp_path, monkeypatch, capsys, key):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    plant_package(tmp_path, marker)
    section, _, name = key.partition(".")
    planted = {"model.factory": {"model": {name: "pkg.payload:build"}},
               "data.factory": {"data": {name: "pkg.payload:build"}},
               "loss": {"loss": "pkg.payload:build"}, "metrics[0]": {"metrics": ["pkg.payload:build"]}}[key]
    new_study(tmp_path / "s", **planted)
    option = {"model": "--model pkg.payload:build", "data": "--data pkg.payload:build", "loss":
              "--set loss=pkg.payload:build"}.get(section, "--set metrics=[pkg.payload:build]")
    assert resume_cli(capsys) == (1, f"torchrig: error: --resume: '{Path('s') / 'study.json'}' names {key} "
                                     f"'pkg.payload:build', code that torchrig imports only when this command line "
                                     f"names it: add {option} if it is yours, or start a new study")
    assert not marker.exists() and "pkg.payload" not in sys.modules


@pytest.mark.parametrize("params, message", [
    ({"optim.lr": 3e-3, "model.factory": "pkg.payload:build"},
     "sets 'model.factory' to 'pkg.payload:build', a key torchrig tune sets itself, never searched"),
    ({"optim.lr": 3e-3, "data.path": "/etc"}, "sets 'data.path' to '/etc', a key the study's search space does not hold"),
    ({"optim.lr": 0.5}, "sets 'optim.lr' to 0.5, outside the study's search space (choice of 0.003, 0.002)"),
], ids=["factory", "unsearched", "outside"])
def test_a_running_trial_read_back_sets_only_the_spaces_values(tmp_path, monkeypatch, capsys, params, message):
    """A RUNNING trial written into study.db through Optuna's storage API (``set_trial_param``), as a resume would
    continue it first: refused before anything is imported or built."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    plant_package(tmp_path, marker)
    study, storage = storage_of(new_study(tmp_path / "s", trials=2))
    trial = study.ask()
    for key, value in params.items():
        storage.set_trial_param(trial._trial_id, key, 0, optuna.distributions.CategoricalDistribution([value]))
    assert [t.state.name for t in study.get_trials()] == ["RUNNING"]
    code, err = resume_cli(capsys)
    assert code == 1 and err.startswith(f"torchrig: error: trial 0 in '{Path('s') / 'study.db'}' {message}")
    assert "\n" not in err and err.endswith("start a new study with another --study-dir")
    assert not marker.exists() and not (tmp_path / "s" / "trials").exists()


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    return sock


def _connections(sock: socket.socket) -> int:
    n = 0
    while True:
        try:
            sock.accept()[0].close()
        except BlockingIOError:
            return n
        n += 1


@pytest.mark.parametrize("attack", ["dist.init_method", "log.mlflow_uri"])
def test_a_study_json_reaches_no_host(tmp_path, monkeypatch, capsys, attack):
    """``dist.init_method`` (as rank 1 of 2) or an MLflow tracker at a listener of the attacker's: the resumed
    study trains its trial with this command's settings, and the listener receives no connection."""
    monkeypatch.chdir(tmp_path)
    listener = _listener()
    port = listener.getsockname()[1]
    if attack == "dist.init_method":
        planted = {"dist": {"init_method": f"tcp://127.0.0.1:{port}", "rank": 1, "world_size": 2, "timeout": 20.0}}
    else:
        planted = {"log": {"trackers": ["mlflow"], "mlflow_uri": f"http://127.0.0.1:{port}"}}
    new_study(tmp_path / "s", **planted)
    try:
        result = torchrig.tune(None, None, None, study_dir="s", resume=True, out=lambda s: None)
        assert result.best_trial == 0
        assert _connections(listener) == 0
    finally:
        listener.close()
    saved = __import__("yaml").safe_load((tmp_path / "s/trials/0/checkpoints/latest/config.yaml").read_text())
    assert (saved["dist"]["init_method"], saved["dist"]["rank"], saved["log"]["trackers"], saved["log"]["mlflow_uri"]) \
        == (None, None, [], None)
    err = capsys.readouterr().err
    noted = f"'{Path('s') / 'study.json'}' names dist.init_method=tcp://127.0.0.1:{port}, dist.rank=1, dist.world_size=2"
    assert (noted in err) == (attack == "dist.init_method")


@pytest.mark.parametrize("key", ["dist.init_method", "log.mlflow_uri", "checkpoint.keep_last"])
def test_a_space_read_back_searches_no_key_of_this_command(tmp_path, monkeypatch, capsys, key):
    """study.json's space searching a key its config may not set (each trial would set it): refused, unless
    --space gives that space again; the listener it names receives no connection."""
    monkeypatch.chdir(tmp_path)
    listener = _listener()
    port = listener.getsockname()[1]
    values = {"dist.init_method": [f"tcp://127.0.0.1:{port}"], "log.mlflow_uri": [f"http://127.0.0.1:{port}"],
              "checkpoint.keep_last": [1]}[key]
    new_study(tmp_path / "s", trials=2)
    edit(tmp_path / "s", lambda m: m["space"].update({key: {"choice": values}}))
    try:
        assert resume_cli(capsys) == (1, f"torchrig: error: --resume: the search space in '{Path('s') / 'study.json'}' "
                                         f"searches '{key}', a key that a study folder may not decide (this command "
                                         f"line does); add --space FILE if that space is yours, or start a new study "
                                         f"with another --study-dir")
        assert _connections(listener) == 0
    finally:
        listener.close()


def test_a_storage_named_by_study_json_is_never_opened(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    url = f"sqlite:///{elsewhere / 'evil.db'}"
    new_study(tmp_path / "s")
    edit(tmp_path / "s", lambda m: m.update(storage=url))
    assert resume_cli(capsys) == (1, f"torchrig: error: --resume: '{Path('s') / 'study.json'}' says the study's trials "
                                     f"are in the storage '{url}'; torchrig opens only a storage this command line "
                                     f"names: add --storage URL if that storage is yours, or start a new study with "
                                     f"another --study-dir")
    assert list(elsewhere.iterdir()) == []


def test_the_study_database_is_never_reached_through_a_link(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim.db"
    new_study(tmp_path / "s")
    os.replace(tmp_path / "s" / "study.db", victim)
    before = victim.read_bytes()
    (tmp_path / "s" / "study.db").symlink_to(victim)
    assert resume_cli(capsys) == (1, f"torchrig: error: '{Path('s') / 'study.db'}' is a symbolic link, not the study's "
                                     f"own database file; start a new study in another --study-dir")
    assert victim.read_bytes() == before


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()} | {
        str(p.relative_to(folder)): os.readlink(p).encode() for p in folder.rglob("*") if p.is_symlink()}


@pytest.fixture(scope="module")
def victim_run(tmp_path_factory) -> Path:
    """One of the user's own runs: a real checkpoint of one epoch."""
    run = tmp_path_factory.mktemp("user") / "run"
    run_train(build_config(None, ["epochs=1", *QUIET, f"run_dir={run}"]), out=lambda s: None)
    assert (run / "checkpoints" / "latest" / "model.safetensors").exists()
    return run


def test_a_trial_folder_linked_to_another_run_is_refused(tmp_path, monkeypatch, capsys, victim_run):
    """trials/2, a RUNNING trial, linked to a run of the user's, with ``resume_changes: allow`` and ``keep_last: 1``
    in study.json: the run is neither trained on nor pruned; every byte stays."""
    monkeypatch.chdir(tmp_path)
    before = _files(victim_run)
    folder = new_study(tmp_path / "s", trials=3, epochs=2, resume_changes="allow", checkpoint={"keep_last": 1})
    study, _ = storage_of(folder)
    for value in (0.9, 0.8):
        study.tell(study.ask(optuna_space()), value)
    study.ask(optuna_space())
    (folder / "trials").mkdir()
    (folder / "trials" / "2").symlink_to(victim_run, target_is_directory=True)
    assert resume_cli(capsys) == (1, f"torchrig: error: '{Path('s') / 'trials' / '2'}' is a symbolic link (to "
                                     f"'{victim_run}'), not a folder the study made; torchrig never trains a trial "
                                     f"through a link: remove it, or start a new study with another --study-dir")
    assert _files(victim_run) == before


def optuna_space() -> dict:
    from torchrig.tune.space import load_space

    return load_space(SPACE, build_config()).distributions()


def test_a_trial_folder_the_study_did_not_make_is_refused(tmp_path, monkeypatch, capsys):
    """A file where a running trial's folder would be; a folder there before the trial was asked (it is failed, so
    that no later resume trains in it)."""
    monkeypatch.chdir(tmp_path)
    study, _ = storage_of(new_study(tmp_path / "s", trials=2))
    study.ask(optuna_space())
    (tmp_path / "s" / "trials").mkdir()
    (tmp_path / "s" / "trials" / "0").write_text("")
    assert resume_cli(capsys) == (1, f"torchrig: error: '{Path('s') / 'trials' / '0'}' is a file, not a "
                                     f"folder the study made; remove it, or start a new study with another --study-dir")
    (tmp_path / "s" / "trials" / "0").unlink()
    study.tell(0, 0.5)
    (tmp_path / "s" / "trials" / "1").mkdir()
    (tmp_path / "s" / "trials" / "1" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert resume_cli(capsys) == (1, f"torchrig: error: '{Path('s') / 'trials' / '1'}' exists, but trial 1 has just "
                                     f"started: it is not a folder the study made; remove it, or start a new study "
                                     f"with another --study-dir")
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "FAIL"]
    assert (tmp_path / "s" / "trials" / "1" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_resume_takes_no_run_changing_key_from_study_json(tmp_path):
    """The keys a checkpoint's config.yaml may not decide, those that say how to start and how many checkpoints a
    trial keeps come from this command line (the default, or --set); a key that changes what a trial computes
    is compared, and refused in one line when the command line changes it."""
    from torchrig.tune.manifest import resumed_config

    planted = {"run_dir": "/elsewhere", "overwrite": True, "resume": "/elsewhere", "resume_changes": "allow",
               "threads": 64, "device": "cuda:7", "checkpoint": {"keep_last": 1, "keep_best": 0},
               "data": {"num_workers": 64}, "profile": {"steps": [1, 2]}}
    folder = new_study(tmp_path / "s", **planted)
    manifest = json.loads((folder / "study.json").read_text())
    default = build_config(None, [])
    cfg = resumed_config(manifest, folder / "study.json", None, ["checkpoint.keep_last=2"])
    assert (cfg.run_dir, cfg.overwrite, cfg.resume, cfg.resume_changes, cfg.threads, cfg.device) == \
        (None, False, None, default.resume_changes, default.threads, default.device)
    assert (cfg.checkpoint.keep_last, cfg.checkpoint.keep_best, cfg.data.num_workers, cfg.profile.steps) == \
        (2, default.checkpoint.keep_best, default.data.num_workers, [])
    assert cfg.epochs == 1  # what the trials compute is the study's
    with pytest.raises(TuneError) as info:
        resumed_config(manifest, folder / "study.json", None, ["optim.lr=0.5"])
    assert str(info.value) == (f"--resume: the config differs from the one the study in '{folder}' started with: "
                               f"optim.lr=0.5 (was 0.003); resume with the same config (or none), or start a new study "
                               f"with another --study-dir")
    manifest["config"]["model"]["weights"] = "pretrained.safetensors"
    with pytest.raises(TuneError, match=r"model.weights=None \(was 'pretrained.safetensors'\); give model.weights on "
                                        r"the command line \(study.json does not decide it\)"):
        resumed_config(manifest, folder / "study.json", None, [])


def test_the_ask_lock_is_never_followed_through_a_link(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    new_study(tmp_path / "s")
    outside = tmp_path / "outside" / "created"
    outside.parent.mkdir()
    (tmp_path / "s" / ".ask.lock").symlink_to(outside)  # dangling: O_CREAT alone would create its target
    assert resume_cli(capsys) == (1, f"torchrig: error: '{Path('s') / '.ask.lock'}' is a symbolic link (to "
                                     f"'{outside}'); torchrig never follows a link in a study folder: remove it and "
                                     f"continue with torchrig tune --study-dir s --resume")
    assert list(outside.parent.iterdir()) == [] and not (tmp_path / "s" / "trials").exists()


@pytest.mark.parametrize("depth", [100_000, 100])
def test_a_deeply_nested_study_json_is_one_line(tmp_path, monkeypatch, capsys, depth):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "study.json").write_text('{"space": ' + "[" * depth + "]" * depth + "}")
    assert resume_cli(capsys) == (1, f"torchrig: error: '{Path('s') / 'study.json'}' is not a torchrig study manifest "
                                     f"(its values nest more than 64 levels deep); start a new study in another "
                                     f"--study-dir")


# ----------------------------------------------------------------------------- a full disk during a trial


def trials_of(folder: Path) -> list[tuple]:
    study = optuna.load_study(study_name="torchrig", storage=f"sqlite:///{folder / 'study.db'}")
    return [(t.number, t.state.name, t.params, t.value, dict(t.intermediate_values)) for t in study.get_trials()]


def test_a_full_disk_during_a_trial_leaves_it_to_the_resume(tmp_path, monkeypatch):
    """ENOSPC while trial 0 saves its checkpoint: one line with tune's remedy; the trial is not failed but kept
    running, and ``--resume`` runs it, so the study ends as one never stopped."""
    import torchrig.checkpoint.manager as manager

    monkeypatch.chdir(tmp_path)
    args = dict(overrides=["epochs=1", *QUIET], out=lambda s: None)
    torchrig.tune(None, SPACE, 1, study_dir="whole", **args)
    real_save = manager.safe_torch_save

    def full(state, path, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(manager, "safe_torch_save", full)
    with pytest.raises(TuneError) as info:
        torchrig.tune(None, SPACE, 1, study_dir="broken", **args)
    assert str(info.value) == (
        f"trial 0 stopped: no space left on device while saving checkpoint step 36 to "
        f"{Path('broken') / 'trials' / '0' / 'checkpoints'}; it is kept as running and continues from its latest "
        f"checkpoint: free some space, then continue the study with torchrig tune --study-dir broken --resume")
    assert [t[1] for t in trials_of(tmp_path / "broken")] == ["RUNNING"]
    monkeypatch.setattr(manager, "safe_torch_save", real_save)
    torchrig.tune(None, None, None, study_dir="broken", resume=True, out=lambda s: None)
    assert trials_of(tmp_path / "broken") == trials_of(tmp_path / "whole")


def test_the_summary_counts_what_the_table_shows(tmp_path, monkeypatch, capsys):
    """A trial whose loss is not finite is failed: ``failed`` in the table, in trials.csv and in the count."""
    monkeypatch.chdir(tmp_path)
    torchrig.tune(None, {"optim.lr": {"choice": [1e30]}}, 1, overrides=["epochs=1", *QUIET], study_dir="s")
    out = capsys.readouterr().out
    assert "tune: 1 trials · 0 complete · 0 pruned · 1 failed" in out
    row = out[out.index("trial  state"):].splitlines()[1].split()
    assert row[:2] == ["0", "failed"]
    assert (tmp_path / "s" / "trials.csv").read_text().splitlines()[1].split(",")[1] == "failed"
