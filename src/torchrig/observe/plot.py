"""``torchrig plot RUN_DIR [RUN_DIR ...]``: the curves of ``metrics.jsonl`` as one PNG.

One panel per metric family (``loss``, ``accuracy`` …) with its own y axis, log-scaled when its
values span decades; train and validation share the family's panel; the learning rate has its own
panel, last. Interval rows (every ``log.every_steps`` steps) and epoch rows (epoch means, validation)
are separate series: a thin line for intervals, a line with markers for epochs. Several run
directories are overlaid, one colour per run, to compare them.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

from ..config.files import make_dir, open_regular, write_atomic
from ..errors import TorchrigError

PLOT_FILE = "curves.png"
PANEL = (6.4, 3.4)  # inches per panel, at 100 dpi
MARGINS = (0.8, 0.25, 0.55, 0.55, 0.85, 0.8)  # inches: left, right, bottom, top, between columns, between rows
LOG_RATIO = 30.0  # max / min at or above which a panel uses a log y axis (about 1.5 decades)
_NOT_PLOTTED = {"grad_norm", "samples_per_s", "data_wait", "skipped_steps", "epoch_time_s"}


class PlotError(TorchrigError, RuntimeError):
    pass


def read_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise PlotError(f"run directory '{run_dir}' does not exist")
    if not path.exists():
        raise PlotError(f"'{path}' does not exist; is '{run_dir}' a torchrig run directory?")
    rows = []
    with open_regular(path, "metrics file", "point at a run directory torchrig wrote", PlotError) as fh:
        text = fh.read().decode(errors="replace")
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a killed process; the rest is still good
    if not rows:
        raise PlotError(f"'{path}' holds no records yet")
    return rows


def family(key: str) -> Optional[str]:
    """The panel of a logged key: ``train/loss`` and ``val/loss`` → ``loss``; ``lr/head`` → ``lr``."""
    if key == "lr" or key.startswith("lr/"):
        return "lr"
    name = key.split("/", 1)[1] if key.startswith(("train/", "val/")) else key
    return None if name.split("/")[-1] in _NOT_PLOTTED else name


def series_of(rows: list[dict]) -> dict[str, dict[tuple[str, str], list]]:
    """``{family: {(key, kind): [(step, value), ...]}}``; ``kind`` is "interval" or "epoch"."""
    out: dict[str, dict[tuple[str, str], list]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        kind = row.get("kind") or ("interval" if "samples_per_s" in row else "epoch")
        for k, v in row.items():
            if k in ("step", "epoch", "kind") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            fam = family(k)
            if fam is not None and math.isfinite(v):
                out[fam][(k, kind)].append((row["step"], v))
    return out


def spans_decades(values: list[float]) -> bool:
    return bool(values) and min(values) > 0 and max(values) / min(values) >= LOG_RATIO


def _panel_order(families: set[str]) -> list[str]:
    rest = sorted(f for f in families if f not in ("loss", "lr"))
    return (["loss"] if "loss" in families else []) + rest + (["lr"] if "lr" in families else [])


def _style(key: str, kind: str, run_index: int, runs: int) -> dict:
    """Colour by split for one run, by run when comparing; epoch rows get markers, intervals a thin line."""
    split = 1 if key.startswith("val/") else 0
    colour = f"C{run_index if runs > 1 else split}"
    if kind == "epoch":
        return dict(color=colour, marker="o", markersize=3.5, linewidth=1.6, linestyle="--" if split else "-")
    return dict(color=colour, linewidth=0.9, alpha=0.55)


def build_figure(runs: dict[str, list[dict]]) -> Any:
    """A matplotlib Figure of ``runs`` (``{label: rows}``): one panel per family, lr last."""
    from matplotlib.figure import Figure

    per_run = {label: series_of(rows) for label, rows in runs.items()}
    families = _panel_order({f for s in per_run.values() for f in s})
    if not families:
        raise PlotError("metrics.jsonl holds no values to plot")
    ncols = 1 if len(families) == 1 else 2
    nrows = -(-len(families) // ncols)
    fig = Figure(figsize=(PANEL[0] * ncols, PANEL[1] * nrows))
    fig.subplots_adjust(**_margins(ncols, nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(families):]:
        ax.set_visible(False)
    for ax, fam in zip(axes, families):
        _draw_panel(ax, fam, per_run)
    fig.suptitle(" vs ".join(runs), fontsize=11)
    return fig


def _margins(ncols: int, nrows: int) -> dict:
    """``subplots_adjust`` fractions for fixed margins in inches (MARGINS): room for tick labels, titles and the
    x label without a layout engine, which measures every text of the figure once more (half the drawing)."""
    left, right, bottom, top, across, down = MARGINS
    width, height = PANEL[0] * ncols, PANEL[1] * nrows
    ax_w = (width - left - right - (ncols - 1) * across) / ncols
    ax_h = (height - bottom - top - (nrows - 1) * down) / nrows
    return dict(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                wspace=across / ax_w, hspace=down / ax_h)


def _draw_panel(ax: Any, fam: str, per_run: dict) -> None:
    values: list[float] = []
    for i, (label, series) in enumerate(per_run.items()):
        drawn = series.get(fam, {})
        if fam == "lr":
            drawn = _one_lr_series(drawn)
        for (key, kind), points in sorted(drawn.items(), key=lambda kv: (kv[0][0].startswith("val/"),
                                                                         kv[0][1] == "epoch", kv[0][0])):
            xs, ys = zip(*points)
            values += ys
            name = key if fam == "lr" else f"{key} ({kind})"
            style = _style(key, kind, i, len(per_run))
            if len(points) < 3:  # a short run: a line of one or two points needs markers to be seen
                style.setdefault("marker", "o")
            ax.plot(xs, ys, label=f"{label}: {name}" if len(per_run) > 1 else name, **style)
    if spans_decades(values):
        ax.set_yscale("log")
    ax.set_title("learning rate" if fam == "lr" else fam, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _one_lr_series(drawn: dict) -> dict:
    """The learning rate of interval and epoch rows as one series per key: the same value at a step is logged
    by both, and a run shorter than one log interval has only epoch rows (or one interval row)."""
    merged: dict = {}
    for (key, _kind), points in drawn.items():
        merged.setdefault(key, {}).update(dict(points))
    return {(key, "interval"): sorted(points.items()) for key, points in merged.items()}


def plot_runs(run_dirs: list, out: Optional[str | Path] = None) -> Path:
    """Write the curves of one run (default ``RUN_DIR/plots/curves.png``) or the overlay of several
    (default ``compare.png`` here); ``out`` is a ``.png`` file or a folder. Returns the PNG's path."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotError("plotting needs matplotlib, a torchrig dependency; pip install matplotlib")
    dirs = [Path(d) for d in run_dirs]
    runs = {_label(d, dirs): read_rows(d) for d in dirs}
    for d, rows in zip(dirs, runs.values()):
        if not series_of(rows):
            raise PlotError(f"'{d / 'metrics.jsonl'}' holds no values to plot (only throughput and gradient norms)")
    if out is not None and str(out).endswith(".png"):
        path = Path(out)
    else:
        default_dir = dirs[0] / "plots" if len(dirs) == 1 else Path(".")
        path = (Path(out) if out else default_dir) / (PLOT_FILE if len(dirs) == 1 else "compare.png")
    # the folder named is the user's; RUN_DIR/plots is the run's own, and never a link followed
    root = path.parent if out is not None or len(dirs) > 1 else dirs[0]
    return save_figure(build_figure(runs), path, root, dpi=100)


def save_figure(fig: Any, path: Path, root: Optional[Path] = None, **options: Any) -> Path:
    """``fig`` as a PNG at ``path`` (its folder made): rendered in memory, then written whole through
    ``files.write_atomic`` (a reader never sees half a PNG; no link at ``path`` or its folder is followed).
    ``root``: the folder the user named, as for ``write_atomic``; ``options``: ``savefig``'s."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **options)
    make_dir(path.parent, root)
    write_atomic(path, buffer.getvalue(), root)
    return path


def _label(d: Path, dirs: list[Path]) -> str:
    """A run's name in legends: its folder, with the parent's for numbered runs (``digits/3``) and when
    two runs share a folder name."""
    names = [x.resolve().name for x in dirs]
    r = d.resolve()
    return f"{r.parent.name}/{r.name}" if names.count(r.name) > 1 or r.name.isdigit() else r.name


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """The curves of one run as ``[path]`` (``RUN_DIR/plots/curves.png`` unless ``out_dir``)."""
    return [plot_runs([run_dir], out_dir)]


def plot_run_or_say(run_dir: Path, say: Callable[[str], None]) -> list[Path]:
    """The end-of-run plot; a failure is one line, never a failed run (plots are a convenience)."""
    try:
        return plot_run(run_dir)
    except Exception as exc:
        say(f"torchrig: no plots written ({exc})")
        return []
