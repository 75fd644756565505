"""Signals save work: SIGTERM / SIGINT / SIGUSR1 finish the step, checkpoint, say how to go on, exit 128+N."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import torchrig
from helpers import HELPERS, PYTHON, QUIET, TinyNet, forkserver, make_classification, subprocess_env
from torchrig.checkpoint import read_checkpoint, resolve
from torchrig.runtime import RunStopped
from torchrig.trainer import default_step

CHILD = HELPERS / "signal_child.py"
CODES = {"SIGTERM": 143, "SIGINT": 130, "SIGUSR1": 138}


def _fit(run_dir, step_fn=None, **kw):
    torch.manual_seed(0)
    opts = dict(QUIET, run_dir=str(run_dir), batch_size=4, epochs=3, optimizer="sgd", lr=0.05, num_workers=0,
                checkpoint_every_epochs=0)
    opts.update(kw)
    trainer = torchrig.Trainer(TinyNet(dropout=0.2), step_fn=step_fn, **opts)
    x, y = make_classification(38)  # 10 batches an epoch, the last of 2 samples
    trainer.fit(TensorDataset(x, y))
    return trainer


@pytest.mark.parametrize("name, at", [("SIGTERM", 14), ("SIGINT", 14), ("SIGUSR1", 14), ("SIGTERM", 20)],
                         ids=["SIGTERM", "SIGINT", "SIGUSR1", "SIGTERM-last-window"])
def test_signal_finishes_the_step_saves_and_resumes_bitwise(tmp_path, capsys, name, at):
    """Mid-epoch 2 (step 14), and in epoch 2's last, short window (step 20): the resume then starts by ending
    epoch 2 (its row, its metrics) before epoch 3, as the uninterrupted run did."""
    before = signal.getsignal(getattr(signal, name))  # what the process had (a test before may have changed it)
    full = _fit(tmp_path / "full")

    def step_with_signal(step, batch):
        out = default_step(step, batch)
        if step.sync_gradients and step.global_step == at - 1:  # during optimizer step `at`
            os.kill(os.getpid(), getattr(signal, name))
        return out

    run = tmp_path / "cut"
    with pytest.raises(RunStopped) as stop:
        _fit(run, step_fn=step_with_signal)
    assert stop.value.code == CODES[name]
    line = (f"stopped by {name} at step {at}; checkpoint {run}/checkpoints/step-{at:08d}; continue with the same "
            f"Trainer arguments and run_dir=\"{run}\", resume=\"latest\"")  # the Python API names the Trainer keywords, the run first
    assert str(stop.value) == line
    assert line in capsys.readouterr().err
    assert resolve("latest", run).name == f"step-{at:08d}"
    state, meta, _ = read_checkpoint(resolve("latest", run))
    assert state["counters"]["global_step"] == at
    assert (state["counters"]["epoch"], state["counters"]["batch_in_epoch"]) == (1, at - 10)  # in epoch 2
    assert signal.getsignal(getattr(signal, name)) is before  # restored
    resumed = _fit(run, resume="latest")
    assert resumed.global_step == full.global_step == 30
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.history == full.history[1:]  # the rows of epochs 2 and 3 alike, the restored sums in them


def _start(run_dir: Path, *args: str, env=None, start_new_session: bool = False) -> forkserver.Forked:
    """signal_child.py, forked from the tests' fork server (a fork, not an interpreter start): the server has
    installed no handler and started no thread, so the child's own fit installs torchrig's handlers as a fresh
    interpreter would. The command-line windows (start-up, exit) and torchrig launch keep their own interpreter."""
    return forkserver.popen([CHILD, run_dir, *args], env=subprocess_env(**(env or {})),
                            start_new_session=start_new_session)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited {proc.returncode} before {path.name}:\n{proc.communicate()[1]}")
        if time.monotonic() > end:
            proc.kill()
            raise AssertionError(f"no {path.name} within {timeout}s")
        time.sleep(0.02)


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"child did not stop within {timeout}s:\n{err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.slow
def test_ctrl_c_with_dataloader_workers_is_the_same_every_time(tmp_path):
    """Ctrl-C reaches the whole process group, DataLoader workers included; the run still stops cleanly."""
    outcomes = []
    for attempt in range(5):
        run = tmp_path / f"run{attempt}"
        proc = _start(run, "num_workers=2", start_new_session=True)
        _wait_for(run / "ready-0", proc)
        time.sleep(0.05 * attempt)  # land at different points of the loop
        os.killpg(proc.pid, signal.SIGINT)
        code, out, err = _finish(proc)
        step = int(resolve("latest", run).name.split("-")[1])
        outcomes.append(code)
        assert f"stopped by SIGINT at step {step}; checkpoint {run}/checkpoints/step-{step:08d}; continue with the same " \
               f"Trainer arguments and run_dir=\"{run}\", resume=\"latest\"" in err, err[-2000:]
        assert "Traceback" not in err and "exited unexpectedly" not in err, err[-2000:]
    assert outcomes == [130] * 5


@pytest.mark.slow
def test_second_ctrl_c_exits_at_once(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, env={"STUCK_SLEEP": "3"})
    _wait_for(run / "ready-0", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc, timeout=10)
    assert time.monotonic() - t0 < 2.5  # did not wait for the 3 s step to end
    assert code == 130
    assert "second SIGINT: exiting now, without a checkpoint" in err
    assert not (run / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_slurm_requeue_after_the_save(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {record}\n")
    fake.chmod(0o755)
    run = tmp_path / "run"
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = _start(run, "dist.requeue=true", env=env)
    _wait_for(run / "ready-0", proc)
    proc.send_signal(signal.SIGUSR1)
    code, out, err = _finish(proc)
    assert code == 138, err[-2000:]
    assert record.read_text().strip() == "requeue 4242"
    assert "torchrig: requeued Slurm job 4242" in err
    assert resolve("latest", run) is not None  # saved before the requeue


def _pair(run: Path, *args: str, env=None) -> list[subprocess.Popen]:
    """Two ranks of signal_child.py joined through a ``file://`` rendezvous of their own."""
    init = f"file://{run.parent / f'{run.name}-{time.monotonic_ns()}-rendezvous'}"
    return [_start(run, *args, env={"TEST_INIT": init, "TEST_RANK": r, "TEST_WORLD": 2, **(env or {})})
            for r in (0, 1)]


def _finish_pair(procs: list[subprocess.Popen], timeout: float = 90) -> list[tuple[int, str, str]]:
    try:
        return [_finish(p, timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _signal_one_rank(run: Path, procs: list[subprocess.Popen], signum: int) -> list[tuple[int, str, str]]:
    """Send ``signum`` to rank 1 only, once it is ready; both ranks' (code, stdout, stderr)."""
    try:
        for r, proc in enumerate(procs):
            _wait_for(run / f"ready-{r}", proc)
        procs[1].send_signal(signum)  # only rank 1 hears it
    except BaseException:
        for p in procs:
            p.kill()
        raise
    return _finish_pair(procs)


# 93 samples over 2 ranks × batch 4: 12 steps per epoch, the last global batch short (3 + 2 samples)
IN_EPOCH_2 = {"SAMPLES": 93, "READY_AT_STEP": 14}
PAIR_ARGS = ("batch_size=4", "epochs=3")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_stop_at_the_same_step_when_one_rank_is_signalled(tmp_path, strategy):
    """The ranks agree within two steps of the signal, mid-epoch (not at the epoch's end, where they
    would meet anyway)."""
    run = tmp_path / "run"
    results = _signal_one_rank(run, _pair(run, *PAIR_ARGS, f"strategy={strategy}", env=IN_EPOCH_2), signal.SIGTERM)
    assert [code for code, _, _ in results] == [143, 143], results[0][2][-2000:] + results[1][2][-2000:]
    latest = resolve("latest", run)
    step = int(latest.name.split("-")[1])
    assert f"stopped by SIGTERM at step {step};" in results[0][2]  # rank 0 prints
    landed = int((run / "landed-1").read_text())  # optimizer steps done when rank 1 saw the signal
    assert not (run / "landed-0").exists()
    assert 1 <= step - landed <= 2, (landed, step)
    state, meta, _ = read_checkpoint(latest)
    assert state["counters"]["global_step"] == meta["step"] == step
    assert state["counters"]["epoch"] == 1 and 0 < state["counters"]["batch_in_epoch"] < 12  # mid-epoch 2
    assert (latest / "sharded" / ".metadata").exists() == (strategy == "fsdp")  # every rank's shard written


@pytest.mark.slow
def test_ddp_resume_from_a_stop_in_epoch_2_is_bitwise_with_dropout(tmp_path):
    """Each rank's random generators are its own (the ranks' last batches differ in size, so their dropout
    streams part in epoch 1): a checkpoint keeps every rank's, and each rank restores its own."""
    env = dict(IN_EPOCH_2, DROPOUT=0.3)
    full = tmp_path / "full"
    done = _finish_pair(_pair(full, *PAIR_ARGS, "strategy=ddp", env=env))
    assert [code for code, _, _ in done] == [0, 0], done[0][2][-2000:] + done[1][2][-2000:]

    cut = tmp_path / "cut"
    stopped = _signal_one_rank(cut, _pair(cut, *PAIR_ARGS, "strategy=ddp", env=env), signal.SIGUSR1)
    assert [code for code, _, _ in stopped] == [138, 138], stopped[0][2][-2000:] + stopped[1][2][-2000:]
    state, _, _ = read_checkpoint(resolve("latest", cut))
    assert state["counters"]["epoch"] == 1 and state["counters"]["batch_in_epoch"] > 0  # mid-epoch 2

    resumed = _finish_pair(_pair(cut, *PAIR_ARGS, "strategy=ddp", "resume=latest", env=env))
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-2000:] + resumed[1][2][-2000:]
    for rank in (0, 1):
        a, b = torch.load(full / f"final-{rank}.pt"), torch.load(cut / f"final-{rank}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank}'s weights differ after the resume"


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_signal_during_a_long_save_lets_it_finish(tmp_path, async_save):
    """A checkpoint write (or the wait for the one before) that outlasts dist.stop_timeout is progress: the
    watchdog does not end the process, the stop checkpoint is written and the exit code is 143."""
    run = tmp_path / "run"
    # every step saves; each write takes 2 s; steps take 0.3 s, so with asynchronous saves the signal lands
    # in step 2, whose save waits for step 1's write before the loop can notice it
    proc = _start(run, "checkpoint.every_steps=1", f"checkpoint.async_save={async_save}", "dist.stop_timeout=0.5",
                  env={"SLOW_SAVE": 2, "STEP_SLEEP": 0.3})
    _wait_for(run / "saving-0", proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    assert "no progress" not in err, err[-2000:]
    assert code == 143, err[-2000:]
    step = int(resolve("latest", run).name.split("-")[1])
    assert step == (1 if async_save == "false" else 2)
    assert f"stopped by SIGTERM at step {step}; checkpoint {run}/checkpoints/step-{step:08d}; " \
           f"continue with the same Trainer arguments and run_dir=\"{run}\", resume=\"latest\"" in err


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_exits_after_stop_timeout(tmp_path):
    """Rank 1 stops taking part; rank 0 waits inside the gradient all-reduce (C++, where no Python signal
    handler runs) when torchrun's SIGTERM comes: it still says why and exits after dist.stop_timeout."""
    run = tmp_path / "run"
    procs = _pair(run, "dist.stop_timeout=1.5", env={"STUCK_SLEEP": 120, "STUCK_RANK": 1})
    try:
        for r, proc in enumerate(procs):
            _wait_for(run / f"ready-{r}", proc)
        time.sleep(0.5)  # rank 0 is in step 3's all-reduce, waiting for rank 1
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        code, out, err = _finish(procs[0], timeout=30)
    finally:
        for p in procs:
            p.kill()
    assert code == 143 and time.monotonic() - t0 < 10, err[-2000:]
    assert "(a step, or a peer, is stuck); exiting without a checkpoint (dist.stop_timeout)" in err


STUCK_IN_START_UP = """
import datetime, sys
import torch.distributed as dist
from torchrig.runtime import StopSignal

StopSignal(stop_timeout=1.5).install()
print("joining", flush=True)
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=120))  # the other rank never comes
"""


def test_a_signal_during_a_rendezvous_that_does_not_return_gives_its_line(tmp_path):
    proc = subprocess.Popen([PYTHON, "-c", STUCK_IN_START_UP, str(tmp_path / "store")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline() == "joining\n"
    time.sleep(1.0)  # inside init_process_group, waiting for rank 1
    t0 = time.monotonic()
    proc.send_signal(signal.SIGUSR1)
    code, out, err = _finish(proc, timeout=60)
    assert code == 138 and time.monotonic() - t0 < 10, err[-2000:]
    assert "stopped by SIGUSR1 during start-up; no step was trained and nothing was written: run the same command " \
           "again" in err.splitlines()


def test_signal_handlers_do_nothing_in_a_forked_child(tmp_path):
    """A DataLoader worker forked under fit inherits the handler; it must not stop or kill the worker."""
    handler = torchrig.runtime.StopSignal().install()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the signal is ignored, the process goes on and exits 7
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 7
        assert handler.received == 0
    finally:
        handler.uninstall()


@pytest.mark.slow
def test_cli_train_sigterm_then_resume(tmp_path):
    run = tmp_path / "digits"
    args = ["-m", "torchrig.cli", "train", "--set", f"run_dir={run}", "--set", "epochs=2",
            "--set", "checkpoint.every_steps=3", "--set", "log.plot=false", "--set", "log.tensorboard=false"]
    proc = subprocess.Popen([PYTHON, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env())
    _wait_for(run / "checkpoints" / "latest", proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    assert code == 143, err[-2000:]
    step = int(resolve("latest", run).name.split("-")[1])
    assert f"stopped by SIGTERM at step {step}; checkpoint {run}/checkpoints/step-{step:08d}; " \
           f"continue with torchrig train --set run_dir={run} --set resume=latest" in err
    # the short command the line names: the run's own settings (epochs=2, the checkpoint interval ...) are read back
    done = subprocess.run([PYTHON, "-m", "torchrig.cli", "train", "--set", f"run_dir={run}", "--set", "resume=latest",
                           "--set", "log.plot=false", "--set", "log.tensorboard=false"], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed at step {step}" in done.stderr
    state, meta, _ = read_checkpoint(resolve("latest", run))
    assert state["counters"]["epoch"] == 2 and state["counters"]["batch_in_epoch"] == 0  # both epochs done


@pytest.mark.slow
def test_a_stuck_step_exits_after_stop_timeout(tmp_path):
    """torchrun's SIGTERM to the survivors of a failed group must not wait for a step that never ends."""
    run = tmp_path / "run"
    proc = _start(run, "dist.stop_timeout=1.5", env={"STUCK_SLEEP": "120"})
    _wait_for(run / "ready-0", proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc, timeout=30)
    assert code == 143 and time.monotonic() - t0 < 10
    assert "torchrig: no progress for 2s after SIGTERM (a step, or a peer, is stuck); exiting without a " \
           "checkpoint (dist.stop_timeout)" in err


# ----------------------------------------------------------------------------- every window gets its line

WINDOWS = '''
import atexit, os, time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

MARK, WINDOW = Path(os.environ["WINDOW_MARK"]), os.environ["WINDOW"]


def model(cfg):
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Marked(Dataset):
    """The test split: each sample marks the final evaluation and takes a while."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        MARK.touch()
        time.sleep(0.2)
        return self.x[i], self.y[i]


def _exit_slowly():
    MARK.touch()
    time.sleep(60)


def data(cfg):
    if WINDOW == "start-up":
        MARK.touch()
        time.sleep(60)
    if WINDOW == "exit":
        atexit.register(_exit_slowly)  # runs at the interpreter's exit, after the command returned
    x = torch.randn(93, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    test = Marked(x[:40], y[:40]) if WINDOW == "final-eval" else (x[:40], y[:40])
    return (x, y), None, test
'''


def _train_cli(tmp_path: Path, window: str) -> tuple[subprocess.Popen, Path, Path]:
    """``torchrig train`` of a small model from factories in tmp_path; WINDOW says where they dawdle."""
    (tmp_path / "windows.py").write_text(WINDOWS)
    run, mark = tmp_path / "run", tmp_path / "mark"
    args = ["-m", "torchrig", "train", "--model", "windows:model", "--data", "windows:data",
            "--set", f"run_dir={run}", "--set", "epochs=2", "--set", "data.batch_size=8", "--set", "log.plot=false",
            "--set", "log.tensorboard=false", "--set", "log.progress=none", "--set", "data.num_workers=0"]
    proc = subprocess.Popen([PYTHON, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=subprocess_env(WINDOW=window, WINDOW_MARK=mark))
    return proc, run, mark


@pytest.mark.slow
def test_a_signal_during_start_up_says_nothing_was_written(tmp_path):
    proc, run, mark = _train_cli(tmp_path, "start-up")
    _wait_for(mark, proc)
    proc.send_signal(signal.SIGUSR1)
    code, out, err = _finish(proc)
    assert code == 138, err[-2000:]
    assert "stopped by SIGUSR1 during start-up; no step was trained and nothing was written: run the same " \
           "command again" in err.splitlines()
    assert "Traceback" not in err and not (run / "checkpoints").exists()


@pytest.mark.slow
def test_a_signal_during_the_final_evaluation_says_training_finished(tmp_path):
    proc, run, mark = _train_cli(tmp_path, "final-eval")
    _wait_for(mark, proc)
    proc.send_signal(signal.SIGTERM)
    code, out, err = _finish(proc)
    assert code == 143, err[-2000:]
    assert f"stopped by SIGTERM during the final evaluation on the test split, after training finished; torchrig " \
           f"evaluate --checkpoint {run} gives the test metrics" in err.splitlines()
    assert "Traceback" not in err
    state, meta, _ = read_checkpoint(resolve("latest", run))
    assert state["counters"]["epoch"] == 2  # training was complete and saved


@pytest.mark.slow
def test_ctrl_c_while_the_interpreter_exits_gives_its_line_and_code(tmp_path):
    proc, run, mark = _train_cli(tmp_path, "exit")
    _wait_for(mark, proc, timeout=120)
    proc.send_signal(signal.SIGINT)
    code, out, err = _finish(proc)
    assert code == 130, err[-2000:]
    assert "stopped by SIGINT while exiting; the run had ended" in err.splitlines()
    assert "Traceback" not in err and "test:" in out  # the run itself had finished and said so


@pytest.mark.slow
@pytest.mark.parametrize("hook, signum", [("on_fit_start", signal.SIGTERM), ("on_fit_end", signal.SIGINT)])
def test_a_signal_before_or_after_the_loop_of_fit_gives_its_line(tmp_path, hook, signum):
    """The Trainer's own windows (a script, not the command): before the loop nothing is written; after it,
    the final checkpoint is named."""
    run = tmp_path / "run"
    proc = _start(run, "epochs=2", env={"HOOK_SLEEP": hook})
    _wait_for(run / f"{hook}-0", proc)
    proc.send_signal(signum)
    code, out, err = _finish(proc)
    name = signal.Signals(signum).name
    assert code == 128 + signum, err[-2000:]
    if hook == "on_fit_start":
        line = f"stopped by {name} during start-up; no step was trained and nothing was written: run the same " \
               f"command again"
        assert not (run / "checkpoints" / "latest").exists()
    else:
        line = f"stopped by {name} after training finished at step 64; checkpoint {run}/checkpoints/step-00000064 " \
               f"holds it"
        assert resolve("latest", run).name == "step-00000064"
    assert line in err.splitlines(), err[-2000:]
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- under torchrig launch


def _launch(run: Path, *args: str, env=None) -> tuple[subprocess.Popen, Path]:
    """``torchrig launch --nproc-per-node 2 -- signal_child.py RUN ARGS``; its output goes to a file (the
    workers keep it open after a killed launcher)."""
    run.mkdir(parents=True)
    log = run.parent / f"{run.name}-launch.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([PYTHON, "-m", "torchrig", "launch", "--nproc-per-node", "2", "--", str(CHILD),
                                 str(run), *args], stdout=f, stderr=subprocess.STDOUT, text=True,
                                env=subprocess_env(**(env or {})), start_new_session=True)
    return proc, log


def _pid(path: Path, proc: subprocess.Popen) -> int:
    _wait_for(path, proc)
    while not path.read_text():  # written a moment after it appears
        time.sleep(0.01)
    return int(path.read_text())


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _kill_all(proc: subprocess.Popen, pids: list[int]) -> None:
    for pid in [proc.pid, *pids]:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _sigterm_in_epoch_2(run: Path, to_launcher: bool) -> tuple[int, str, int]:
    """Launch the pair, SIGTERM the launcher or rank 1 once both train in epoch 2; returns the launcher's exit
    code, its output and the step of the latest checkpoint."""
    proc, log = _launch(run, *PAIR_ARGS, env=IN_EPOCH_2)
    pids, code = [], None
    try:
        pids = [_pid(run / f"ready-{r}", proc) for r in (0, 1)]
        os.kill(proc.pid if to_launcher else pids[1], signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        _kill_all(proc, pids)
    return code, log.read_text(), int(resolve("latest", run).name.split("-")[1])


@pytest.mark.slow
def test_launch_says_a_run_stopped_by_a_signal_stopped_cleanly(tmp_path):
    """torchrun sends its own SIGTERM to the ranks left after the signalled one exits; that is no failure."""
    run = tmp_path / "run"
    code, out, step = _sigterm_in_epoch_2(run, to_launcher=False)
    assert code == 143, out[-3000:]
    assert f"stopped by SIGTERM at step {step}; checkpoint {run}/checkpoints/step-{step:08d}" in out
    assert "torchrig launch: the run stopped cleanly on SIGTERM (exit 143); rank 0's line above says where; to " \
           "continue, run the same command with resume='latest'" in out.splitlines(), out[-3000:]
    assert "error" not in out, out[-3000:]


@pytest.mark.slow
def test_a_signal_to_the_launcher_is_said_received_once(tmp_path):
    """torchrun passes a SIGTERM on to every rank; the line saying so comes once, from rank 0, and both stop."""
    run = tmp_path / "run"
    _, out, step = _sigterm_in_epoch_2(run, to_launcher=True)
    received = [line for line in out.splitlines() if "SIGTERM received" in line]
    assert received == ["torchrig: SIGTERM received; stopping after the current optimizer step with a checkpoint "
                        "(send it again to exit at once)"], out[-3000:]
    assert f"stopped by SIGTERM at step {step}; checkpoint {run}/checkpoints/step-{step:08d}" in out, out[-3000:]


@pytest.mark.slow
def test_workers_end_with_a_launcher_killed_by_sigkill(tmp_path):
    """They stop as torchrun would have stopped them: SIGTERM, the step under way, a checkpoint."""
    run = tmp_path / "run"
    proc, log = _launch(run, "epochs=50")
    pids = []
    try:
        pids = [_pid(run / f"ready-{r}", proc) for r in (0, 1)]
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        _kill_all(proc, pids)
    out = log.read_text()
    # the step under way and its checkpoint, as under torchrun (which waits 30 s before SIGKILL); a loaded machine
    # takes a few seconds for them
    assert took < 15, f"the orphaned workers ran on for {took:.0f}s:\n{out[-3000:]}"
    latest = resolve("latest", run)
    assert latest is not None and "second SIGTERM" not in out, out[-3000:]  # one SIGTERM each, not two
    step = int(latest.name.split("-")[1])
    assert f"stopped by SIGTERM at step {step}; checkpoint {run}/checkpoints/step-{step:08d}" in out


def test_a_signal_after_a_loop_that_failed_is_not_said_to_come_at_start_up(tmp_path):
    """The command's handler around fit learns what a signal would stop when fit's own handler is put away. A loop
    that ended on an error (a peer died under torchrun, which then sends SIGTERM) has written checkpoints: its line
    must not say that nothing was written."""
    from torchrig.runtime.signals import STARTING, StopSignal

    class Boom(RuntimeError):
        pass

    def step_fn(step, batch):
        if step.global_step == 3:
            raise Boom("a peer died")
        return default_step(step, batch)

    outer = StopSignal(where=STARTING).install()
    try:
        with pytest.raises(Boom):
            torchrig.Trainer(TinyNet(), epochs=1, batch_size=8, run_dir=str(tmp_path / "run"), step_fn=step_fn,
                             **{"checkpoint.every_steps": 2}, **QUIET).fit(make_classification())
        assert outer.where.startswith("after an error ended the training loop; the checkpoints written before it")
        with pytest.raises(RunStopped, match="stopped by SIGTERM after an error ended the training loop"):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                time.sleep(0.01)
    finally:
        outer.uninstall()
