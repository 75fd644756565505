"""The Python API inside a Jupyter kernel: how a run stops on a kernel interrupt.

A kernel interrupt is a SIGINT to the kernel process, so ``fit`` handles it as it handles Ctrl-C: the
optimizer step under way finishes and a checkpoint is saved. What reaches the notebook then is a
``KeyboardInterrupt`` (:class:`RunInterrupted`) rather than the ``SystemExit`` a script exits with,
because IPython reads a ``SystemExit`` as an attempt to quit the kernel.
"""

from __future__ import annotations

import signal
import sys

from .signals import RunStopped


def in_jupyter_kernel() -> bool:
    """True in an IPython kernel (Jupyter, VS Code, Colab); False in a terminal IPython or a script."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


class RunInterrupted(KeyboardInterrupt):
    """A SIGINT stop of ``fit`` in a Jupyter kernel; ``str()`` is the stop line, in Python's words."""

    def __init__(self, stop: RunStopped):
        self.signum, self.step = stop.signum, stop.step
        self.message = str(stop).replace("--set resume=latest", 'resume="latest"')
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def as_notebook_stop(stop: RunStopped) -> BaseException:
    """What ``fit`` raises for ``stop``: a :class:`RunInterrupted` for a SIGINT in a kernel, else ``stop``."""
    return RunInterrupted(stop) if stop.signum == signal.SIGINT and in_jupyter_kernel() else stop
