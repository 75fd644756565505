"""What a finished study leaves for people: a table of trials, the best config as YAML, and a PNG.

``trials.csv`` (every trial: number, state, value, parameters, epochs, seconds), ``best.yaml`` (the best
trial's config as the keys that differ from its recipe's defaults: ``torchrig train best.yaml`` trains it
as it is) and ``tune.png`` (the optimisation history and the parameters' importances, drawn with
matplotlib's Agg backend) in the study directory; the table is printed at the end.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Optional

from .. import config as C
from ..checkpoint.io import write_bytes_atomic
from ..observe.plot import save_figure
from .space import value_of
from .trial import seconds_of

# Keys of a trial's config that belong to its own run, not to the configuration found.
RUN_KEYS = ("run_dir", "resume", "resume_weights_only", "overwrite")
# A trial's state as the table, trials.csv, trial.json and the summary line all name it (Optuna's FAIL: failed).
STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}


def rows(study: Any) -> list[dict]:
    """One plain row per trial: number, state, value (a pruned trial's: its last reported), params, epochs, seconds."""
    out = []
    for t in study.get_trials(deepcopy=False):
        steps = t.intermediate_values
        value = t.value if t.state.name == "COMPLETE" else (steps[max(steps)] if steps and t.state.name == "PRUNED"
                                                            else None)
        seconds = t.user_attrs.get("seconds")
        out.append({"trial": t.number, "state": STATES.get(t.state.name, t.state.name.lower()), "value": value,
                    "params": {k: value_of(v) for k, v in t.params.items()}, "epochs": max(steps, default=0),
                    "seconds": seconds_of(t.user_attrs) if seconds is not None else None})
    return out


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def headers(keys: list[str]) -> dict[str, str]:
    """Each key's shortest dotted tail that no other key ends with: ``optim.lr`` -> ``lr``."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(o != key and (o == tail or o.endswith("." + tail)) for o in keys):
                break
        out[key] = tail
    return out


def table(trial_rows: list[dict], keys: list[str], monitor: str, best: Optional[int]) -> str:
    """The trials as an aligned text table (the best one marked ``*``)."""
    names = headers(keys)
    head = ["trial", "state", monitor] + [names[k] for k in keys] + ["epochs", "time"]
    body = []
    for r in trial_rows:
        mark = "*" if r["trial"] == best else ""
        body.append([f"{r['trial']}{mark}", r["state"], _fmt(r["value"])]
                    + [_fmt(r["params"].get(k), 3) for k in keys]  # full precision: trials.csv
                    + [str(r["epochs"]), f"{r['seconds']:.1f} s" if r["seconds"] is not None else "-"])
    widths = [max(len(str(row[i])) for row in [head] + body) for i in range(len(head))]
    lines = ["  ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             .rstrip() for row in [head] + body]
    return "\n".join(lines)


def write_csv(path: Path, trial_rows: list[dict], keys: list[str]) -> None:
    buffer = io.StringIO()
    w = csv.writer(buffer)
    w.writerow(["trial", "state", "value", *keys, "epochs", "seconds"])
    for r in trial_rows:
        w.writerow([r["trial"], r["state"], "" if r["value"] is None else repr(r["value"]),
                    *[r["params"].get(k, "") for k in keys], r["epochs"],
                    "" if r["seconds"] is None else r["seconds"]])
    write_bytes_atomic(path, buffer.getvalue().encode())


def best_yaml(cfg: C.Config, header: str) -> str:
    """``cfg`` as the keys that differ from its recipe's defaults (and its recipe): a file ``torchrig train``
    takes as it is, and reads like one written by hand."""
    import yaml

    from ..recipes.run import build_config

    defaults = C.to_dict(build_config(None, [], cfg.recipe))
    mine = C.to_dict(cfg)
    for key in RUN_KEYS:
        mine.pop(key, None)
    diff = {"recipe": cfg.recipe, **_diff(mine, defaults)}
    body = yaml.safe_dump(diff, sort_keys=False, default_flow_style=False)
    return "".join(f"# {line}\n" for line in header.splitlines()) + body


def _diff(mine: dict, base: dict) -> dict:
    out = {}
    for k, v in mine.items():
        b = base.get(k)
        if isinstance(v, dict) and isinstance(b, dict) and k != "options" and v:
            sub = _diff(v, b)
            if sub:
                out[k] = sub
        elif v != b:
            out[k] = v
    return out


def importances(study: Any, seed: int) -> dict[str, float]:
    """Each parameter's importance (fANOVA, seeded), or {} when there are too few finished trials to tell."""
    import warnings

    import optuna

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(complete) < 2:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=seed))
    except (RuntimeError, ValueError):  # e.g. every finished trial has the same parameters
        return {}


def plot(path: Path, trial_rows: list[dict], weights: dict[str, float], monitor: str, direction: str) -> Path:
    """``tune.png``: the value of each trial with the best so far (left), the parameters' importances (right)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    history, bars = fig.add_axes((0.07, 0.14, 0.42, 0.74)), fig.add_axes((0.66, 0.14, 0.31, 0.74))
    done = [r for r in trial_rows if r["state"] == "complete" and r["value"] is not None]
    pruned = [r for r in trial_rows if r["state"] == "pruned" and r["value"] is not None
              and not math.isnan(r["value"])]
    history.scatter([r["trial"] for r in done], [r["value"] for r in done], color="tab:blue", label="complete",
                    zorder=3)
    if pruned:
        history.scatter([r["trial"] for r in pruned], [r["value"] for r in pruned], color="tab:gray", marker="x",
                        label="pruned (last value)", zorder=3)
    best, xs, ys = None, [], []
    for r in sorted(done, key=lambda r: r["trial"]):
        if best is None or (r["value"] > best if direction == "maximize" else r["value"] < best):
            best = r["value"]
        xs.append(r["trial"])
        ys.append(best)
    if xs:
        last = max(r["trial"] for r in trial_rows)
        if last > xs[-1]:  # the best so far holds to the last trial
            xs, ys = xs + [last], ys + [ys[-1]]
        history.step(xs, ys, where="post", color="tab:red", label="best so far")
    from matplotlib.ticker import MaxNLocator

    history.xaxis.set_major_locator(MaxNLocator(integer=True))
    history.set(title="optimisation history", xlabel="trial", ylabel=monitor)
    history.legend(loc="best", fontsize=8)
    history.grid(alpha=0.3)
    if weights:
        names = list(weights)[::-1]
        bars.barh(names, [weights[n] for n in names], color="tab:green")
        bars.set(title="parameter importances (fANOVA)", xlabel="importance")
    else:
        bars.set_axis_off()
        bars.text(0.5, 0.5, "importances need two finished trials\nwith different parameters", ha="center",
                  va="center")
    return save_figure(fig, path)
