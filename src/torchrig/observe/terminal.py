"""What the run prints: the progress bar's postfix, epoch summaries, and the plain-line format.

On a terminal every line fits the terminal's width: the bar keeps at least ``MIN_BAR`` cells, its
postfix (loss, lr, samples/s, data-wait) gets what is left, and an epoch summary shows the values
that fit, most useful first. Elsewhere (a log file, CI, Slurm) step rows and epoch rows are one line
format, ``epoch E/N · step S · <where>  key value  key value ...``, so one grep reads both.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Optional

MIN_BAR = 10  # cells of the bar itself, whatever the width
SEP = " · "
# desc, " |", bar, "| ", "n/total", " ", "elapsed<remaining" and tqdm's ", " before the postfix
BAR_FORMAT = "{desc} |{bar}| {n_fmt}/{total_fmt} {elapsed}<{remaining}{postfix}"
BAR_FORMAT_OPEN = "{desc} · {n_fmt} steps {elapsed} · {rate_fmt}{postfix}"  # a stream's epoch: no total


def fmt(v: Any) -> str:
    """A value in a plain line: 4 decimals, or scientific notation for tiny or huge values."""
    if isinstance(v, float) and abs(v) >= 100:
        return f"{v:.0f}"
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def short(v: Any) -> str:
    """A value on a terminal: 4 decimals, fewer characters for large or tiny values (``0.4123``,
    ``2.5e-04``, ``1234``)."""
    if isinstance(v, float) and v != 0:
        if abs(v) >= 1000:
            return f"{v:.0f}"
        return f"{v:.1e}" if abs(v) < 1e-3 else f"{v:.4f}"
    return str(v)


def width(stream: Any) -> int:
    """Columns of the terminal ``stream`` writes to (``COLUMNS`` wins, as for every CLI tool); 80 for a terminal
    that reports no size (a new pseudo-terminal is 0 × 0 until its owner sets one: ``docker exec -t``, ``script``)."""
    try:
        if not os.environ.get("COLUMNS"):
            columns = os.get_terminal_size(stream.fileno()).columns
            return columns if columns > 0 else 80
    except (AttributeError, OSError, ValueError):
        pass
    return shutil.get_terminal_size((80, 24)).columns or 80


def _loss_key(values: dict) -> Optional[str]:
    if "train/loss" in values:
        return "train/loss"
    return next((k for k in values if k.endswith("loss")), None)


def postfix(values: dict, budget: int) -> str:
    """Loss, lr, samples/s and data-wait in at most ``budget`` characters (long forms when they fit)."""
    loss = _loss_key(values)
    rate, wait = values.get("samples_per_s"), values.get("data_wait")
    long_parts, short_parts = [], []
    if loss is not None:
        long_parts.append(f"loss {short(values[loss])}")
        short_parts.append(long_parts[-1])
    if "lr" in values:
        long_parts.append(f"lr {values['lr']:.3g}")
        short_parts.append(long_parts[-1])
    if rate is not None:
        long_parts.append(f"{rate:.0f} samples/s")
        short_parts.append(f"{rate:.0f}/s")
    if wait is not None:
        long_parts.append(f"data-wait {wait:.0%}")
        short_parts.append(f"wait {wait:.0%}")
    text = SEP.join(long_parts)
    if len(text) <= budget:
        return text
    while short_parts and len(" ".join(short_parts)) > budget:
        short_parts.pop()  # least needed last: data-wait, then samples/s, then lr
    return " ".join(short_parts)


def bar_budget(desc: str, total: int, columns: int) -> int:
    """Characters left for the postfix on a bar of ``columns`` that keeps ``MIN_BAR`` cells."""
    fixed = len(desc) + len(" || ") + 2 * len(str(total)) + 1 + len(" 00:00<00:00") + len(", ")
    return max(0, columns - fixed - MIN_BAR)


def _ordered(row: dict) -> list[str]:
    """Epoch-summary keys, most read first: losses, validation metrics, train metrics, lr, the rest."""
    keys = [k for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]

    def rank(k: str) -> int:
        if k.endswith("loss"):
            return 0 if k.startswith("train/") else 1
        if k.startswith("val/"):
            return 2
        if k.startswith("train/"):
            return 3
        return 4 if k == "lr" or k.startswith("lr/") else 5

    return sorted(keys, key=lambda k: (rank(k), keys.index(k)))


def epoch_summary(epoch: int, epochs: int, step: int, row: dict, columns: int) -> str:
    """One terminal line of at most ``columns`` characters: the values that fit, most read first
    (the first that does not fit ends the line, so no value is shown ahead of a more useful one)."""
    keys = _ordered(row)

    def line(head: str) -> tuple[str, int]:
        text, shown = head, 0
        for k in keys:
            part = f"{SEP}{k} {short(row[k])}"
            if len(text) + len(part) > columns:
                break
            text, shown = text + part, shown + 1
        return text, shown

    text, shown = line(f"epoch {epoch}/{epochs}{SEP}step {step}")
    if shown < len(keys):  # a value is worth more than the step count (the progress bar showed it)
        shorter, more = line(f"epoch {epoch}/{epochs}")
        if more > shown:
            return shorter
    return text


def plain_line(epoch: int, epochs: int, step: Optional[int], where: str, values: dict) -> str:
    """The one format of every step and epoch line printed when not on a terminal."""
    head = f"epoch {epoch}/{epochs}" + (f"{SEP}step {step}" if step is not None else "") + f"{SEP}{where}"
    return "  ".join([head] + [f"{k} {fmt(v)}" for k, v in values.items() if v is not None])


def fit_lines(text: str, columns: int) -> str:
    """A long message broken at its `` · `` separators so that no line is wider than ``columns``
    (paths and hints are never cut inside)."""
    out: list[str] = []
    for line in text.split("\n"):
        current = ""
        for i, part in enumerate(line.split(SEP)):
            joined = part if i == 0 else current + SEP + part
            if i and len(joined) > columns:
                out.append(current)
                current = "  " + part
            else:
                current = joined
        out.append(current)
    return "\n".join(out)
