"""Data sets that ship with torchrig or its dependencies (nothing is downloaded)."""

from .digits import digits_arrays, digits_split

__all__ = ["digits_arrays", "digits_split"]
