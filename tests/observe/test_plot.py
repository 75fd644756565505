"""The curves people read: a panel per metric family, interval and epoch rows as separate series,
log scale where values span decades, lr on its own panel, several runs overlaid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from helpers import subprocess_env

from torchrig.observe.plot import PlotError, build_figure, plot_runs

pytest.importorskip("matplotlib")


def _rows(scale: float = 1.0) -> list[dict]:
    """Two epochs of 4 steps: interval rows every step, an epoch row (with validation) every 4 steps."""
    rows = []
    for step in range(1, 9):
        rows.append({"step": step, "epoch": (step - 1) // 4 + 1, "kind": "interval", "train/loss": scale * 3 / step ** 2,
                     "train/accuracy": step / 10, "samples_per_s": 900.0, "data_wait": 0.01, "grad_norm": 1.0,
                     "lr": 0.1 * 0.5 ** step})
        if step % 4 == 0:
            rows.append({"step": step, "epoch": step // 4, "kind": "epoch", "train/loss": scale * 1.0 / step,
                         "train/accuracy": step / 9, "val/loss": scale * 1.2 / step, "val/accuracy": step / 11,
                         "lr": 0.1 * 0.5 ** step})
    return rows


def _panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_one_panel_per_family_with_separate_series():
    panels = _panels(build_figure({"run": _rows()}))
    assert list(panels) == ["loss", "accuracy", "learning rate"]  # lr last; throughput and grad norm left out
    loss = {line.get_label(): line for line in panels["loss"].get_lines()}
    assert set(loss) == {"train/loss (interval)", "train/loss (epoch)", "val/loss (epoch)"}
    assert list(loss["train/loss (interval)"].get_xdata()) == list(range(1, 9))
    assert list(loss["train/loss (epoch)"].get_xdata()) == [4, 8] == list(loss["val/loss (epoch)"].get_xdata())
    assert loss["train/loss (epoch)"].get_marker() == "o" and loss["train/loss (interval)"].get_marker() == "None"
    assert loss["val/loss (epoch)"].get_color() != loss["train/loss (epoch)"].get_color()  # train vs validation
    assert [line.get_label() for line in panels["learning rate"].get_lines()] == ["lr"]
    assert list(panels["learning rate"].get_lines()[0].get_xdata()) == list(range(1, 9))  # each step once


def test_a_run_shorter_than_a_log_interval_has_its_learning_rate_drawn():
    """Only epoch rows (log.every_steps above the run's length), or one interval row: the lr still shows."""
    only_epochs = [{"step": 3, "epoch": 1, "kind": "epoch", "train/loss": 1.0, "lr": 0.1},
                   {"step": 6, "epoch": 2, "kind": "epoch", "train/loss": 0.8, "lr": 0.05}]
    lines = _panels(build_figure({"run": only_epochs}))["learning rate"].get_lines()
    assert [(line.get_label(), list(line.get_xdata()), line.get_marker()) for line in lines] == [("lr", [3, 6], "o")]
    one_interval = [{"step": 2, "epoch": 1, "kind": "interval", "train/loss": 1.0, "lr": 0.1},
                    *only_epochs]
    line, = _panels(build_figure({"run": one_interval}))["learning rate"].get_lines()
    assert list(line.get_xdata()) == [2, 3, 6] and list(line.get_ydata()) == [0.1, 0.1, 0.05]


def test_log_scale_only_where_values_span_decades():
    panels = _panels(build_figure({"run": _rows()}))
    assert panels["loss"].get_yscale() == "log"  # 3.0 .. 0.047
    assert panels["learning rate"].get_yscale() == "log"  # 0.05 .. 0.0004
    assert panels["accuracy"].get_yscale() == "linear"  # 0.1 .. 0.89


def test_runs_overlaid_one_colour_each(tmp_path):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(scale)))
    fig = build_figure({"a": _rows(1.0), "b": _rows(2.0)})
    lines = {line.get_label(): line for line in _panels(fig)["loss"].get_lines()}
    assert {"a: val/loss (epoch)", "b: val/loss (epoch)", "a: train/loss (interval)"} <= set(lines)
    assert lines["a: val/loss (epoch)"].get_color() != lines["b: val/loss (epoch)"].get_color()
    assert lines["a: val/loss (epoch)"].get_linestyle() == "--" != lines["a: train/loss (epoch)"].get_linestyle()
    out = plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp.png")
    assert out == tmp_path / "cmp.png" and out.read_bytes().startswith(b"\x89PNG")
    assert plot_runs([tmp_path / "a"]) == tmp_path / "a" / "plots" / "curves.png"


def test_nothing_to_plot_is_one_clear_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "samples_per_s": 5.0}\n')
    with pytest.raises(PlotError, match="holds no values to plot"):
        plot_runs([tmp_path])


def _processes_with(mark: str) -> list[int]:
    """The live processes whose environment holds ``mark`` (every child of a run inherits it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as fh:
                if mark.encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_the_plot_exists_when_torchrig_train_returns_and_no_process_outlives_the_run(tmp_path):
    from PIL import Image

    mark = f"TORCHRIG_TEST_RUN={uuid.uuid4().hex}"
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "torchrig", "train", "--set", "epochs=2", "--set", "max_steps=6",
                          "--set", "log.every_steps=1", "--set", f"run_dir={run}", "--set", "log.progress=none"],
                         env=subprocess_env(**dict([mark.split("=")])), capture_output=True, text=True, timeout=300)
    survivors = _processes_with(mark)  # at once: a process drawing in the background would still be alive
    assert out.returncode == 0, out.stderr[-3000:]
    assert survivors == []
    png = run / "plots" / "curves.png"
    assert f"plots:       {png}\n" in out.stdout
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1280, 1020)  # 5 panels: 2 columns, 3 rows of 640 x 340
        image.verify()
    assert not (run / "plots" / "error.txt").exists()


def test_a_log_of_thousands_of_keys_draws_the_panels_that_matter_and_names_the_rest(tmp_path):
    """A stranger's metrics.jsonl of 3,000 keys (a resume re-plots it): 12 panels (the loss, what validation
    measures, the learning rate last), one line naming what was left out; seconds, not minutes."""
    rows = [{"step": s, "kind": "epoch", "train/loss": 1 / s, "val/loss": 1.1 / s, "val/accuracy": s / 10, "lr": 0.1,
             **{f"train/k{i:04d}": float(i) for i in range(3000)}} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    said = []
    out = plot_runs([tmp_path], tmp_path / "c.png", say=said.append)
    assert out.read_bytes().startswith(b"\x89PNG")
    assert said == ["torchrig: plot: 3003 metric families, 12 panels drawn (loss, accuracy, k0000, k0001, k0002, "
                    "k0003, k0004, k0005, k0006, k0007, k0008, lr); left out: k0009, k0010, k0011, k0012, k0013 … "
                    "(2991 in all)"]


def test_long_logs_are_thinned_and_many_series_capped(tmp_path, monkeypatch):
    from torchrig.observe import plot

    monkeypatch.setattr(plot, "MAX_ROWS", 100)
    rows = [{"step": s, "kind": "interval", "train/loss": 1 / s, **{f"lr/group{g:02d}": 0.1 for g in range(20)}}
            for s in range(1, 1001)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": [1]}\n')
    notes: list[str] = []
    kept = plot.read_rows(tmp_path, notes)
    assert [r["step"] for r in kept] == list(range(1, 1001, 16))  # every 16th: 63 rows, at most 100
    assert notes == [f"torchrig: plot: '{tmp_path / 'metrics.jsonl'}' holds 1000 rows; 63 of them, evenly spread, are "
                     f"drawn"]
    fig = build_figure({"run": kept}, notes)
    assert len(_panels(fig)["learning rate"].get_lines()) == 8
    assert notes[-1] == ("torchrig: plot: at most 8 series of a run per panel; left out: lr/group08 (interval), "
                         "lr/group09 (interval), lr/group10 (interval), lr/group11 (interval), lr/group12 (interval) "
                         "… (12 in all)")


@pytest.mark.parametrize("plot", [True, False])
def test_matplotlib_is_imported_on_a_thread_at_fit_start_only_when_the_run_ends_with_its_plot(tmp_path, monkeypatch,
                                                                                            plot):
    import torchrig
    from helpers import TinyNet, make_classification
    from torchrig.observe import finish

    started, ended = [], []
    monkeypatch.setattr(finish, "import_in_background", lambda: started.append(len(ended)))
    monkeypatch.setattr(finish, "plot_run_or_say", lambda run_dir, say: ended.append(run_dir) or [])
    trainer = torchrig.Trainer(TinyNet(), run_dir=str(tmp_path / "run"), batch_size=8, epochs=1, plot=plot,
                               tensorboard=False, progress="none", checkpoint_every_epochs=0)
    trainer.fit(make_classification())
    assert started == ([0] if plot else [])  # started once, before the end of the run
    assert len(ended) == (1 if plot else 0)


_PLOT_ON_OFF = """
import sys, torch, torchrig
sys.path.insert(0, sys.argv[2])
from helpers import TinyNet, make_classification
assert "matplotlib" not in sys.modules
weights = []
for plot in (True, False):  # the first imports matplotlib on its thread while it trains
    torch.manual_seed(0)
    model = TinyNet(dropout=0.3)
    torchrig.Trainer(model, run_dir=f"{sys.argv[1]}/{plot}", batch_size=4, epochs=2, plot=plot, tensorboard=False,
                     progress="none", checkpoint_every_epochs=0, threads=1).fit(make_classification(200))
    weights.append(model.state_dict())
print(all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]))
"""


def test_a_run_with_its_plot_trains_bitwise_like_one_without(tmp_path):
    """matplotlib imported on a thread while the model trains (a fresh process: not imported yet) changes no
    random number and no result."""
    from pathlib import Path

    helpers = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", _PLOT_ON_OFF, str(tmp_path), helpers], env=subprocess_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"
    assert (tmp_path / "True" / "plots" / "curves.png").exists() and not (tmp_path / "False" / "plots").exists()
