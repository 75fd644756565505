"""Fault injection outside the test suite: many trials, a table of tried / survived / lost.

    python tools/fault_injection.py signals --trials 40      # random signals at random points, then resume

A *signals* trial starts a small training run (``tests/helpers/signal_child.py``), sends SIGTERM, SIGINT or
SIGUSR1 (to the process, or to its whole process group as Ctrl-C does) at a random moment, with or
without DataLoader workers, checks the exit code and the resume line, resumes the run to its end and
compares the final weights with an uninterrupted run, bit for bit (a signal that lands after the loop
says so: the weights are compared as they are). A trial *survives* when all of that
holds; it is *lost* otherwise (and the reason is printed).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "tests" / "helpers" / "signal_child.py"
CODES = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGUSR1: 138}
ARGS = ["epochs=2", "checkpoint_every_epochs=1"]


def _env(**extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "tests")]))
    env.update(extra)
    return env


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str((run / "checkpoints" / "latest").resolve() / "model.safetensors"))


def _run(run: Path, *args: str, sleep: str = "0") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHILD), str(run), *ARGS, *args], capture_output=True, text=True,
                          env=_env(STEP_SLEEP=sleep), timeout=300)


def signal_trial(root: Path, rng: random.Random, reference: dict) -> str:
    """'' if the trial survived, else why it was lost."""
    import torch

    run = root / f"trial{rng.randrange(10**9)}"
    sig = rng.choice(list(CODES))
    workers = rng.choice(["num_workers=0", "num_workers=2"])
    group = sig == signal.SIGINT and rng.random() < 0.5  # Ctrl-C reaches the whole process group
    proc = subprocess.Popen([sys.executable, str(CHILD), str(run), *ARGS, workers], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(STEP_SLEEP="0.01"), start_new_session=True)
    while not (run / "ready-0").exists() and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(rng.uniform(0, 0.6))
    if proc.poll() is None:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        return ""  # the run ended before the signal: nothing to save (counted as survived)
    if proc.returncode != CODES[sig]:
        return f"{sig.name}: exit {proc.returncode}, not {CODES[sig]}: {err.strip().splitlines()[-1:]}"
    if f"stopped by {sig.name} after training finished at step" in err:  # it landed after the loop: no resume
        pass
    elif f"stopped by {sig.name} at step" not in err or "continue with --set resume=latest" not in err:
        return f"{sig.name}: no resume line in {err[-300:]!r}"
    else:
        done = _run(run, workers, "resume=latest")
        if done.returncode != 0:
            return f"resume failed: {done.stderr.strip().splitlines()[-1:]}"
    got = _weights(run)
    if got.keys() != reference.keys() or not all(torch.equal(got[k], reference[k]) for k in got):
        return f"{sig.name}: resumed weights differ from the uninterrupted run"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["signals"])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ref = _run(root / "reference")
        if ref.returncode != 0:
            raise SystemExit(f"the reference run failed:\n{ref.stderr[-2000:]}")
        reference = _weights(root / "reference")
        lost = []
        t0 = time.time()
        for i in range(args.trials):
            why = signal_trial(root, rng, reference)
            if why:
                lost.append(why)
                print(f"trial {i + 1}: LOST: {why}", flush=True)
        print(f"signals: tried {args.trials}, survived {args.trials - len(lost)}, lost {len(lost)} "
              f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
