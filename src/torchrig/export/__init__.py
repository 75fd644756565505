"""``torchrig export``: a checkpoint's model as a file another runtime loads (``torch.export``, ONNX, safetensors,
a Hugging Face folder), each checked against the model before it is kept (``exporter.py``)."""

from .exporter import FORMATS, example_inputs, export_checkpoint

__all__ = ["FORMATS", "example_inputs", "export_checkpoint"]
