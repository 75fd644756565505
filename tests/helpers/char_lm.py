"""A user's own character-level transformer LM, as a new user writes one: an ``nn.Embedding``, a ``ModuleList`` of
blocks, a head returning logits ``(batch, positions, classes)``, a ``Dataset`` of token ids and a loss of their own.

Tests import it (``from helpers.char_lm import CharLM``) and copy this file into a user's project
(``UserProject(root, package, SOURCE)``) to name ``build_model`` / ``build_data`` / ``lm_loss`` on the command line.
Tiny on purpose: 13 characters, 8 positions, 2 blocks of width 16.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

TEXT = "to be or not to be that is the question " * 3
CHARS = sorted(set(TEXT))  # 13 classes: never the 8 positions, so the layout is unambiguous
SEQ = 8


class Chars(Dataset):
    """``(ids[i : i + SEQ], ids[i + 1 : i + SEQ + 1])``: each position's target is the next character."""

    def __init__(self, start: int = 0, stop: int = len(TEXT) - SEQ - 1):
        self.ids = torch.tensor([CHARS.index(c) for c in TEXT])
        self.starts = range(start, stop)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int):
        j = self.starts[i]
        return self.ids[j:j + SEQ], self.ids[j + 1:j + SEQ + 1]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """ids ``(B, T)`` -> logits ``(B, T, len(CHARS))``."""

    def __init__(self, dim: int = 16, layers: int = 2, heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(len(CHARS), dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, len(CHARS))

    def forward(self, ids):
        x = self.embed(ids) + self.pos[:ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(logits, targets):
    """The user's own loss: cross-entropy over every position, class-last logits flattened."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(cfg):
    return CharLM()


def build_data(cfg):
    n = len(TEXT) - SEQ - 1
    return Chars(0, n - 32), Chars(n - 32, n - 16), Chars(n - 16, n)


SOURCE = Path(__file__).read_text()
