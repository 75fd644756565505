"""What a person sees: the progress bar and epoch lines in a real terminal (tmux) at 80 and 160
columns, the one plain-line format elsewhere, and the run summary."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from helpers import HELPERS, subprocess_env

from torchrig.observe import terminal

TMUX = shutil.which("tmux")


def _run_in_tmux(tmp_path, columns: int) -> list[str]:
    """Run the child in a detached tmux pane ``columns`` wide; the pane's lines, wrapped lines joined."""
    server = f"torchrig-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # a private tmux server, never a shared one
    done = tmp_path / f"done-{columns}"
    command = f"{sys.executable} {HELPERS / 'terminal_child.py'} {tmp_path / f'run{columns}'} {done}; sleep 120"
    env = subprocess_env(LANG="C.UTF-8", LC_ALL="C.UTF-8")
    env.pop("COLUMNS", None)
    env.pop("TMUX", None)
    tmux = [TMUX, "-L", server]
    try:
        subprocess.run(tmux + ["-f", os.devnull, "new-session", "-d", "-x", str(columns), "-y", "40", command],
                       env=env, check=True, timeout=20)
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        text = subprocess.run(tmux + ["capture-pane", "-p", "-J", "-S", "-"], env=env, check=True,
                              capture_output=True, text=True, timeout=20).stdout
        assert done.exists(), f"the run did not finish in 60 s; the pane shows:\n{text}"
        return [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    finally:
        subprocess.run(tmux + ["kill-server"], env=env, capture_output=True, timeout=20)


@pytest.mark.skipif(TMUX is None, reason="needs tmux")
@pytest.mark.parametrize("columns", [80, 160])
def test_terminal_view_fits_the_width(tmp_path, columns):
    lines = _run_in_tmux(tmp_path, columns)
    shown = "\n".join(lines)
    assert all(len(ln) <= columns for ln in lines), shown
    for epoch in (1, 2):
        bars = [ln for ln in lines if ln.startswith(f"epoch {epoch}/2 |")]
        assert len(bars) == 1, shown  # one bar per epoch, left in place when the epoch ends
        m = re.match(rf"^epoch {epoch}/2 \|(.+)\| 6/6 \S+<\S+, loss \d\.\d+( · | )lr 0\.05( · | )\d+(/s| samples/s)",
                     bars[0])
        assert m, bars[0]
        assert len(m.group(1)) >= terminal.MIN_BAR, bars[0]  # the bar never collapses
        summaries = [ln for ln in lines if ln.startswith(f"epoch {epoch}/2 · step {6 * epoch} · train/loss ")]
        assert len(summaries) == 1 and "val/loss" in summaries[0], shown  # one line per epoch
    if columns >= 160:  # room for everything: long postfix, every value of the epoch
        assert "samples/s · data-wait " in shown and "val/accuracy" in shown and "train/top3" in shown
    done = [ln for ln in lines if ln.startswith("torchrig: done")]
    assert done and re.search(r"12 steps in \d+\.\d s", shown) and "steps/s" in shown, shown
    assert "best val/accuracy 0." in shown, shown


def test_plain_lines_share_one_format(tmp_path):
    """Not on a terminal (a pipe here): step rows and epoch rows are one format, every value shown."""
    out = subprocess.run([sys.executable, str(HELPERS / "terminal_child.py"), str(tmp_path / "run"),
                          str(tmp_path / "done")], env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln for ln in out.stderr.splitlines() if ln.startswith("epoch ")]
    line = re.compile(r"^epoch (\d+)/2 · step (\d+) · (batch \d+/6|epoch end)(  [\w/]+ -?[\d.e+-]+)+$")
    assert len(rows) == 2 * 6 + 2 and all(line.match(r) for r in rows), "\n".join(rows)
    ends = [r for r in rows if "epoch end" in r]
    assert len(ends) == 2 and all("val/accuracy" in r and "train/top3" in r for r in ends)
    assert "samples_per_s" in rows[0] and "data_wait" in rows[0]
    assert re.search(r"^torchrig: done · 12 steps in \d+\.\d s · [\d.]+ steps/s · best val/accuracy 0\.\d{4} "
                     r"\(step-0+12\)$", out.stderr, re.M), out.stderr


def test_postfix_and_summary_cut_to_the_budget():
    values = {"train/loss": 0.41234, "samples_per_s": 81234.5, "data_wait": 0.031, "lr": 0.001, "grad_norm": 2.0}
    assert terminal.postfix(values, 80) == "loss 0.4123 · lr 0.001 · 81234 samples/s · data-wait 3%"
    assert terminal.postfix(values, 40) == "loss 0.4123 lr 0.001 81234/s wait 3%"
    assert terminal.postfix(values, 25) == "loss 0.4123 lr 0.001"
    row = {"train/loss": 0.5, "train/accuracy": 0.8, "val/loss": 0.45, "val/accuracy": 0.85, "lr": 0.001}
    line = terminal.epoch_summary(3, 10, 450, row, 60)
    assert line == "epoch 3/10 · step 450 · train/loss 0.5000 · val/loss 0.4500" and len(line) <= 60
    # where leaving out the step count makes room for one more value, the value wins
    assert terminal.epoch_summary(3, 10, 450, row, 70) == ("epoch 3/10 · train/loss 0.5000 · val/loss 0.4500 · "
                                                          "val/accuracy 0.8500")
    assert terminal.epoch_summary(3, 10, 450, row, 200).endswith("· val/accuracy 0.8500 · train/accuracy 0.8000 "
                                                                  "· lr 0.0010")
    wrapped = terminal.fit_lines("torchrig: a · " + "b" * 50 + " · c", 40)
    assert wrapped.splitlines() == ["torchrig: a", "  " + "b" * 50, "  c"]


def test_a_terminal_that_reports_no_size_counts_as_80_columns(monkeypatch):
    """A new pseudo-terminal is 0 × 0 until its owner sets a size (docker exec -t, script): the bar and the epoch
    lines get 80 columns, not 0 (which showed no bar at all); a real size and COLUMNS still win."""
    import fcntl
    import struct
    import termios

    monkeypatch.delenv("COLUMNS", raising=False)
    master, slave = os.openpty()
    try:
        with os.fdopen(os.dup(slave), "w") as stream:
            assert os.get_terminal_size(stream.fileno()).columns == 0
            assert terminal.width(stream) == 80
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
            assert terminal.width(stream) == 120
            monkeypatch.setenv("COLUMNS", "100")
            assert terminal.width(stream) == 100
    finally:
        os.close(master)
        os.close(slave)
