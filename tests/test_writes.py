"""Writes into a run, study or checkpoint folder never follow a link planted there.

A folder torchrig writes into may come from someone else. Every file goes through the writer of
``torchrig.config.files`` (a new temporary file with a random name, ``O_CREAT | O_EXCL | O_NOFOLLOW``,
fsync, ``os.replace``; appends with ``O_NOFOLLOW``; folders checked not to be links). The first test reads
the package (its syntax tree, as tests/test_layers.py does) for any other way of writing a file; the
others plant symbolic links to a victim file (or folder) outside and check that its bytes are unchanged.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from torchrig.config import files
from torchrig.config.files import UnsafePathError

SRC = Path(__file__).resolve().parent.parent / "src" / "torchrig"

# ----------------------------------------------------------------------------- the package holds no other writer

WRITE_MODES = set("wax+")
# A call writes a file when its name (dotted, as written) is one of these, or ends with one of NAME_ENDS.
NAMES = {"os.replace", "os.rename", "os.symlink", "os.link", "tempfile.mkdtemp", "tempfile.mkstemp",
         "tempfile.NamedTemporaryFile", "np.save", "np.savez", "np.savez_compressed", "numpy.save", "torch.save",
         "torch.export.save", "onnx_program.save", "dcp.save", "dcp.async_save", "wandb.init",
         "optuna.storages.RDBStorage", "torch.cuda.memory._dump_snapshot"}
NAME_ENDS = {"write_text", "write_bytes", "savefig", "to_csv", "symlink_to", "hardlink_to", "export_chrome_trace",
             "save_pretrained", "save_model", "save_file", "SummaryWriter", "MlflowClient", "FileSystemWriter"}

# The module that is the writer.
WRITER = "config/files.py"
# (module, function, call) -> why it may stay. Each must still be found (a stale entry fails too).
ALLOWED = {
    ("checkpoint/io.py", "safe_torch_save.<lambda>", "torch.save"):
        "writes into the file object of files.atomic_file (the checkpoint writer's temporary file)",
    ("runtime/dist.py", "_encode", "torch.save"): "writes into memory (a BytesIO), not a file",
    ("checkpoint/manager.py", "_hardlink_or_copy", "os.link"):
        "copies a checkpoint into a new folder of random name it just made (make_temp_dir): nothing is planted there",
    ("checkpoint/manager.py", "_hardlink_or_copy", "shutil.copy2"): "as os.link, where hard links are not supported",
    ("checkpoint/manager.py", "CheckpointManager._publish", "shutil.copytree"):
        "into a new folder of random name it just made (make_temp_dir)",
    ("checkpoint/manager.py", "CheckpointManager._publish", "os.replace"):
        "renames folders it made in the checked checkpoints folder; a rename moves the name, never follows a link",
    ("checkpoint/manager.py", "CheckpointManager._finish_swap", "os.replace"): "as in _publish",
    ("checkpoint/sharded.py", "_save_async.move_shards", "os.replace"):
        "moves DCP's new folder (made by make_temp_dir) into the new checkpoint folder",
    ("checkpoint/sharded.py", "save", "dcp.save"):
        "library writer (DCP's FileSystemWriter): writes into a new checkpoint folder of random name",
    ("checkpoint/sharded.py", "save.write_shards", "dcp.save"): "as above",
    ("checkpoint/sharded.py", "_save_async", "dcp.async_save"):
        "library writer (DCP): writes into a new folder of random name, made by make_temp_dir",
    ("data/datasets/images.py", "export_digits", "os.replace"):
        "renames its own new folder (make_temp_dir) into place; the target is the cache or a folder the user named",
    ("observe/plot.py", "save_figure", "savefig"): "renders into memory (a BytesIO); the bytes go to write_atomic",
    ("observe/profiling.py", "Profiler._stop", "export_chrome_trace"):
        "library writer: writes into a new folder of random name (files.staged), renamed into place",
    ("observe/profiling.py", "Profiler._stop", "torch.cuda.memory._dump_snapshot"): "as export_chrome_trace",
    ("observe/trackers.py", "EventThread._run", "SummaryWriter"):
        "library writer (TensorBoard's event files): RUN_DIR/tensorboard is checked not to be a link first "
        "(make_dir); its file names hold the time, host and PID",
    ("observe/trackers.py", "MLflowTracker.start", "MlflowClient"):
        "library writer (MLflow's store): the default mlruns folder is checked not to be a link first (make_dir)",
    ("observe/trackers.py", "WandbTracker.start", "wandb.init"):
        "library writer (W&B's run files): RUN_DIR/wandb is checked not to be a link first (make_dir)",
    ("export/exporter.py", "_write_torch_export", "torch.export.save"):
        "library writer: to the path of files.staged (a new folder of random name), renamed into place once checked",
    ("export/exporter.py", "_write_onnx", "onnx_program.save"): "as torch.export.save",
    ("export/exporter.py", "_write_safetensors", "save_model"): "as torch.export.save",
    ("export/exporter.py", "_write_hf", "save_pretrained"): "as torch.export.save",
    ("export/finetuned.py", "adapter_format.write", "save_pretrained"): "peft's writer of the adapter folder, as "
                                                                       "torch.export.save",
    ("tune/study.py", "open_storage", "optuna.storages.RDBStorage"):
        "library writer (SQLite): the study database and its journals are refused when they are links",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _write_call(call: ast.Call) -> str | None:
    """What ``call`` is, when it writes a file; else None."""
    name = _dotted(call.func)
    if name in ("open", "io.open", "os.fdopen"):
        mode = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "mode"), None)
        if mode is None:
            return None
        if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)):
            return f"{name} with a computed mode"
        return f"{name}(…, {mode.value!r})" if set(mode.value) & WRITE_MODES else None
    if name == "os.open" and len(call.args) > 1:
        flags = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in ast.walk(call.args[1])}
        return "os.open with O_CREAT" if "O_CREAT" in flags else None
    last = name.rsplit(".", 1)[-1]
    if name in NAMES or name.startswith("shutil.copy") or last in NAME_ENDS:
        return last if last in NAME_ENDS else name
    return None


def writes(root: Path) -> dict[tuple[str, str, str], list[int]]:
    """(module, enclosing function, call) -> lines, for every call in ``root`` that writes a file."""
    found: dict[tuple[str, str, str], list[int]] = {}

    def visit(node: ast.AST, scope: list[str], module: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = scope + [child.name]
            elif isinstance(child, ast.Lambda):
                inner = scope + ["<lambda>"]
            if isinstance(child, ast.Call) and (what := _write_call(child)):
                found.setdefault((module, ".".join(scope) or "<module>", what), []).append(child.lineno)
            visit(child, inner, module)

    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module != WRITER:
            visit(ast.parse(path.read_text(), str(path)), [], module)
    return found


def test_every_file_is_written_through_the_one_writer():
    found = writes(SRC)
    other = [f"src/torchrig/{m}:{lines[0]}: {what} in {fn}" for (m, fn, what), lines in sorted(found.items())
             if (m, fn, what) not in ALLOWED]
    assert not other, ("files written around torchrig.config.files (write_atomic, open_append, staged, ...):\n"
                       + "\n".join(other))
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"allowed writers no longer in the package (remove them from ALLOWED): {stale}"


def test_the_scan_finds_each_kind_of_write(tmp_path):
    (tmp_path / "m.py").write_text(
        "import os, shutil\n"
        "def f(p, fig):\n"
        "    open(p, 'a')\n    open(p, mode='wb')\n    open(p)\n    p.write_text('x')\n    fig.savefig(p)\n"
        "    os.open(p, os.O_WRONLY | os.O_CREAT)\n    os.open(p, os.O_RDONLY)\n    shutil.copyfile(p, p)\n"
        "    os.replace(p, p)\n")
    assert sorted(what for (_, fn, what) in writes(tmp_path)) == [
        "open(…, 'a')", "open(…, 'wb')", "os.open with O_CREAT", "os.replace", "savefig", "shutil.copyfile",
        "write_text"]


# ----------------------------------------------------------------------------- the writer itself

@pytest.fixture
def victim(tmp_path) -> Path:
    """A file of the user's outside the folder written into."""
    path = tmp_path / "victim.txt"
    path.write_bytes(b"the user's own bytes\n")
    return path


@pytest.fixture
def run(tmp_path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


def test_write_atomic_replaces_a_planted_link_and_never_writes_through_it(run, victim):
    (run / "best.yaml").symlink_to(victim)
    files.write_atomic(run / "best.yaml", b"new\n")
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert not (run / "best.yaml").is_symlink() and (run / "best.yaml").read_bytes() == b"new\n"
    assert sorted(p.name for p in run.iterdir()) == ["best.yaml"]  # no temporary left


def test_a_temporary_name_cannot_be_planted(run, victim, monkeypatch):
    """The old writers used ``.NAME.tmp`` / ``.NAME.tmp-PID``: every such name planted as a link to the victim is
    now just another file in the folder, never opened."""
    planted = [f".trials.csv.tmp-{pid}" for pid in range(1, 1025)] + [".trials.csv.tmp", ".trials.csv.tmp.png"]
    for name in planted:
        (run / name).symlink_to(victim)
    monkeypatch.setattr(os, "getpid", lambda: 1000)
    files.write_atomic(run / "trials.csv", b"trial,value\n")
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert (run / "trials.csv").read_bytes() == b"trial,value\n"
    assert len(list(run.iterdir())) == len(planted) + 1


def test_random_names_that_are_taken_are_skipped(run, victim, monkeypatch):
    tokens = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(tokens))
    (run / ".x.json.tmp-aaaaaaaaaaaa").symlink_to(victim)
    files.write_atomic(run / "x.json", b"{}")
    assert victim.read_bytes() == b"the user's own bytes\n" and (run / "x.json").read_bytes() == b"{}"


def test_a_folder_that_is_a_link_is_refused_in_one_line(run, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "plots").symlink_to(outside)
    message = (f"'{run / 'plots'}' is a symbolic link (to '{outside}'), not a folder; torchrig writes into a run or "
               f"study folder only through folders of its own, never through a link: remove it, or choose another "
               f"folder")
    for attempt in (lambda: files.write_atomic(run / "plots" / "curves.png", b"png"),
                    lambda: files.make_dir(run / "plots", root=run),
                    lambda: files.make_temp_dir(run / "plots", ".tmp-"),
                    lambda: files.replace_link("step-1", run / "plots" / "latest")):
        with pytest.raises(UnsafePathError) as err:
            attempt()
        assert str(err.value) == message
    assert list(outside.iterdir()) == []


def test_root_is_the_folder_the_user_named_and_may_be_a_link(tmp_path):
    real = tmp_path / "scratch" / "run"
    real.mkdir(parents=True)
    named = tmp_path / "run-link"
    named.symlink_to(real)
    files.make_dir(named / "csv", root=named)
    files.write_atomic(named / "csv" / "params.csv", b"name,value\n", root=named)
    assert (real / "csv" / "params.csv").read_bytes() == b"name,value\n"
    with pytest.raises(UnsafePathError):  # without root, the file's own folder may not be a link
        files.write_atomic(named / "a.txt", b"x")


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_an_append_refuses_a_link_or_a_fifo(run, victim, kind):
    path = run / "metrics.jsonl"
    if kind == "link":
        path.symlink_to(victim)
        what = f"a symbolic link (to '{victim}')"
    else:
        os.mkfifo(path)
        what = "a FIFO"
    with pytest.raises(UnsafePathError) as err:
        files.open_append(path, "metrics file", "move it away, or choose another run_dir")
    assert str(err.value) == (f"metrics file '{path}' is {what}, not a regular file; move it away, or choose another "
                              f"run_dir")
    assert victim.read_bytes() == b"the user's own bytes\n"


def test_staged_replaces_a_link_at_the_target_and_removes_its_folder_on_error(run, victim, tmp_path):
    (run / "model.pt2").symlink_to(victim)
    with files.staged(run / "model.pt2") as new:
        new.write_bytes(b"program")  # what a library writing to a path does
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert not (run / "model.pt2").is_symlink() and (run / "model.pt2").read_bytes() == b"program"
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "hf").symlink_to(outside)
    with files.staged(run / "hf") as new:
        new.mkdir()
        (new / "config.json").write_bytes(b"{}")
    assert list(outside.iterdir()) == [] and (run / "hf" / "config.json").read_bytes() == b"{}"
    with pytest.raises(KeyError), files.staged(run / "x.onnx") as new:
        new.write_bytes(b"half")
        raise KeyError("check failed")
    assert sorted(p.name for p in run.iterdir()) == ["hf", "model.pt2"]


def test_the_checkpoint_writer_keeps_its_checksum_and_refuses_a_linked_folder(run, victim, tmp_path):
    import hashlib

    from torchrig.checkpoint.io import write_bytes_atomic, write_json_atomic

    (run / ".PRUNED.tmp-1").symlink_to(victim)
    data = b"pruned\n"
    assert write_bytes_atomic(run / "PRUNED", data, root=run) == f"sha256:{hashlib.sha256(data).hexdigest()}"
    write_json_atomic(run / "trial.json", {"a": 1}, root=run)
    assert json.loads((run / "trial.json").read_text()) == {"a": 1}
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "trials").mkdir()
    (run / "trials" / "2").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        write_json_atomic(run / "trials" / "2" / "trial.json", {"a": 1})
    assert victim.read_bytes() == b"the user's own bytes\n" and list(outside.iterdir()) == []


# ----------------------------------------------------------------------------- the files of a run


def test_a_resumed_runs_metrics_file_that_is_a_link_is_refused(run, victim):
    from torchrig.checkpoint.rundir import RunDirError
    from torchrig.observe.run_logger import RunLogger

    victim.write_bytes(b'{"step": 1}\n')  # reads as metrics up to the resumed step: nothing to cut
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(RunDirError) as err:
        RunLogger(run, progress="none", tensorboard=False, start_step=5)
    assert str(err.value) == (f"metrics file '{run / 'metrics.jsonl'}' is a symbolic link (to '{victim}'), not a "
                              f"regular file; move it away, or choose another run_dir")
    assert victim.read_bytes() == b'{"step": 1}\n'


def test_a_resumed_runs_metrics_file_that_is_a_hard_link_is_refused(run, victim):
    from torchrig.checkpoint.rundir import RunDirError
    from torchrig.observe.run_logger import RunLogger

    victim.write_bytes(b'{"step": 1}\n')  # nothing to cut at step 5: the file would be appended to as it is
    os.link(victim, run / "metrics.jsonl")
    with pytest.raises(RunDirError) as err:
        RunLogger(run, progress="none", tensorboard=False, start_step=5)
    assert str(err.value) == (f"metrics file '{run / 'metrics.jsonl'}' is a hard link (2 names of one file), not a "
                              f"file of this run's own; move it away, or choose another run_dir")
    assert victim.read_bytes() == b'{"step": 1}\n'


def test_tracker_files_replace_planted_links(run, victim):
    from torchrig.observe.trackers import CSVTracker, _write_ids

    (run / "trackers.json.tmp").symlink_to(victim)  # the old writer's fixed temporary name
    _write_ids(run / "trackers.json", {"mlflow": "abc"})
    (run / "csv").mkdir()
    (run / "csv" / "metrics.csv").symlink_to(victim)
    (run / "csv" / "params.csv").symlink_to(victim)
    tracker = CSVTracker()
    tracker.start({"seed": 1}, run, None)
    tracker.log({"loss": 0.5}, 1)
    tracker.finish({"loss": 0.5})
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert json.loads((run / "trackers.json").read_text()) == {"mlflow": "abc"}
    assert (run / "csv" / "metrics.csv").read_text().splitlines() == ["step,name,value", "1,loss,0.5"]
    assert not (run / "csv" / "params.csv").is_symlink()


def test_classes_json_replaces_a_planted_link(run, victim):
    from torchrig.recipes import get_recipe
    from torchrig.recipes.run import build_config

    (run / "classes.json").symlink_to(victim)
    cfg = build_config(None, ["image.classes=[a, b]"], "image-classification")
    get_recipe("image-classification").save_artifacts(cfg, run)
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert json.loads((run / "classes.json").read_text())["classes"] == ["a", "b"]


def test_plots_never_follow_a_planted_link(run, victim, tmp_path, capsys):
    from torchrig.observe.plot import plot_run_or_say, plot_runs

    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    (run / "plots").mkdir()
    (run / "plots" / ".curves.png.tmp.png").symlink_to(victim)  # the old writer's fixed temporary name
    assert plot_runs([run]) == run / "plots" / "curves.png"
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert (run / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    outside = tmp_path / "outside"
    outside.mkdir()
    (run / "plots" / "curves.png").unlink()
    (run / "plots" / ".curves.png.tmp.png").unlink()
    (run / "plots").rmdir()
    (run / "plots").symlink_to(outside)
    assert plot_run_or_say(run, print) == []  # the end-of-run plot: one line, never a failed run
    assert capsys.readouterr().out == (
        f"torchrig: no plots written ('{run / 'plots'}' is a symbolic link (to '{outside}'), not a folder; torchrig "
        f"writes into a run or study folder only through folders of its own, never through a link: remove it, or "
        f"choose another folder)\n")
    assert list(outside.iterdir()) == []


def test_checkpoints_never_follow_a_planted_link(run, victim, tmp_path, monkeypatch):
    from torch import nn

    from torchrig.checkpoint.manager import CheckpointManager

    folder = run / "checkpoints"
    folder.mkdir()
    for pid in range(1, 300):  # the old writers' names: .latest.tmp-PID, .tmp-step-N-PID/, .index.json.tmp-PID
        for name in (f".latest.tmp-{pid}", f".index.json.tmp-{pid}", f".tmp-step-00000001-{pid}"):
            (folder / name).symlink_to(victim)
    monkeypatch.setattr(os, "getpid", lambda: 100)
    manager = CheckpointManager(run)
    states = {"model": nn.Linear(2, 2), "optimizers": {}}
    assert manager.save(1, states, config=None, meta={}) == folder / "step-00000001"
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert os.readlink(folder / "latest") == "step-00000001"
    outside = tmp_path / "outside"
    outside.mkdir()
    other = tmp_path / "other"
    (other / "checkpoints").parent.mkdir()
    (other / "checkpoints").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        CheckpointManager(other).clean_partial()  # at the start of a run: before any step is trained
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        CheckpointManager(other).save(1, {"model": nn.Linear(2, 2), "optimizers": {}}, config=None, meta={})
    assert list(outside.iterdir()) == []


def test_a_study_database_or_lock_that_is_a_link_is_refused(run, victim, tmp_path):
    from torchrig.tune.space import TuneError
    from torchrig.tune.study import ask_lock, open_storage

    (run / "study.db-journal").symlink_to(victim)
    with pytest.raises(TuneError) as err:
        open_storage(None, run)
    assert str(err.value) == (f"study file '{run.resolve() / 'study.db-journal'}' is a symbolic link (to '{victim}'), "
                              f"not a regular file; remove it, or start a new study in another --study-dir")
    (run / ".ask.lock").symlink_to(tmp_path / "not-yet")  # dangling: O_CREAT would make it
    with pytest.raises(TuneError, match="is a symbolic link"), ask_lock(run):
        pass
    assert not (tmp_path / "not-yet").exists() and victim.read_bytes() == b"the user's own bytes\n"


# ----------------------------------------------------------------------------- torchrig export


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from torchrig.cli import main

    run = tmp_path_factory.mktemp("writes") / "digits"
    assert main(["train", "--set", "log.plot=false", "--set", "log.tensorboard=false", "--set", "log.progress=none",
                 "--set", "max_steps=1", "--set", f"run_dir={run}"]) == 0
    return run


def test_export_refuses_a_linked_export_folder_and_replaces_a_linked_output(digits, victim, tmp_path, capsys):
    from torchrig.cli import main

    outside = tmp_path / "outside"
    outside.mkdir()
    (digits / "export").symlink_to(outside)
    try:
        assert main(["export", "--checkpoint", str(digits), "--format", "safetensors"]) == 1
    finally:
        (digits / "export").unlink()
    assert capsys.readouterr().err.splitlines() == [
        f"torchrig: error: '{digits / 'export'}' is a symbolic link (to '{outside}'), not a folder; torchrig writes "
        f"into a run or study folder only through folders of its own, never through a link: remove it, or choose "
        f"another folder"]
    assert list(outside.iterdir()) == []
    out = digits / "weights.safetensors"
    out.symlink_to(victim)
    assert main(["export", "--checkpoint", str(digits), "--format", "safetensors", "--output", str(out)]) == 1
    assert "already exists; choose another path or add --overwrite" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(digits), "--format", "safetensors", "--output", str(out),
                 "--overwrite"]) == 0
    assert victim.read_bytes() == b"the user's own bytes\n"
    assert not out.is_symlink() and out.stat().st_size > 1000
    assert sorted(p.name for p in digits.iterdir() if ".tmp-" in p.name) == []
