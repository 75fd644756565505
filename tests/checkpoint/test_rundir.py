"""One run per run directory: the lock (real processes), the "holds a run" refusal, overwrite=true,
numbered run directories, metrics.jsonl that never mixes runs, and metrics.jsonl write errors."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import PYTHON, forkserver, read_jsonl, subprocess_env

from torchrig.checkpoint import resolve
from torchrig.checkpoint.rundir import LOCK_NAME, RunDirError, RunLock, numbered_run_dir, trim_metrics

STARTED = r"\(started \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\)"

# A process that opens a run directory the way fit() does, says so, and then waits to be killed.
HOLDER = """
import sys, time, torch, torchrig
trainer = torchrig.Trainer(torch.nn.Linear(2, 2), run_dir=sys.argv[1], tensorboard=False, plot=False, progress="none")
trainer.open_run()
open(sys.argv[2], "w").close()
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """``start(run_dir)``: a live process holding ``run_dir``; killed at the end of the test."""
    procs = []

    def start(run_dir: Path) -> subprocess.Popen:
        ready = tmp_path / f"ready-{len(procs)}"
        proc = forkserver.popen(["-c", HOLDER, run_dir, ready], env=subprocess_env())  # a fork: a process, not an interpreter
        procs.append(proc)
        deadline = time.time() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "the holder did not open its run directory"
            time.sleep(0.05)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


QUIET = ["--set", "epochs=1", "--set", "max_steps=2", "--set", "log.plot=false", "--set", "log.tensorboard=false",
         "--set", "log.progress=none"]


# ----------------------------------------------------------------------------- the lock


def test_second_process_fails_at_once_naming_pid_and_host(tmp_path, holder, capsys):
    from torchrig.cli import main

    run = tmp_path / "run"
    first = holder(run)  # one process holds the run directory; this test's process is the second
    start = time.perf_counter()
    assert main(["train", *QUIET, "--set", f"run_dir={run}"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"torchrig: error: run_dir '{re.escape(str(run))}' is in use by PID {first.pid} on host "
                        rf"{re.escape(socket.gethostname())} {STARTED}; wait for it, or choose another run_dir",
                        lines[0]), lines[0]
    assert time.perf_counter() - start < 3  # at once: before building the data and the model
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # and wrote nothing into the holder's run
    assert first.poll() is None


def test_stale_lock_of_a_killed_process_is_taken_over(tmp_path, holder, make_trainer, data):
    run = tmp_path / "run"
    first = holder(run)
    assert f"PID {first.pid} " in (run / LOCK_NAME).read_text()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    trainer = make_trainer(run_dir=str(run))
    trainer.open_run()  # no error: the dead process's lock file is simply taken over
    assert (run / LOCK_NAME).read_text().startswith(f"PID {os.getpid()} on host {socket.gethostname()} (started ")
    trainer.fit(data)
    assert trainer.global_step == 5
    RunLock(run).acquire()  # fit released it


def test_two_trainers_in_one_process(make_trainer, data, run_dir):
    first = make_trainer()
    first.open_run()
    with pytest.raises(RunDirError) as err:
        make_trainer().fit(data)
    assert re.fullmatch(rf"run_dir '{re.escape(str(run_dir))}' is in use by PID {os.getpid()} on host "
                        rf"{re.escape(socket.gethostname())} {STARTED}; wait for it, or choose another run_dir",
                        str(err.value))
    first.fit(data)  # the holder goes on; the lock is free after its fit
    first.close()
    make_trainer(resume="latest").fit(data)


def test_second_process_fit_is_refused_naming_the_holder(tmp_path, holder, make_trainer, data):
    """Trainer.fit itself (not the command line's early check) refuses a run directory another process holds."""
    run = tmp_path / "run"
    first = holder(run)
    with pytest.raises(RunDirError) as err:
        make_trainer(run_dir=str(run)).fit(data)
    assert re.fullmatch(rf"run_dir '{re.escape(str(run))}' is in use by PID {first.pid} on host "
                        rf"{re.escape(socket.gethostname())} {STARTED}; wait for it, or choose another run_dir",
                        str(err.value)), str(err.value)
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written into the holder's run
    assert first.poll() is None


# Started twice at once on one run directory: each waits for the go file, then trains 5 slow steps (long
# enough that the other's start falls inside them) and prints what happened.
RACER = """
import os, sys, time, torch, torchrig
from torch.utils.data import TensorDataset
from torchrig.checkpoint.rundir import RunDirError

class Slow:
    def on_step_end(self, trainer, outputs):
        time.sleep(0.4)

torch.manual_seed(0)
data = TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,)))
trainer = torchrig.Trainer(torch.nn.Linear(8, 4), run_dir=sys.argv[1], epochs=1, batch_size=8, num_workers=0,
                           callbacks=[Slow()], tensorboard=False, plot=False, progress="none")
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.005)
try:
    trainer.fit(data)
    print(f"TRAINED {trainer.global_step}")
except RunDirError as exc:
    print(f"REFUSED {exc}")
"""


def test_simultaneous_starts_exactly_one_trains(tmp_path):
    run, go = tmp_path / "run", tmp_path / "go"
    procs = []
    for i in range(2):
        ready = tmp_path / f"ready-{i}"
        procs.append((forkserver.popen(["-c", RACER, run, ready, go], env=subprocess_env()), ready))
    try:
        deadline = time.time() + 120
        while not all(ready.exists() for _, ready in procs):
            assert all(p.poll() is None for p, _ in procs), [p.communicate()[1][-2000:] for p, _ in procs]
            assert time.time() < deadline, "the racers did not get ready"
            time.sleep(0.02)
        go.touch()
        outs = [p.communicate(timeout=120) for p, _ in procs]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    lines = [out.strip() for out, _ in outs]
    assert all(p.returncode == 0 for p, _ in procs), [err[-2000:] for _, err in outs]
    assert sorted(line.split()[0] for line in lines) == ["REFUSED", "TRAINED"], lines
    winner = next(p for (p, _), line in zip(procs, lines) if line.startswith("TRAINED"))
    assert lines[[p for p, _ in procs].index(winner)] == "TRAINED 5"
    refusal = next(line for line in lines if line.startswith("REFUSED"))
    assert f"is in use by PID {winner.pid} on host" in refusal, refusal
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "epoch"] == [5]


@pytest.fixture
def precious(tmp_path):
    """A file of the user's whose content must survive."""
    path = tmp_path / "important"
    path.write_text("the user's own words\n")
    return path


def _plant_lock(run: Path, kind: str, precious: Path) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lock = run / LOCK_NAME
    if lock.exists() or lock.is_symlink():
        lock.unlink()
    if kind == "symlink":
        lock.symlink_to(precious)
    elif kind == "dangling symlink":
        lock.symlink_to(precious.with_name("not-yet"))
    elif kind == "hard link":
        os.link(precious, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()


NOT_A_LOCK = {"symlink": "a symbolic link (to '{target}')", "dangling symlink": "a symbolic link (to '{target}')",
              "hard link": "a file with 2 hard links (another name of it lies elsewhere)", "fifo": "a FIFO",
              "directory": "a directory"}


@pytest.mark.parametrize("kind", list(NOT_A_LOCK))
def test_a_lock_file_that_is_not_a_regular_file_is_refused_untouched(tmp_path, kind, precious, make_trainer, data):
    run = tmp_path / "run"
    _plant_lock(run, kind, precious)
    target = os.readlink(run / LOCK_NAME) if (run / LOCK_NAME).is_symlink() else ""
    with pytest.raises(RunDirError) as err:
        make_trainer(run_dir=str(run)).fit(data)
    assert str(err.value) == (f"the lock file '{run / LOCK_NAME}' is {NOT_A_LOCK[kind].format(target=target)}, not "
                              f"torchrig's regular lock file; it was left as it is. Remove it (or choose another "
                              f"run_dir) and start again")
    assert precious.read_text() == "the user's own words\n"
    assert not precious.with_name("not-yet").exists()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]


@pytest.mark.parametrize("resume", [False, True])
def test_a_symlinked_lock_file_is_refused_by_the_cli_untouched(tmp_path, precious, capsys, resume):
    from torchrig.cli import main

    run = tmp_path / "run"
    args = ["train", *QUIET, "--set", f"run_dir={run}"]
    if resume:  # a run that exists, whose lock file is then replaced by a link to the user's file
        assert main(args) == 0
        args += ["--set", "max_steps=4", "--set", "resume=latest"]
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_NAME} if resume else {}
    _plant_lock(run, "symlink", precious)
    capsys.readouterr()
    assert main(args) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"torchrig: error: the lock file '{run / LOCK_NAME}' is a symbolic link (to '{precious}'), not torchrig's "
        f"regular lock file; it was left as it is. Remove it (or choose another run_dir) and start again"]
    assert precious.read_text() == "the user's own words\n"
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != LOCK_NAME} == before


# ----------------------------------------------------------------------------- a directory that holds a run


def test_new_run_into_a_finished_run_is_refused(make_trainer, data, run_dir):
    make_trainer().fit(data)
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError) as err:
        make_trainer(epochs=2).fit(data)
    assert str(err.value) == (f"run_dir '{run_dir}' holds a run that reached step 5: continue it with "
                              f"resume=\"latest\", choose another run_dir, or overwrite=True")  # as Python writes them
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert os.readlink(run_dir / "checkpoints" / "latest") == "step-00000005"
    resumed = make_trainer(epochs=2, resume="latest")  # the way on that the message names
    resumed.fit(data)
    assert resumed.global_step == 10


def test_second_fit_of_the_same_trainer_continues_its_run(make_trainer, data):
    trainer = make_trainer()
    trainer.fit(data)
    trainer.fit(data)
    assert trainer.global_step == 10


def test_refusal_through_the_cli_is_one_line(tmp_path, capsys):
    from torchrig.cli import main

    run = tmp_path / "run"
    args = ["train", *QUIET, "--set", f"run_dir={run}"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"torchrig: error: run_dir '{run}' holds a run that reached step 2: continue it with --set resume=latest, "
        f"choose another run_dir, or --set overwrite=true"]


def test_overwrite_removes_the_old_run_and_says_so(make_trainer, data, run_dir, capsys):
    make_trainer(log_every=1, plot=True).fit(data)
    assert (run_dir / "plots").is_dir()
    capsys.readouterr()
    trainer = make_trainer(log_every=1, max_steps=2, overwrite=True)
    trainer.fit(data)
    out = capsys.readouterr().out
    assert (f"torchrig: overwrite=true: removed the previous run's checkpoints, metrics.jsonl, plots from "
            f"'{run_dir}' (it had reached step 5)\n") in out
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert not (run_dir / "plots").exists()


# ----------------------------------------------------------------------------- numbered directories


def test_cli_without_run_dir_numbers_the_runs(tmp_path, monkeypatch, capsys):
    from torchrig.cli import main

    runs = tmp_path / "runs" / "digits"
    r = subprocess.run([PYTHON, "-m", "torchrig", "train", *QUIET], cwd=tmp_path, env=subprocess_env(),
                       capture_output=True, text=True, timeout=300)  # the installed command, in a new process
    assert r.returncode == 0, r.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    assert main(["train", *QUIET]) == 0  # and again, in this process
    outputs = [r.stdout, capsys.readouterr().out]
    for n, out in enumerate(outputs, start=1):
        assert f"torchrig: run_dir not set; writing to runs/digits/{n} (last -> {n})\n" in out
        assert f"\nrun dir:     runs/digits/{n}\n" in out
        assert f"checkpoints: runs/digits/{n}/checkpoints (latest -> step-00000002)" in out
    assert sorted(p.name for p in runs.iterdir()) == ["1", "2", "last"]
    assert os.readlink(runs / "last") == "2"
    assert resolve(runs / "last") == (runs / "2" / "checkpoints" / "step-00000002").resolve()


def test_python_api_without_run_dir_numbers_under_runs_default(tmp_path, monkeypatch, make_trainer, data):
    monkeypatch.chdir(tmp_path)
    first, second = make_trainer(run_dir=None), make_trainer(run_dir=None)
    assert first.run_dir is None
    first.fit(data)
    second.fit(data)
    first.fit(data)  # its own directory again, not a third one
    assert (first.run_dir, second.run_dir) == (Path("runs/default/1"), Path("runs/default/2"))
    assert sorted(p.name for p in (tmp_path / "runs" / "default").iterdir()) == ["1", "2", "last"]
    assert first.global_step == 10 and second.global_step == 5


def test_concurrent_claims_never_share_a_number(tmp_path):
    root = tmp_path / "runs" / "x"
    (root / "7").mkdir(parents=True)  # numbers go on after the highest one there
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(numbered_run_dir(root, say=lambda _: None)))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(int(p.name) for p in got) == list(range(8, 16))
    assert os.readlink(root / "last") in {p.name for p in got}


def test_torchrun_restart_goes_on_in_the_last_directory(tmp_path, monkeypatch):
    root = tmp_path / "runs" / "x"
    first = numbered_run_dir(root, say=lambda _: None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert numbered_run_dir(root, say=lambda _: None) == first
    assert sorted(p.name for p in root.iterdir()) == ["1", "last"]


# ----------------------------------------------------------------------------- metrics.jsonl


def _steps(rows: list[dict]) -> list[tuple]:
    return [(r["step"], "samples_per_s" in r) for r in rows]


def test_resumed_metrics_read_as_one_unbroken_run(tmp_path, make_trainer, data, run_dir):
    common = dict(epochs=2, log_every=1, checkpoint_every=3, checkpoint_every_epochs=0)
    ref = make_trainer(**common, run_dir=str(tmp_path / "ref"))
    ref.fit(data)
    # a run stopped at step 7, after its checkpoint at step 6, and with a torn last line
    make_trainer(**common, max_steps=7, **{"checkpoint.save_final": False}).fit(data)
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 8, "train/lo')
    make_trainer(**common, resume="latest").fit(data)
    rows, want = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert _steps(rows) == _steps(want)
    assert [r.get("train/loss") for r in rows] == pytest.approx([r.get("train/loss") for r in want])


def test_a_new_run_drops_the_log_of_a_run_that_saved_nothing(make_trainer, data, run_dir):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "epoch": 1, "train/loss": 9.0, "samples_per_s": 1.0}\n')
    make_trainer(log_every=1).fit(data)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert _steps(rows) == [(1, True), (2, True), (3, True), (4, True), (5, True), (5, False)]
    assert 9.0 not in [r["train/loss"] for r in rows]


def test_trim_metrics_is_atomic_and_exact(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 2, 3, 4)) + "not json\n")
    replaced = []
    real = os.replace
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", lambda a, b, **kw: (replaced.append(Path(b).name), real(a, b, **kw))[1])
        trim_metrics(path, 2)
    assert replaced == ["metrics.jsonl"]  # written beside it, then renamed over it
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 2]
    trim_metrics(path, 0)
    assert not path.exists()


def test_trim_metrics_drops_lines_that_are_no_rows_whatever_they_hold(tmp_path):
    """A stranger's metrics.jsonl: lines nested too deeply to parse, a step of Infinity or of a list, a row
    without a step are dropped with the torn lines; the rows up to the step stay."""
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": 1}), "[" * 100_000, '{"step": Infinity}', '{"step": [1]}', '{"loss": 1}',
            json.dumps({"step": 2}), json.dumps({"step": 3})]
    path.write_text("\n".join(rows) + "\n")
    trim_metrics(path, 2)
    assert path.read_text() == f"{rows[0]}\n{rows[5]}\n"


class _FullDisk:
    """A metrics.jsonl file whose writes fail with ENOSPC from the ``after``-th on."""

    def __init__(self, fh, after: int):
        self.fh, self.after, self.writes = fh, after, 0

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes >= self.after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.fh.write(text)

    def fileno(self) -> int:
        return self.fh.fileno()

    def close(self) -> None:
        self.fh.close()


def test_metrics_enospc_is_one_line_and_keeps_the_checkpoints(make_trainer, data, run_dir, monkeypatch):
    import torchrig.observe.run_logger as progress

    real = progress.open_append
    monkeypatch.setattr(progress, "open_append", lambda *a, **k: _FullDisk(real(*a, **k), after=3))
    with pytest.raises(RunDirError) as err:
        make_trainer(log_every=1, checkpoint_every=1).fit(data)
    assert str(err.value) == (f"no space left on device (errno 28 ENOSPC) while writing step 3 to "
                              f"'{run_dir / 'metrics.jsonl'}'; the checkpoints are intact: once it can be written, "
                              f"continue with resume=\"latest\"")
    assert os.readlink(run_dir / "checkpoints" / "latest") == "step-00000002"
    monkeypatch.undo()
    resumed = make_trainer(log_every=1, checkpoint_every=1, resume="latest")  # the lock was released
    resumed.fit(data)
    assert resumed.global_step == 5
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "samples_per_s" in r] == [1, 2, 3, 4, 5]


class _TakeAway:
    """Deletes (or replaces) metrics.jsonl after the rows of the given steps, as a user's cleanup might."""

    def __init__(self, path: Path, steps: tuple, how: str):
        self.path, self.steps, self.how = path, steps, how

    def on_log(self, trainer, values, kind):
        if kind == "interval" and trainer.global_step in self.steps:
            if self.how == "delete":
                self.path.unlink()
            else:
                other = self.path.with_name("other.jsonl")
                other.write_text('{"note": "a file put in its place"}\n')
                os.replace(other, self.path)


@pytest.mark.parametrize("how, steps, kept", [("delete", (2,), [3, 4, 5]), ("delete", (2, 4), [5]),
                                             ("replace", (2,), [3, 4, 5])])
def test_metrics_jsonl_deleted_or_replaced_mid_run_is_reopened_and_said_once(make_trainer, data, run_dir, capsys,
                                                                             how, steps, kept):
    path = run_dir / "metrics.jsonl"
    make_trainer(log_every=1, callbacks=[_TakeAway(path, steps, how)]).fit(data)
    rows = read_jsonl(path)
    assert (rows[0] == {"note": "a file put in its place"}) == (how == "replace")
    assert [r["step"] for r in rows if r.get("kind") == "interval"] == kept  # no row written into the void
    assert [r["step"] for r in rows if r.get("kind") == "epoch"] == [5]
    said = [line for line in capsys.readouterr().err.splitlines() if "metrics.jsonl" in line]
    assert said == [f"torchrig: '{path}' was {how}d during the run; its rows from step {steps[0] + 1} on are "
                    f"appended to the file now at that path"]


def test_unwritable_run_dir_is_one_line(tmp_path, make_trainer, data):
    blocker = tmp_path / "notes.txt"  # a file where a folder of the run_dir should be
    blocker.write_text("x\n")
    with pytest.raises(RunDirError) as err:
        make_trainer(run_dir=str(blocker / "run")).fit(data)
    assert str(err.value) == (f"cannot create the lock file '{blocker / 'run' / LOCK_NAME}': not a directory "
                              f"(errno 20 ENOTDIR); choose a run_dir this process can write")


def test_the_folder_of_numbered_runs_means_its_newest_run(tmp_path):
    from torchrig.checkpoint import resolve

    root = tmp_path / "runs" / "digits"
    for n in (1, 2):
        (root / str(n) / "checkpoints" / "step-00000003").mkdir(parents=True)
        (root / str(n) / "checkpoints" / "step-00000003" / "model.safetensors").write_bytes(b"")
        os.symlink("step-00000003", root / str(n) / "checkpoints" / "latest")
    os.symlink("2", root / "last")
    assert resolve(root) == (root / "2" / "checkpoints" / "step-00000003").resolve()


def test_cli_resume_without_run_dir_continues_the_newest_run_and_failed_starts_leave_nothing(tmp_path):
    """`torchrig train --set resume=latest` after a run that numbered itself goes on in that run; a start
    that fails before saving anything removes its numbered directory and leaves `last` where it was."""
    from torchrig.checkpoint import read_checkpoint, resolve

    common = ["train", "--set", "max_steps=3", "--set", "log.plot=false", "--set", "log.tensorboard=false",
              "--set", "checkpoint.every_steps=3"]
    first = subprocess.run([PYTHON, "-m", "torchrig.cli", *common], cwd=tmp_path, capture_output=True, text=True,
                           env=subprocess_env(), timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    failed = subprocess.run([PYTHON, "-m", "torchrig.cli", *common, "--set", "loss=no_such_loss"], cwd=tmp_path,
                            capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert failed.returncode == 1 and "unknown loss 'no_such_loss'" in failed.stderr
    root = tmp_path / "runs" / "digits"
    assert sorted(p.name for p in root.iterdir()) == ["1", "last"] and os.readlink(root / "last") == "1"
    more = subprocess.run([PYTHON, "-m", "torchrig.cli", *common[:2], "max_steps=6", *common[3:],
                           "--set", "resume=latest"], cwd=tmp_path, capture_output=True, text=True,
                          env=subprocess_env(), timeout=300)
    assert more.returncode == 0, more.stderr[-2000:]
    assert f"torchrig: run_dir not set; resuming the newest run, {Path('runs/digits/1')}" in more.stdout + more.stderr
    assert "resumed at step 3" in more.stdout + more.stderr
    state, _, _ = read_checkpoint(resolve(root / "1"))
    assert state["counters"]["global_step"] == 6 and sorted(p.name for p in root.iterdir()) == ["1", "last"]
    # a checkpoint named by its path is no "newest run": it resumes into a new numbered run, and the newest run
    # (here the same run 1, now at step 6) is left as it is
    path = subprocess.run([PYTHON, "-m", "torchrig.cli", *common[:2], "max_steps=6", *common[3:],
                           "--set", f"resume={root / '1' / 'checkpoints' / 'step-00000003'}"], cwd=tmp_path,
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert path.returncode == 0, path.stderr[-2000:]
    said = path.stdout + path.stderr
    assert "resuming the newest run" not in said and f"writing to {Path('runs/digits/2')}" in said, said[-2000:]
    assert read_checkpoint(resolve(root / "2"))[0]["counters"]["global_step"] == 6
    assert read_checkpoint(resolve(root / "1"))[0]["counters"]["global_step"] == 6  # untouched
