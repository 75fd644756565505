"""The error of this layer."""

from ..errors import TorchrigError


class ModelError(TorchrigError, ValueError):
    """A model name, option or input shape that no model can take; the message names it and the fix."""
