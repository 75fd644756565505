"""Packed documents: token documents laid into rows of a fixed length, each document kept apart from the others.

A row holds several whole documents (a document longer than a row is cut into row-sized pieces, each piece a
document of its own) and is an ordinary map-style sample ``{"input_ids", "labels", "position_ids"}`` of
``length`` tokens each:

* ``position_ids`` restart at 0 with every document (and with the row's padding): a model keeps documents apart
  by them. Hugging Face causal LMs do it themselves when given ``position_ids`` without an ``attention_mask``
  (transformers builds the block-diagonal causal mask from them; flash-attention's variable-length path reads
  them on CUDA); a plain PyTorch model builds its mask with :func:`document_mask` (FlexAttention's
  ``BlockMask``, or a boolean mask for ``scaled_dot_product_attention``).
* ``labels`` are the ``input_ids`` (a causal model shifts them, as Hugging Face's do), -100 at each document's
  first token (nothing before it in the row may predict it) and on the padding: no token predicts across a
  boundary and the padding never counts. Since every row starts with a document, ``labels[:, 0]`` is always
  -100: the valid tokens are the same whether a loss shifts the labels or not.

Packing is done once, by best-fit decreasing on the lengths (longest first, each into the row it fills
best), a pure function of the documents and the row length: the rows are the same on every process and every
run, so a run's position in its data is its sampler's (exact and elastic resume, like any map-style data).
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, Optional, Sequence

import torch
from torch.utils.data import Dataset

from ..runtime.modules import unwrap
from .batches import signature
from .common import DataError
from .mixture import Mixture

IGNORE = -100  # the label PyTorch's cross_entropy and Hugging Face's losses skip


def pack_rows(lengths: Sequence[int], length: int) -> list[list[int]]:
    """Rows of item indices, each row's lengths summing to at most ``length`` (every length ``<= length``):
    best-fit decreasing, ties broken by index, so the result depends on nothing else."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    rooms: list[int] = []  # the free tokens that some row has, ascending
    rows_with: dict[int, list[int]] = {}  # free tokens -> rows with exactly that much room
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):  # no row has room: a new one
            row, room = len(rows), length
            rows.append([])
        else:
            room = rooms[k]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rows_with[room], rooms[k]
        rows[row].append(i)
        left = room - n
        if left:
            if left not in rows_with:
                bisect.insort(rooms, left)
                rows_with[left] = []
            rows_with[left].append(row)
    return rows


def _pieces(documents: Iterable[Any], length: int) -> tuple[list[torch.Tensor], int]:
    """Every document as 1-D long tensors of at most ``length`` tokens (empty documents left out), and how many
    non-empty documents there were."""
    pieces: list[torch.Tensor] = []
    count = 0
    for i, doc in enumerate(documents):
        ids = torch.as_tensor(doc)
        if ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise DataError(f"PackedDocuments: document {i} is a {ids.dtype} tensor of shape {tuple(ids.shape)}, "
                            f"not a flat list of token ids; give each document as a list of integers")
        if len(ids):
            count += 1
            pieces += list(ids.to(torch.long).split(length))
    return pieces, count


class PackedDocuments(Dataset):
    """Token documents packed into rows of ``length`` tokens (see the module's text for what a row holds).

    ``documents``: any iterable of token-id sequences (lists, tensors, arrays); ``pad_id`` fills each row's
    tail (its labels are -100). ``len()`` is the number of rows; :meth:`describe` says how full they are.
    """

    def __init__(self, documents: Iterable[Any], length: int, pad_id: int = 0):
        if not isinstance(length, int) or isinstance(length, bool) or length < 2:
            raise DataError(f"PackedDocuments: length={length!r} is not a row length; give an integer >= 2")
        pieces, self.documents = _pieces(documents, length)
        self.length, self.pieces = length, len(pieces)
        rows = pack_rows([len(p) for p in pieces], length)
        order = [i for row in rows for i in row]
        sizes = torch.tensor([len(pieces[i]) for i in order], dtype=torch.long)
        flat = torch.cat([pieces[i] for i in order]) if order else torch.zeros(0, dtype=torch.long)
        self.tokens = len(flat)
        starts = torch.cumsum(sizes, 0) - sizes  # each piece's first token in ``flat``
        position = torch.arange(self.tokens) - torch.repeat_interleave(starts, sizes)
        labels = flat.clone()
        labels[starts] = IGNORE
        row_sizes = torch.tensor([sum(len(pieces[i]) for i in row) for row in rows], dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(len(rows)), row_sizes)
        column = torch.arange(self.tokens) - torch.repeat_interleave(torch.cumsum(row_sizes, 0) - row_sizes,
                                                                     row_sizes)
        self.input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
        self.labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
        # the padding is a segment of its own: its positions count from 0 where it starts
        self.position_ids = (torch.arange(length) - row_sizes[:, None]).clamp(min=0)
        self.input_ids[row, column], self.labels[row, column], self.position_ids[row, column] = flat, labels, position

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i], "position_ids": self.position_ids[i]}

    @property
    def used(self) -> float:
        """The share of the rows' tokens that are documents' (not padding), in [0, 1]."""
        return self.tokens / max(1, len(self) * self.length)

    def describe(self) -> str:
        """``packed 1,234 documents into 310 rows of 256 tokens: 97.1 % of tokens used``."""
        cut = f" ({self.pieces:,} pieces)" if self.pieces != self.documents else ""
        return (f"packed {self.documents:,} documents{cut} into {len(self):,} rows of {self.length} tokens: "
                f"{100 * self.used:.1f} % of tokens used")


def is_packed(data: Any) -> bool:
    """Whether ``data`` (or the Dataset of a DataLoader) is :class:`PackedDocuments`, or a Mixture of some."""
    data = getattr(data, "dataset", data)
    if isinstance(data, Mixture):
        return any(is_packed(s) for s in data.sources)
    return isinstance(data, PackedDocuments)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document within its row, 0, 1, … (a new document wherever the position restarts at 0):
    ``(batch, length)`` long, from a packed batch's ``position_ids``."""
    return torch.cumsum(position_ids == 0, dim=-1) - 1


def document_mask(position_ids: torch.Tensor, dense: bool = False, block_size: int = 128) -> Any:
    """The attention mask of a packed batch: causal within each document, nothing across documents.

    By default FlexAttention's ``BlockMask``, for ``flex_attention(q, k, v, block_mask=...)``: made once per batch
    and shared by every layer and head, fused under ``torch.compile`` (on the CPU, torch 2.14's FlexAttention runs
    forward only, in eager mode: no backward). ``dense=True``: a boolean ``(batch, 1, length, length)`` tensor,
    True where a query may attend, for ``F.scaled_dot_product_attention(q, k, v, attn_mask=...)``, which trains
    anywhere (the CPU included) at the cost of a ``length × length`` mask per row."""
    docs = document_ids(position_ids)
    batch, length = docs.shape
    if dense:
        causal = torch.ones(length, length, dtype=torch.bool, device=docs.device).tril()
        return (docs[:, :, None] == docs[:, None, :])[:, None] & causal
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    return create_block_mask(same_document_causal, B=batch, H=None, Q_LEN=length, KV_LEN=length,
                             device=docs.device, BLOCK_SIZE=block_size)


def check_model(model: Any, pipelined: bool, input_keys: Optional[Sequence[str]] = None, cp: int = 1) -> None:
    """Refuse, in one line, a model that cannot keep packed documents apart (see the module's text); ``cp``: the
    context-parallel degree (PyTorch's ring attention is causal over the whole sequence: it cannot mask documents)."""
    name = type(unwrap(model)).__name__
    if cp > 1:
        raise DataError(f"packed documents under parallel.cp={cp}: PyTorch's ring attention is causal over the whole "
                        f"sequence and cannot carry a per-document mask, so {name}'s attention would cross the "
                        f"documents of a row; set parallel.cp=1, or data.pack=false")
    if pipelined:
        raise DataError(f"packed documents under parallel.pp: the pipeline passes only hidden states between its "
                        f"stages, so the document boundaries (position_ids) would not reach {name}'s later "
                        f"blocks; set parallel.pp=1, or data.pack=false")
    sig = signature(model)
    if "position_ids" not in sig.keywords:
        raise DataError(f"packed documents: {name}.{sig.text} has no position_ids parameter, so it cannot keep the "
                        f"documents of a row apart; take position_ids and mask attention with "
                        f"torchrig.data.document_mask(position_ids) (docs/your-code.md), or set data.pack=false")
    if input_keys is not None and "position_ids" not in input_keys:
        raise DataError(f"packed documents: data.input_keys={list(input_keys)} leaves out position_ids, which "
                        f"keep the documents of a row apart; add position_ids to data.input_keys")
    lacks = _hugging_face_lacks(unwrap(model))
    if lacks:
        raise DataError(f"packed documents: {name} {lacks[0]}, so its attention would cross the documents of a row; "
                        f"{lacks[1]}")


def _hugging_face_lacks(model: Any) -> Optional[tuple[str, str]]:
    """``(what a Hugging Face model lacks to read packed rows from position_ids, what to do)``, or None: its base
    model must build its mask with transformers' ``create_causal_mask`` (which finds the documents in the
    position ids), and run without a key/value cache (with one, transformers skips that search)."""
    import inspect

    if not any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__):
        return None
    if getattr(getattr(model, "config", None), "use_cache", False):
        return ("has config.use_cache=True, and transformers looks for the documents in position_ids only "
                "without a key/value cache", "set model.config.use_cache = False (training needs no cache)")
    base = getattr(model, "base_model", model)
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return None  # no source to read: taken at its word
    if "create_causal_mask" not in source:
        return (f"(base {type(base).__name__}) does not build its attention mask with transformers' "
                f"create_causal_mask, which finds the documents in position_ids", "set data.pack=false")
    return None
