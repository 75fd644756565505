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
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

from ..config.files import LINES_LIMIT, make_dir, read_lines, write_atomic
from ..errors import TorchrigError

PLOT_FILE = "curves.png"
PANEL = (6.4, 3.4)  # inches per panel, at 100 dpi
MARGINS = (0.8, 0.25, 0.55, 0.55, 0.85, 0.8)  # inches: left, right, bottom, top, between columns, between rows
LOG_RATIO = 30.0  # max / min at or above which a panel uses a log y axis (about 1.5 decades)
_NOT_PLOTTED = {"grad_norm", "samples_per_s", "data_wait", "skipped_steps", "epoch_time_s"}
MAX_PANELS = 12  # panels in one figure (6 rows of 2): the most relevant families, the rest named in a line
MAX_LINES = 8  # series of one run in one panel (a learning rate per parameter group ...)
MAX_ROWS = 10_000  # rows of one kind drawn per run; a longer log is evenly thinned
MAX_VALUES = 200_000  # numbers in those rows
MAX_KEY = 200  # characters of a logged key; a longer one is no metric name


class PlotError(TorchrigError, RuntimeError):
    pass


def read_rows(run_dir: Path, notes: Optional[list[str]] = None) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl`` with their numbers (a file from anywhere: read line by line, capped;
    past ``MAX_ROWS`` rows of a kind, evenly thinned). A line that says what was thinned goes to ``notes``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise PlotError(f"run directory '{run_dir}' does not exist")
    if not path.exists():
        raise PlotError(f"'{path}' does not exist; is '{run_dir}' a torchrig run directory?")
    kept = _Rows()
    for _, line in read_lines(path, LINES_LIMIT, "metrics file", "point at a run directory torchrig wrote", PlotError):
        try:
            row = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            continue  # a line cut short by a killed process; the rest is still good
        if isinstance(row, dict) and _number(row.get("step")) is not None:
            kept.add(row)
    rows = kept.rows()
    if not rows:
        raise PlotError(f"'{path}' holds no records yet")
    if kept.thinned and notes is not None:
        notes.append(f"torchrig: plot: '{path}' holds {kept.seen} rows; {len(rows)} of them, evenly spread, are drawn")
    return rows


def _number(value: Any) -> Optional[float]:
    """A finite JSON number as a float; None for anything else (a bool, a string, NaN, an int too large for a
    float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class _Rows:
    """The rows of each kind (interval, epoch), at most ``MAX_ROWS`` of them holding at most ``MAX_VALUES``
    numbers: past that every other row kept is dropped and from then on every other one more is skipped, so
    memory and drawing stay bounded and the curves keep their shape."""

    def __init__(self) -> None:
        self.kinds: dict[str, dict] = {}
        self.seen, self.thinned = 0, False

    def add(self, row: dict) -> None:
        kind = row.get("kind") if row.get("kind") in ("interval", "epoch") else \
            "interval" if "samples_per_s" in row else "epoch"
        entry = self.kinds.setdefault(kind, {"stride": 1, "seen": 0, "rows": [], "values": 0})
        if entry["seen"] % entry["stride"] == 0:
            plain = {k: v for k, v in row.items() if len(k) <= MAX_KEY and _number(v) is not None}
            step = row["step"] if isinstance(row["step"], int) else _number(row["step"])
            entry["rows"].append((self.seen, dict(plain, step=step, kind=kind)))
            entry["values"] += len(plain)
            if len(entry["rows"]) > MAX_ROWS or entry["values"] > MAX_VALUES:
                entry["rows"], entry["stride"], self.thinned = entry["rows"][::2], entry["stride"] * 2, True
                entry["values"] = sum(len(r) - 2 for _, r in entry["rows"])
        entry["seen"] += 1
        self.seen += 1

    def rows(self) -> list[dict]:
        return [row for _, row in sorted((r for e in self.kinds.values() for r in e["rows"]), key=lambda r: r[0])]


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


def _relevance(fam: str, series: list[dict]) -> tuple:
    """What comes first when not every family gets a panel: the loss, the learning rate, what validation
    measures, what training's epochs report, then the rest; by name within each."""
    keys = {key for s in series for key, _ in s.get(fam, {})}
    rank = 0 if fam == "loss" else 1 if fam == "lr" else 2 if any(k.startswith("val/") for k in keys) \
        else 3 if any(k.startswith("train/") for k in keys) else 4
    return rank, fam


def _panels(per_run: dict, notes: Optional[list[str]]) -> list[str]:
    """The families drawn, at most ``MAX_PANELS``, in panel order; the others named in a line of ``notes``."""
    series = list(per_run.values())
    every = sorted({f for s in series for f in s}, key=lambda f: _relevance(f, series))
    drawn, left = every[:MAX_PANELS], every[MAX_PANELS:]
    if left and notes is not None:
        notes.append(f"torchrig: plot: {len(every)} metric families, {MAX_PANELS} panels drawn "
                     f"({', '.join(_panel_order(set(drawn)))}); left out: {_some(left)}")
    return _panel_order(set(drawn))


def _some(names: list[str], shown: int = 5) -> str:
    return ", ".join(names[:shown]) + (f" … ({len(names)} in all)" if len(names) > shown else "")


def _style(key: str, kind: str, run_index: int, runs: int) -> dict:
    """Colour by split for one run, by run when comparing; epoch rows get markers, intervals a thin line."""
    split = 1 if key.startswith("val/") else 0
    colour = f"C{run_index if runs > 1 else split}"
    if kind == "epoch":
        return dict(color=colour, marker="o", markersize=3.5, linewidth=1.6, linestyle="--" if split else "-")
    return dict(color=colour, linewidth=0.9, alpha=0.55)


def build_figure(runs: dict[str, list[dict]], notes: Optional[list[str]] = None) -> Any:
    """A matplotlib Figure of ``runs`` (``{label: rows}``): one panel per family, lr last; at most ``MAX_PANELS``
    panels of ``MAX_LINES`` series per run, what is left out said in lines appended to ``notes``."""
    from matplotlib.figure import Figure

    per_run = {label: series_of(rows) for label, rows in runs.items()}
    families = _panels(per_run, notes)
    if not families:
        raise PlotError("metrics.jsonl holds no values to plot")
    ncols = 1 if len(families) == 1 else 2
    nrows = -(-len(families) // ncols)
    fig = Figure(figsize=(PANEL[0] * ncols, PANEL[1] * nrows))
    fig.subplots_adjust(**_margins(ncols, nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(families):]:
        ax.set_visible(False)
    left_out: list[str] = []
    for ax, fam in zip(axes, families):
        left_out += _draw_panel(ax, fam, per_run)
    if left_out and notes is not None:
        notes.append(f"torchrig: plot: at most {MAX_LINES} series of a run per panel; left out: {_some(left_out)}")
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


def _draw_panel(ax: Any, fam: str, per_run: dict) -> list[str]:
    """Draw family ``fam`` of every run on ``ax``; returns the series left out (``MAX_LINES`` per run)."""
    values: list[float] = []
    left_out = []
    for i, (label, series) in enumerate(per_run.items()):
        drawn = series.get(fam, {})
        if fam == "lr":
            drawn = _one_lr_series(drawn)
        ordered = sorted(drawn.items(), key=lambda kv: (kv[0][0].startswith("val/"), kv[0][1] == "epoch", kv[0][0]))
        left_out += [f"{key} ({kind})" for (key, kind), _ in ordered[MAX_LINES:]]
        for (key, kind), points in ordered[:MAX_LINES]:
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
    return left_out


def _one_lr_series(drawn: dict) -> dict:
    """The learning rate of interval and epoch rows as one series per key: the same value at a step is logged
    by both, and a run shorter than one log interval has only epoch rows (or one interval row)."""
    merged: dict = {}
    for (key, _kind), points in drawn.items():
        merged.setdefault(key, {}).update(dict(points))
    return {(key, "interval"): sorted(points.items()) for key, points in merged.items()}


def plot_runs(run_dirs: list, out: Optional[str | Path] = None, say: Optional[Callable[[str], None]] = None) -> Path:
    """Write the curves of one run (default ``RUN_DIR/plots/curves.png``) or the overlay of several
    (default ``compare.png`` here); ``out`` is a ``.png`` file or a folder. Returns the PNG's path. What is
    left out (rows thinned, panels and series past the caps) is said through ``say`` (default: stderr)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotError("plotting needs matplotlib, a torchrig dependency; pip install matplotlib")
    dirs = [Path(d) for d in run_dirs]
    notes: list[str] = []
    runs = {_label(d, dirs): read_rows(d, notes) for d in dirs}
    for d, rows in zip(dirs, runs.values()):
        if not series_of(rows):
            raise PlotError(f"'{d / 'metrics.jsonl'}' holds no values to plot (only throughput and gradient norms)")
    if out is not None and str(out).endswith(".png"):
        path = Path(out)
    else:
        default_dir = dirs[0] / "plots" if len(dirs) == 1 else Path(".")
        path = (Path(out) if out else default_dir) / (PLOT_FILE if len(dirs) == 1 else "compare.png")
    fig = build_figure(runs, notes)
    for line in notes:
        if say is not None:
            say(line)
        else:
            print(line, file=sys.stderr, flush=True)
    # the folder named is the user's; RUN_DIR/plots is the run's own, and never a link followed
    root = path.parent if out is not None or len(dirs) > 1 else dirs[0]
    return save_figure(fig, path, root, dpi=100)


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


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None,
             say: Optional[Callable[[str], None]] = None) -> list[Path]:
    """The curves of one run as ``[path]`` (``RUN_DIR/plots/curves.png`` unless ``out_dir``)."""
    return [plot_runs([run_dir], out_dir, say)]


def import_in_background() -> threading.Thread:
    """Start importing matplotlib and its Agg backend on a daemon thread (at ``fit``'s start, when the run
    will draw its plot): by the end of the run the import (~0.7 s cold) is done and drawing costs only the
    drawing. It touches no random state and no model; a failure is left for the plot itself to report."""
    thread = threading.Thread(target=_import_matplotlib, name="torchrig-plot-import", daemon=True)
    thread.start()
    return thread


def _import_matplotlib() -> None:
    try:
        import matplotlib.backends.backend_agg  # noqa: F401  (what ``savefig`` renders a PNG with)
        import matplotlib.figure  # noqa: F401
    except Exception:
        pass


def plot_run_or_say(run_dir: Path, say: Callable[[str], None]) -> list[Path]:
    """The end-of-run plot; a failure is one line, never a failed run (plots are a convenience)."""
    try:
        return plot_run(run_dir, say=say)
    except Exception as exc:
        say(f"torchrig: no plots written ({exc})")
        return []
