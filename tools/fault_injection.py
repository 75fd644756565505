"""Fault injection outside the test suite: many trials, a table of tried / survived / lost.

    python tools/fault_injection.py signals --trials 40      # random signals at random points, then resume
    python tools/fault_injection.py bitflips --trials 400    # one flipped bit in a checkpoint file, then load

A *signals* trial starts a small training run (``tests/helpers/signal_child.py``), sends SIGTERM, SIGINT or
SIGUSR1 (to the process, or to its whole process group as Ctrl-C does) at a random moment, with or
without DataLoader workers, checks the exit code and the resume line, resumes the run to its end and
compares the final weights with an uninterrupted run, bit for bit (a signal that lands after the loop
says so: the weights are compared as they are). A trial *survives* when all of that
holds; it is *lost* otherwise (and the reason is printed).

A *bitflips* trial flips one random bit of ``model.safetensors`` or ``state.pt`` (half each) of a real
checkpoint and reads the file as a resume or ``evaluate`` does. It *survives* when the file is refused as
corrupt, naming it; it is *lost* when it loads. The same flip is also read from a copy whose meta.json
records no checksums (a checkpoint saved before they existed), loaded unchecked (``checkpoint.verify=false``;
with checking on, such a checkpoint is refused whole), to show what the checksums add.
"""

from __future__ import annotations

import argparse
import json
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


def bitflip_trial(ckpt: Path, rng: random.Random, work: Path) -> tuple[str, str]:
    """(with checksums, without): "refused as corrupt", "refused (format)" or "loaded" for one flipped bit."""
    import shutil

    from torchrig.checkpoint import CheckpointError, CorruptCheckpointError, load_weights_file, read_checkpoint

    name = rng.choice(["model.safetensors", "state.pt"])
    size = (ckpt / name).stat().st_size
    bit = rng.randrange(size * 8)
    outcomes = []
    for checksums in (True, False):
        copy = work / ("with" if checksums else "without")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(ckpt, copy)
        if not checksums:
            meta = json.loads((copy / "meta.json").read_text())
            meta.pop("checksums")
            (copy / "meta.json").write_text(json.dumps(meta))
        data = bytearray((copy / name).read_bytes())
        data[bit // 8] ^= 1 << (bit % 8)
        (copy / name).write_bytes(bytes(data))
        try:
            # without checksums: loaded unchecked (checkpoint.verify=false), to show what the formats' own checks catch
            load_weights_file(copy, checksums) if name == "model.safetensors" else read_checkpoint(copy, checksums)
            outcomes.append("loaded")
        except CorruptCheckpointError as exc:
            assert str(copy / name) in str(exc)
            outcomes.append("refused as corrupt")
        except CheckpointError:
            outcomes.append("refused (format)")
    return outcomes[0], outcomes[1]


def bitflips(root: Path, trials: int, rng: random.Random) -> None:
    from collections import Counter

    ref = _run(root / "reference")
    if ref.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{ref.stderr[-2000:]}")
    ckpt = (root / "reference" / "checkpoints" / "latest").resolve()
    with_, without = Counter(), Counter()
    for _ in range(trials):
        a, b = bitflip_trial(ckpt, rng, root)
        with_[a] += 1
        without[b] += 1
    print(f"bitflips: tried {trials}, survived {with_['refused as corrupt']} (refused as corrupt), lost "
          f"{trials - with_['refused as corrupt']} ({dict(with_)}); without checksums: {dict(without)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["signals", "bitflips"])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.kind == "bitflips":
            sys.path.insert(0, str(REPO / "src"))
            return bitflips(root, args.trials, rng)
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
