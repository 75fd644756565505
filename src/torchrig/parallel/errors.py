"""The parallel layer's error: every module of it raises it, so it lives apart from all of them."""

from __future__ import annotations

from ..runtime import RuntimeSetupError


class ParallelConfigError(RuntimeSetupError, ValueError):
    """The degrees of ``parallel`` do not fit the job (world size, strategy, model)."""
