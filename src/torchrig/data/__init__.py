"""Loaders and samplers: distributed sampling, resumable order, worker seeding, in-memory fast path, mixtures."""

from .loaders import (Batches, DataError, TensorBatches, check_same_data, prefetch_to_device, prepare_eval,
                      prepare_train, to_device)
from .mixture import Mixture
from .packing import PackedDocuments, document_ids, document_mask
from .sampler import ResumableSampler, padding_batches, unshard

__all__ = ["Batches", "DataError", "TensorBatches", "check_same_data", "prepare_eval", "prepare_train", "to_device",
           "prefetch_to_device", "Mixture", "ResumableSampler", "padding_batches", "unshard", "PackedDocuments",
           "document_ids", "document_mask"]
