"""``torchrig train --profile`` and ``log.trackers`` through the command line: the test metrics reach the trackers."""

from __future__ import annotations

import csv

import pytest

from torchrig.cli import main

QUICK = ["--set", "epochs=1", "--set", "max_steps=3", "--set", "log.plot=false", "--set", "log.tensorboard=false"]


def test_train_profile_and_csv_tracker(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *QUICK, "--profile", "--set", "profile.steps=[1,2]", "--set", "log.trackers=[csv]",
                 "--set", f"run_dir={run}", "--set", "log.every_steps=1"]) == 0
    out, err = capsys.readouterr()
    assert (run / "profile" / "trace.json").stat().st_size > 0 and (run / "profile" / "ops.txt").exists()
    assert f"torchrig: profiled steps 1-2: Chrome trace {run / 'profile' / 'trace.json'}" in err
    printed = out.splitlines()[0].split()  # "test: loss 1.2345 accuracy 0.5678"
    assert printed[0] == "test:"
    with open(run / "csv" / "final.csv", newline="") as fh:
        final = dict(list(csv.reader(fh))[1:])
    for name, value in zip(printed[1::2], printed[2::2]):
        assert float(final[f"test/{name}"]) == pytest.approx(float(value), abs=1e-4)
    assert final["run_dir"] == str(run)
    assert f"torchrig: tracker csv {run / 'csv'}" in err.splitlines()
