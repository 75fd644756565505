"""Files that would hang a run or fill its memory: a FIFO, /dev/zero, a huge file, a YAML "billion laughs".

torchrig reads only regular files (checked on the open descriptor, opened without blocking), small kinds
of file up to a cap (a config file 1 MiB, meta.json / index.json 16 MiB), and YAML whose aliases repeat
at most 10,000 values. Each case runs the real command in a child process with a timeout (a FIFO that
blocked would fail the test, not hang it) and a 3 GiB data limit (/dev/zero read whole would fail it with
a MemoryError, not eat the machine), and expects one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import forkserver, record_checksums, subprocess_env

from torchrig.config import ConfigError, load_config

STEP = "step-00000002"
QUICK = ["--set", "epochs=1", "--set", "max_steps=2", "--set", "log.plot=false", "--set", "log.tensorboard=false",
         "--set", "log.progress=none"]
OTHER = "use another checkpoint (RUN_DIR/checkpoints/)"


def _torchrig(*args: str, cwd: Path) -> tuple[int, list[str]]:
    """``python -m torchrig ARGS`` with a timeout and a 3 GiB data limit, forked from the tests' fork server (the
    command's own main, in a process of its own, without an interpreter start)."""
    r = forkserver.run(["-m", "torchrig", *args], cwd=cwd, env=subprocess_env(), timeout=180,
                       rlimits={"RLIMIT_DATA": (3 << 30, 3 << 30)})
    return r.returncode, r.stderr.strip().splitlines()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kinds")
    code, err = _torchrig("train", *QUICK, "--set", f"run_dir={root / 'run'}", cwd=root)
    assert code == 0, err
    return root / "run"


@pytest.fixture
def run(built, tmp_path) -> Path:
    return Path(shutil.copytree(built, tmp_path / "run", symlinks=True))


def _bomb(levels: int = 9) -> str:
    """A ~1 KB YAML mapping whose aliases stand for 9**levels strings."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _plant(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "bomb":
        path.write_text("recipe: digits\nmodel:\n  options:\n" + "".join(f"    {line}\n" for line in
                                                                             _bomb().splitlines()))


# file in the checkpoint, what is put there, what the line says it is
CHECKPOINT_CASES = [("state.pt", "fifo", "a FIFO"), ("meta.json", "fifo", "a FIFO"), ("config.yaml", "fifo", "a FIFO"),
                    ("model.safetensors", "fifo", "a FIFO"), ("config.yaml", "dev-zero", "a character device"),
                    ("meta.json", "dev-zero", "a character device")]


@pytest.mark.parametrize("name, kind, what", CHECKPOINT_CASES, ids=[f"{n}-{k}" for n, k, _ in CHECKPOINT_CASES])
def test_evaluate_refuses_a_checkpoint_file_that_is_not_a_regular_file(run, name, kind, what):
    ckpt = run / "checkpoints" / STEP
    _plant(ckpt / name, kind)
    code, err = _torchrig("evaluate", "--checkpoint", str(ckpt), cwd=run.parent)
    assert (code, err) == (1, [f"torchrig: error: checkpoint file '{ckpt / name}' is {what}, not a regular file; "
                               f"{OTHER}"])


@pytest.mark.parametrize("kind, what", [("fifo", "a FIFO"), ("dev-zero", "a character device")])
def test_resume_refuses_an_index_that_is_not_a_regular_file(run, kind, what):
    index = run / "checkpoints" / "index.json"
    _plant(index, kind)
    code, err = _torchrig("train", *QUICK, "--set", f"run_dir={run}", "--set", "resume=latest", cwd=run.parent)
    assert (code, err[-1:]) == (1, [f"torchrig: error: checkpoint index '{index}' is {what}, not a regular file; "
                                    f"remove it (it is rebuilt from the checkpoints beside it)"])


def test_resume_refuses_a_metrics_file_that_is_a_fifo(run):
    _plant(run / "metrics.jsonl", "fifo")
    code, err = _torchrig("train", *QUICK, "--set", f"run_dir={run}", "--set", "resume=latest", "--set",
                          "max_steps=3", cwd=run.parent)
    assert (code, err[-1:]) == (1, [f"torchrig: error: metrics file '{run / 'metrics.jsonl'}' is a FIFO, not a "
                                    f"regular file; move it away, or choose another run_dir"])


def test_a_billion_laughs_in_a_checkpoint_config_is_refused(run):
    ckpt = run / "checkpoints" / STEP
    _plant(ckpt / "config.yaml", "bomb")
    record_checksums(ckpt)  # crafted whole: the checksums match
    assert (ckpt / "config.yaml").stat().st_size < 1200
    code, err = _torchrig("evaluate", "--checkpoint", str(ckpt), cwd=run.parent)
    assert (code, err) == (1, [f"torchrig: error: checkpoint file '{ckpt / 'config.yaml'}' repeats 4412961486 values "
                               f"through aliases (*name), more than the 10000 torchrig reads (a \"billion laughs\" "
                               f"would fill the memory); write the values out, or repeat fewer of them"])


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "bomb", "huge"])
def test_train_refuses_a_config_file_that_would_hang_or_fill_the_memory(tmp_path, kind):
    path = tmp_path / "config.yaml"
    if kind == "huge":
        path.write_text("# padding\n" * 120_000)  # 1.1 MiB of comments
    else:
        _plant(path, kind)
    shown = "/dev/zero" if kind == "dev-zero" else path
    code, err = _torchrig("train", str(shown), *QUICK, "--set", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    expected = {
        "dev-zero": "config file '/dev/zero' is a character device, not a regular file; pass a YAML config file",
        "fifo": f"config file '{path}' is a FIFO, not a regular file; pass a YAML config file",
        "bomb": f"config file '{path}' repeats 4412961486 values through aliases (*name), more than the 10000 torchrig "
                f"reads (a \"billion laughs\" would fill the memory); write the values out, or repeat fewer of them",
        "huge": f"config file '{path}' is 1.14 MiB, more than the 1 MiB such a file may hold; pass a YAML config file",
    }[kind]
    assert (code, err) == (1, [f"torchrig: error: {expected}"])
    assert not (tmp_path / "run").exists()


def test_aliases_that_repeat_little_still_work(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("optim: {lr: &lr 0.01}\nscheduler: {name: onecycle, max_lr: *lr}\n"
                    "model: {options: {a: &blocks [64, 64, 128], b: *blocks}}\n")
    cfg = load_config(path)
    assert cfg.scheduler.max_lr == 0.01 and cfg.model.options == {"a": [64, 64, 128], "b": [64, 64, 128]}


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("model: {options: &me {self: *me}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"config file '{path}' holds an alias inside its own anchor (a value that contains "
                              f"itself); write the value out instead")


def test_a_billion_laughs_in_a_set_value_is_refused():
    value = "{" + _bomb().replace("\n", ", ").rstrip(", ") + "}"
    with pytest.raises(ConfigError, match=r"^the value '.*' repeats 4412961486 values through aliases"):
        load_config(overrides=[f"model.options={value}"])


# ----------------------------------------------------------------------------- a run folder's own files

READ_RUN_FOLDER = r"""
import contextlib, io, json, sys
from pathlib import Path
from torchrig.checkpoint.rundir import trim_metrics
from torchrig.observe.plot import read_rows
from torchrig.observe.trackers import TrackerSet
from torchrig.trainer.spikes import keep_ledger

run, results = Path(sys.argv[1]), {}
for name, read in (("trackers.json", lambda: TrackerSet.open([], run, {}, start_step=5)),
                   ("csv/metrics.csv", lambda: TrackerSet.open(["csv"], run, {}, start_step=5)),
                   ("skipped_samples.jsonl", lambda: keep_ledger(run, [])),
                   ("metrics.jsonl", lambda: read_rows(run)),
                   ("trim metrics.jsonl", lambda: trim_metrics(run / "metrics.jsonl", 5))):
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            read()
        results[name] = said.getvalue().strip()
    except Exception as exc:
        results[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(results))
"""
# what each reader says (its first words are the file's kind and name), and what to do
RUN_FOLDER_FILES = {
    "trackers.json": ("torchrig: tracker ids file", "each tracker starts a new run", "1 MiB"),
    "csv/metrics.csv": ("TrackerError: tracker file", "move it away, or leave csv out of log.trackers", "1 GiB"),
    "skipped_samples.jsonl": ("RunDirError: skipped samples list", "move it away (the checkpoint itself holds which "
                              "samples are left out)", "16 MiB"),
    "metrics.jsonl": ("PlotError: metrics file", "point at a run directory torchrig wrote", "1 GiB"),
    "trim metrics.jsonl": ("RunDirError: metrics file", "move it away, or choose another run_dir", "1 GiB"),
}


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_a_run_folders_own_files_are_read_as_a_strangers(tmp_path, kind):
    """trackers.json, csv/metrics.csv, skipped_samples.jsonl and metrics.jsonl (plot, the resume's trim) as a
    FIFO (a read would block for ever), /dev/zero (never ends) or a (sparse) file past its kind's cap: one line
    each, in a child with a timeout and a 3 GiB data limit, so that a reader that hangs or fills the memory fails
    the test instead of the suite."""
    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    for name, (*_, cap) in RUN_FOLDER_FILES.items():
        path = run / name.split()[-1]
        if kind == "huge":
            size = {"1 MiB": 1 << 21, "16 MiB": 1 << 25, "1 GiB": 3 << 29}[cap]
            with open(path, "wb") as fh:
                fh.truncate(size)
        elif not path.exists():
            _plant(path, kind)
    r = forkserver.run(["-c", READ_RUN_FOLDER, str(run)], env=subprocess_env(), timeout=60,
                       rlimits={"RLIMIT_DATA": (3 << 30, 3 << 30)})
    assert r.returncode == 0, r.stderr[-3000:]
    said = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (start, todo, cap) in RUN_FOLDER_FILES.items():
        path = run / name.split()[-1]
        what = {"fifo": "a FIFO, not a regular file", "dev-zero": "a character device, not a regular file",
                "huge": f"{ {'1 MiB': '2 MiB', '16 MiB': '32 MiB', '1 GiB': '1.5 GiB'}[cap]}, more than the {cap} "
                        f"such a file may hold"}[kind]
        if kind == "dev-zero" and name == "trim metrics.jsonl":  # a file rewritten: no link followed at all
            what = "a symbolic link (to '/dev/zero'), not a regular file"
        assert said[name] == f"{start} '{path}' is {what}; {todo}", name
