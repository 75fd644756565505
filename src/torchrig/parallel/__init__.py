"""How one model is spread over the processes: DDP / FSDP2 / DataParallel wrapping, SyncBatchNorm,
gradient synchronisation across an accumulation window."""

from .wrap import no_sync, no_sync_all, resolve_strategy, wrap_model

__all__ = ["wrap_model", "resolve_strategy", "no_sync", "no_sync_all"]
