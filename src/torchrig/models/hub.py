"""Hugging Face models loaded or saved quietly: transformers' progress bars are for interactive use, not for a run's
lines."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (loading and saving weights) off for the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
