"""SIGKILL during checkpoint saves: ``latest`` always names a complete checkpoint, and the next start
removes what the killed save left behind.

Real child processes save checkpoints of a small model in a loop (every step twice, so that half the
saves are re-saves of an existing step) and are killed with SIGKILL: first at chosen points inside the
save (through the ``TORCHRIG_TEST_PAUSE_AT`` testing hook of ``torchrig.checkpoint.io``), where a
temporary file or directory must exist, then at random moments (seeded). After every kill the
checkpoint ``latest`` names must load whole (weights, state, config, meta, with one step throughout),
no saved step may be lost, and ``CheckpointManager.clean_partial`` (what ``Trainer.fit`` runs at start)
must leave no temporary behind. ``KILL_DURING_SAVE_ROUNDS=100`` runs more random kills.

The children are forked from one helper process that imported torch once, so a kill round costs a
fork, not an interpreter start.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from torchrig.checkpoint import CheckpointManager, read_checkpoint, resolve

SRC = Path(__file__).resolve().parents[2] / "src"
ROUNDS = int(os.environ.get("KILL_DURING_SAVE_ROUNDS", "24"))

# Reads one JSON line per child: [run_dir, pause spec]; forks it, prints its pid, waits, prints its status.
FORK_SERVER = r"""
import itertools, json, os, sys
import numpy, safetensors.torch, torch, yaml  # the slow imports, once
torch.set_num_threads(1)

def save_loop(run_dir, pause):
    if pause:
        os.environ["TORCHRIG_TEST_PAUSE_AT"] = pause  # read when torchrig.checkpoint.io is imported, just below
    from torchrig.checkpoint import CheckpointManager
    mgr = CheckpointManager(run_dir, keep_last=2, keep_best=1)
    mgr.clean_partial()  # what Trainer.fit does at start
    start = mgr.latest_step() or 0
    print("saving", file=sys.stderr, flush=True)
    for k in itertools.count():
        step = start + 1 + k // 2  # each step twice: the second save re-saves an existing step
        weights = {f"layer{i}.weight": torch.full((256, 256), float(step)) for i in range(8)}
        state = {"counters": {"global_step": step}, "optimizers": {"default": {"step": torch.tensor(step)}}}
        path = mgr.write(step, weights, state, {"epochs": 1}, {"step": step}, metrics={"loss": 1.0 / step})
        mgr.track_best(path.name, 1.0 / step, "min")  # what the Trainer's BestCheckpoint callback does

for line in sys.stdin:
    run_dir, pause = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            save_loop(run_dir, pause)
        finally:
            os._exit(1)
    print(pid, flush=True)
    print(os.waitpid(pid, 0)[1], flush=True)
"""


class ForkServer:
    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
        env.pop("TORCHRIG_TEST_PAUSE_AT", None)
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.pending, self.said = "", []

    def start(self, run_dir: Path, pause: str = "") -> int:
        self.proc.stdin.write(json.dumps([str(run_dir), pause]) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """The next stderr line of a child that starts with ``text``."""
        deadline, fd = time.time() + timeout, self.proc.stderr.fileno()
        while True:
            while "\n" in self.pending:
                line, self.pending = self.pending.split("\n", 1)
                self.said.append(line)
                if line.startswith(text):
                    return line
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.time()))
            assert ready, f"no child said {text!r} within {timeout} s; the last lines:\n" + "\n".join(self.said[-30:])
            chunk = os.read(fd, 65536)  # raw reads: a buffered reader could hide a line from select
            assert chunk, "the fork server died"
            self.pending += chunk.decode()

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        status = int(self.proc.stdout.readline())
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _temporaries(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) if folder.exists() else []


def _check_latest(run_dir: Path, last_step: int) -> int:
    """``latest`` loads whole with one step throughout, and no saved step was lost; returns the step."""
    path = resolve("latest", run_dir)
    assert path is not None, "no latest"
    state, meta, config = read_checkpoint(path)
    weights = load_file(path / "model.safetensors")
    step = meta["step"]
    assert state["counters"]["global_step"] == int(state["optimizers"]["default"]["step"]) == step
    assert config == {"epochs": 1} and meta["metrics"] == {"loss": 1.0 / step}
    assert sorted(weights) == [f"layer{i}.weight" for i in range(8)]
    assert all(bool((w == float(step)).all()) for w in weights.values())
    assert step >= last_step, f"latest went back from step {last_step} to {step}"
    return step


def _after_kill(run_dir: Path, last_step: int) -> int:
    step = _check_latest(run_dir, last_step)
    CheckpointManager(run_dir).clean_partial()  # the next start
    assert _temporaries(run_dir) == []
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{step:08d}"
    return _check_latest(run_dir, step)


# (pause point, what must exist at the kill, relative to checkpoints/; temporary names end in random hex digits).
# Saves alternate: new step, re-save.
POINTS = [
    ("model.safetensors", ".tmp-step-*-*/.model.safetensors.tmp-*"),  # first file of a new step
    ("state.pt@2", ".tmp-step-*-*/.state.pt.tmp-*"),                  # mid re-save
    ("config.yaml", ".tmp-step-*-*/.config.yaml.tmp-*"),
    ("meta.json@2", ".tmp-step-*-*/.meta.json.tmp-*"),
    ("publish", ".tmp-step-*-*/meta.json"),                               # complete, not yet renamed
    ("latest@1", ".latest.tmp-*"),                                         # new step in place, link not swapped
    ("latest@2", ".tmp-step-*-*/meta.json"),                              # re-save: latest about to name tmp
    ("swap", ".tmp-trash-step-*-*/model.safetensors"),                    # old step moved aside, new not in
    ("latest@3", ".tmp-step-*-*/model.safetensors"),                      # latest still names the tmp copy
    ("best", ".best.tmp-*"),
    ("index.json@2", ".index.json.tmp-*"),
]


@pytest.fixture
def server():
    s = ForkServer()
    yield s
    s.close()


@pytest.mark.slow
def test_sigkill_at_chosen_writes_inside_the_save(server, tmp_path):
    run_dir, step = tmp_path / "run", 0
    pid = server.start(run_dir)
    server.wait_for("saving")
    while resolve("latest", run_dir) is None:  # one whole checkpoint before the first kill
        time.sleep(0.01)
    server.kill(pid)
    step = _after_kill(run_dir, step)
    for point, expected in POINTS:
        pid = server.start(run_dir, point)
        line = server.wait_for("torchrig: test pause at ")
        assert line.startswith(f"torchrig: test pause at {point.split('@')[0]} ")
        present = sorted(str(p.relative_to(run_dir / "checkpoints"))
                         for p in (run_dir / "checkpoints").glob(expected.format(pid=pid)))
        assert present, f"at {point}: nothing matches {expected}; found {_temporaries(run_dir)}"
        server.kill(pid)
        step = _after_kill(run_dir, step)


@pytest.mark.slow
def test_sigkill_at_random_moments_while_saving(server, tmp_path):
    rng = random.Random(20240607)
    run_dir, step, mid_save = tmp_path / "run", 0, 0
    for _ in range(ROUNDS):
        pid = server.start(run_dir)
        server.wait_for("saving")
        if step == 0:
            while resolve("latest", run_dir) is None:
                time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))  # about three saves
        server.kill(pid)
        mid_save += bool(_temporaries(run_dir))
        step = _after_kill(run_dir, step)
    print(f"\nSIGKILL during saves: {ROUNDS} kills, {mid_save} inside a save, {ROUNDS} survived, 0 lost; "
          f"latest at step {step}")
    assert mid_save >= ROUNDS // 3  # the kills did land inside saves (a save is nearly all of the loop)
