"""A BERT-style encoder classifier, and a Hugging Face ``BertForSequenceClassification`` adapter.

Both take ``(input_ids, attention_mask, token_type_ids)`` (all ``(batch, length)`` int64) and return
logits ``(batch, num_classes)``. Both trim the batch to its longest sequence first, so padding to a
fixed length (which lets the data stay one in-memory tensor) costs nothing in attention.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import suggest
from .errors import ModelError


def trim_padding(input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 token_type_ids: Optional[torch.Tensor]):
    """Cut trailing columns that are padding in every row (one host sync per batch)."""
    if attention_mask is None or torch.compiler.is_exporting():  # an exported graph keeps every column
        return input_ids, attention_mask, token_type_ids
    length = int(attention_mask.sum(dim=1).max())
    length = max(length, 1)
    if length < input_ids.shape[1]:
        input_ids, attention_mask = input_ids[:, :length], attention_mask[:, :length]
        if token_type_ids is not None:
            token_type_ids = token_type_ids[:, :length]
    return input_ids, attention_mask, token_type_ids


class Embeddings(nn.Module):
    """Token + position + segment embeddings, LayerNorm, dropout (BERT's input layer)."""

    def __init__(self, vocab_size: int, hidden: int, max_length: int, type_vocab: int, dropout: float,
                 pad_id: int = 0):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden, padding_idx=pad_id)
        self.positions = nn.Embedding(max_length, hidden)
        self.segments = nn.Embedding(type_vocab, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        # a non-persistent buffer: moves with .to(device), not stored in checkpoints
        self.register_buffer("position_ids", torch.arange(max_length).unsqueeze(0), persistent=False)

    def forward(self, input_ids, token_type_ids=None):
        length = input_ids.shape[1]
        if length > self.positions.num_embeddings:
            raise ModelError(f"sequence of {length} tokens is longer than the model's max_length "
                             f"{self.positions.num_embeddings}")
        x = self.tokens(input_ids) + self.positions(self.position_ids[:, :length])
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = x + self.segments(token_type_ids)
        return self.dropout(self.norm(x))


class SelfAttention(nn.Module):
    """Multi-head self-attention over the non-padding tokens (scaled dot-product kernels)."""

    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        if hidden % heads:
            raise ModelError(f"hidden size {hidden} is not divisible by {heads} attention heads")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.attn_dropout = dropout

    def forward(self, x, mask=None):
        b, n, h = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.attn_dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, n, h))


class EncoderLayer(nn.Module):
    """Post-LayerNorm Transformer block as in BERT: attention, add & norm, GELU MLP, add & norm."""

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float):
        super().__init__()
        self.attention = SelfAttention(hidden, heads, dropout)
        self.norm1 = nn.LayerNorm(hidden, eps=1e-12)
        self.mlp = nn.Sequential(nn.Linear(hidden, intermediate), nn.GELU(), nn.Linear(intermediate, hidden))
        self.norm2 = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        x = self.norm1(x + self.dropout(self.attention(x, mask)))
        return self.norm2(x + self.dropout(self.mlp(x)))


class BertClassifier(nn.Module):
    """BERT-style encoder: embeddings, ``layers`` attention blocks, [CLS] pooler (dense + tanh), classifier."""

    # parallel.tp_plan=auto: each block's MLP split in two (attention's fused q/k/v stays whole)
    tp_plan = {"encoder.*.mlp.0": "colwise", "encoder.*.mlp.2": "rowwise"}

    def __init__(self, vocab_size: int, num_classes: int, hidden: int = 128, layers: int = 2, heads: int = 4,
                 intermediate: Optional[int] = None, max_length: int = 512, type_vocab: int = 2,
                 dropout: float = 0.1, pad_id: int = 0):
        super().__init__()
        self.embeddings = Embeddings(vocab_size, hidden, max_length, type_vocab, dropout, pad_id)
        self.encoder = nn.ModuleList(EncoderLayer(hidden, heads, intermediate or 4 * hidden, dropout)
                                     for _ in range(layers))
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden, num_classes)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:  # BERT's: N(0, 0.02) weights, zero biases, unit LayerNorm
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        input_ids, attention_mask, token_type_ids = trim_padding(input_ids, attention_mask, token_type_ids)
        x = self.embeddings(input_ids, token_type_ids)
        mask = None
        if attention_mask is not None:  # (batch, 1, 1, length): True where a key may be attended
            mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder:
            x = layer(x, mask)
        return self.classifier(self.dropout(self.pooler(x[:, 0])))


class HFBertClassifier(nn.Module):
    """``transformers.BertForSequenceClassification`` built from a ``BertConfig`` (random weights,
    no download), returning plain logits so the Trainer's loss and metrics apply unchanged."""

    def __init__(self, vocab_size: int, num_classes: int, hidden: int = 128, layers: int = 2, heads: int = 4,
                 intermediate: Optional[int] = None, max_length: int = 512, type_vocab: int = 2,
                 dropout: float = 0.1, pad_id: int = 0):
        super().__init__()
        try:
            from transformers import BertConfig, BertForSequenceClassification
        except ImportError:
            raise ModelError("model 'hf_bert' needs the transformers package; pip install 'torchrig[text]' "
                             "(or use the built-in model 'bert')") from None
        config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, intermediate_size=intermediate or 4 * hidden,
                            max_position_embeddings=max_length, type_vocab_size=type_vocab,
                            hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                            pad_token_id=pad_id, num_labels=num_classes)
        self.bert = BertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        input_ids, attention_mask, token_type_ids = trim_padding(input_ids, attention_mask, token_type_ids)
        return self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids).logits


TEXT_MODELS = {"bert": BertClassifier, "hf_bert": HFBertClassifier}


def build_text_model(name: str, vocab_size: int, num_classes: int, max_length: int, options: Optional[dict] = None,
                     pad_id: int = 0) -> nn.Module:
    
    if name not in TEXT_MODELS:
        listing = f"Valid text models: {', '.join(TEXT_MODELS)}"
        raise ModelError(f"unknown text model '{name}'{suggest(name, TEXT_MODELS, listing=listing)}")
    options = dict(options or {})
    options.setdefault("max_length", max_length)
    try:
        return TEXT_MODELS[name](vocab_size=vocab_size, num_classes=num_classes, pad_id=pad_id, **options)
    except TypeError as exc:
        raise ModelError(f"text model '{name}' does not accept options {sorted(options)} ({exc}); valid: "
                         f"hidden, layers, heads, intermediate, max_length, type_vocab, dropout") from None


__all__ = ["BertClassifier", "HFBertClassifier", "build_text_model", "trim_padding", "TEXT_MODELS"]
