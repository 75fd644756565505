"""Observability: the metrics logger (metrics.jsonl), progress and terminal views, trackers (CSV,
TensorBoard, MLflow, W&B), plots, throughput (samples/s, FLOPs, MFU), the profiler and the end-of-run
summary. Modules are imported where used, so importing torchrig does not import matplotlib or a tracker."""
