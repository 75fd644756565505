"""The README's Tuning commands run as written, made short: 2 trials of 1 epoch instead of 12 of 15, a
30-step lr sweep, a 1-epoch training of the best config. Every line of the block runs, in order, in one
shell (``set -e``), in a temporary directory; what each command promises is checked after."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from helpers import REPO, subprocess_env  # noqa: E402

QUICK = "--set epochs=1 --set log.progress=none --set log.plot=false --set log.tensorboard=false"


def tuning_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Tuning\n"):]
    section = section[:section.index("\n## ", 1)]
    return re.search(r"^```bash\n(.*?)^```", section, re.S | re.M).group(1)


def shortened(block: str) -> str:
    """The block with the same commands made quick (the comments dropped). The ``torchrig launch`` line is left
    out here: test_tune.py runs that command (two DDP ranks, four trials, a pruned one) on its own."""
    lines = []
    for line in block.splitlines():
        command = line.split("  #")[0].rstrip()
        if command.startswith("torchrig launch "):
            continue
        if command.startswith("torchrig "):
            command = command.replace("--trials 12", "--trials 2")
            if " tune " in f"{command} " or command.startswith("torchrig train"):
                command += f" {QUICK}"
            if command.split()[1] == "lr-find":
                command += " --steps 30 --start-lr 1e-5"
        lines.append(command)
    return "\n".join(lines) + "\n"


def test_the_block_names_every_command():
    block = tuning_block()
    for command in ("torchrig summary", "torchrig lr-find", "torchrig tune --space space.yaml --trials 12",
                    "--resume", "torchrig train runs/tune/digits/best.yaml", "--parallel 2",
                    "torchrig launch --nproc-per-node 2 -- tune"):
        assert command in block


@pytest.mark.slow
def test_the_tuning_commands_run(tmp_path):
    import json

    import optuna

    from helpers import dist_procs, read_jsonl
    from torchrig.recipes.run import build_config

    script = tmp_path / "tuning.sh"
    script.write_text(f'set -e\ntorchrig() {{ "{sys.executable}" -m torchrig "$@"; }}\n' + shortened(tuning_block()))
    # its own process group, killed whole at the limit: the shell, the studies and their parallel workers
    r = dist_procs.run(["bash", str(script)], timeout=540, env=subprocess_env(), cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    out = r.stdout
    assert out.startswith("torchrig: model DigitsCNN")  # torchrig summary
    assert "torchrig: suggested lr " in out and (tmp_path / "lr_find.png").exists()  # torchrig lr-find
    for study in ("digits", "par"):
        folder = tmp_path / "runs" / "tune" / study
        assert (folder / "best.yaml").exists() and (folder / "tune.png").exists(), study
        assert sorted(p.name for p in (folder / "trials").iterdir()) == ["0", "1"], study
        trials = optuna.load_study(study_name="torchrig", storage=f"sqlite:///{folder / 'study.db'}").get_trials()
        assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], study  # one epoch: nothing to prune
        assert trials[0].params != trials[1].params, study
        for t in trials:  # its value: the val/accuracy its one epoch logged, recorded beside it as Optuna holds it
            run = folder / "trials" / str(t.number)
            logged = [row["val/accuracy"] for row in read_jsonl(run / "metrics.jsonl") if row.get("kind") == "epoch"]
            assert logged == [t.value] and t.intermediate_values == {1: t.value} and 0.1 < t.value <= 1, (study, t)
            record = json.loads((run / "trial.json").read_text())
            assert (record["state"], record["value"], record["params"]) == ("complete", t.value, t.params), study
        best = max(trials, key=lambda t: t.value)
        chosen = build_config(str(folder / "best.yaml"))
        assert (chosen.optim.lr, chosen.data.batch_size) == (best.params["optim.lr"], best.params["data.batch_size"])
    assert out.count("tune: 2 trials") == 3  # the study, its resume (nothing left to run), parallel
    assert "tune: 2 workers" in out
    assert "test: loss" in out  # torchrig train took best.yaml as it is
    assert Path(tmp_path / "space.yaml").read_text().startswith("optim.lr: {log_uniform: [1e-4, 3e-2]}")
