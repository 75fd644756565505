"""``torchrig plot RUN_DIR``: loss, metric and learning-rate curves from metrics.jsonl as PNG files."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable

from ..errors import TorchrigError


class PlotError(TorchrigError, RuntimeError):
    pass


def read_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise PlotError(f"run directory '{run_dir}' does not exist")
    if not path.exists():
        raise PlotError(f"'{path}' does not exist; is '{run_dir}' a torchrig run directory?")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a killed process; the rest is still good
    if not rows:
        raise PlotError(f"'{path}' holds no records yet")
    return rows


def plot_run_or_say(run_dir: Path, say: Callable[[str], None]) -> list[Path]:
    """The end-of-run plots; a failure is one line, never a failed run (plots are a convenience)."""
    try:
        return plot_run(run_dir)
    except Exception as exc:
        say(f"torchrig: no plots written ({exc})")
        return []


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``loss.png``, ``metrics.png`` and ``lr.png`` (those with data) and return their paths."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("plotting needs matplotlib; pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_rows(run_dir)
    series: dict[str, list] = defaultdict(list)
    for row in rows:
        for k, v in row.items():
            if k in ("step", "epoch") or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            series[k].append((row["step"], v))
    groups = {
        "loss": sorted(k for k in series if k.endswith("loss")),
        "lr": sorted(k for k in series if k == "lr" or k.startswith("lr/")),
    }
    skip = {"grad_norm", "samples_per_s", "data_wait", "skipped_steps", "epoch_time_s"}
    groups["metrics"] = sorted(k for k in series if k not in groups["loss"] + groups["lr"]
                               and k.split("/")[-1] not in skip)
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in groups.items():
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for k in keys:
            xs, ys = zip(*series[k])
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=k)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(name)
        if name == "lr":
            ax.set_yscale("log") if all(y > 0 for k in keys for _, y in series[k]) else None
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{run_dir.name}: {name}")
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
