"""``language-model``: a small GPT-style causal language model (Hugging Face ``GPT2LMHeadModel`` built from a
config, no download) on plain text, ready for pipeline parallelism (``parallel.pp``).

Data: ``data.path`` is a ``.txt`` file (a document per non-empty line) or a folder of ``.txt`` files (a
document each); ``data.val_path`` / ``data.test_path`` likewise, else ``data.val_fraction`` of the documents
is held out (by a hash of each, the same on every machine). Several corpora: ``data.sources: {web: a.txt, code:
b/}`` (each read as ``data.path`` is, tokenized apart) mixed by ``data.mixture: {web: 0.7, code: 0.3}`` (default: by
their sizes) into a ``torchrig.data.Mixture``; held-out documents of every source form one validation set. With no
``data.path``: docstrings of nine Python standard-library packages. The tokenizer is a word-piece vocabulary trained on the training documents (as the
text recipe's, saved as ``RUN_DIR/tokenizer.json``) or ``lm.tokenizer``. Every split's documents are
tokenized, joined with ``[SEP]`` between them and cut into sequences of ``lm.block_size`` tokens; a sample is
``{"input_ids", "labels"}`` (the same ids: the model shifts them and computes its own loss, averaged over the
tokens of the whole optimizer step by torchrig's token normalisation). With ``data.pack: true`` each document
(ending with ``[SEP]``) stays whole instead: the documents are packed into rows of ``lm.block_size`` tokens
(``torchrig.data.PackedDocuments``), and a sample also carries ``position_ids``, which restart with each
document, so that GPT-2's attention never crosses a document boundary (transformers builds the mask from them).

The model is ``GPT2LMHeadModel(GPT2Config(**model.options))`` with the vocabulary and context of the data,
dropout off unless ``model.options`` sets it, and the output layer **not tied** to the embedding: under
``parallel.pp`` the embedding and the head sit on different stages, which cannot share a parameter.
``parallel.pp_split: auto`` cuts its ``transformer.h`` blocks into stages of equal parameter counts (the
embedding counts with the first, the head with the last). ``torchrig predict`` reads a ``.txt`` file of prompts
(one per line) and writes, for each, the ``--topk`` most likely next tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from .. import config as C
from ..config import rules as R
from ..data import Mixture, PackedDocuments
from ..data.datasets.text import TextTokenizer, docstring_splits, train_wordpiece
from .base import Recipe, RecipeError, write_class_predictions
from .common import input_files, say
from .text import TOKENIZER_FILE, read_tokenizer


# GPT2Config's dropouts default to 0.1; off here unless model.options sets them (a small model on little text, and
# the same result on any number of pipeline stages: each stage would draw its own masks)
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@dataclass
class LMConfig:
    """The sequences and the tokenizer of the language-model recipe (the model's sizes are ``model.options``)."""

    block_size: int = C.key(64, R.at_least(2), "tokens per training sequence (the model's context)")
    vocab_size: int = C.key(4000, R.at_least(1), "tokenizer vocabulary budget, trained on the training documents")
    min_frequency: int = C.key(2, R.at_least(1), "a word or piece must occur this often to enter the vocabulary")
    lowercase: bool = C.key(True, R.BOOL, "lowercase the texts before tokenizing")
    tokenizer: Optional[str] = C.key(None, R.optional(R.kind("a file path", str)),
                                     "a tokenizer.json; null: train a word-piece vocabulary (saved in the run "
                                     "directory)")


C.register_section("lm", LMConfig)


class TokenBlocks(Dataset):
    """Consecutive ``block_size`` windows of one token stream, as ``{"input_ids", "labels"}`` samples."""

    def __init__(self, ids: torch.Tensor, block_size: int):
        n = len(ids) // block_size
        self.blocks = ids[:n * block_size].view(n, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class LanguageModelRecipe(Recipe):
    name = "language-model"
    reads_sources = True
    description = ("GPT-style causal language model (Hugging Face GPT2LMHeadModel from a config) on .txt documents; "
                   "embedded default: Python standard-library docstrings; ready for parallel.pp")
    defaults = {
        "epochs": 2, "optim": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01},
        "scheduler": {"name": "warmup_cosine", "warmup_steps": 20}, "clip_grad_norm": 1.0, "loss": "auto",
        "metrics": [],
        "model": {"name": "gpt2", "options": {"n_layer": 4, "n_embd": 128, "n_head": 4}},
        "data": {"batch_size": 16, "val_fraction": 0.1},
        "accumulate": 4,  # four micro-batches per step: what a pipeline overlaps (parallel.pp)
    }

    def __init__(self):
        self._cache: dict[int, tuple[TextTokenizer, dict]] = {}
        self._lengths: list[int] = []  # tokens of each prompt given to predict (its next token follows the last)

    # -------------------------------------------------------------------------------- data
    def _documents(self, cfg: C.Config) -> dict[str, Any]:
        """``{split: documents}``; the training split is ``{source name: documents}`` under ``data.sources``."""
        d = cfg.data
        if d.path is None and not d.sources:
            return {split: [r["text"] for r in rows] for split, rows in docstring_splits().items()}
        named = d.sources or {"": d.path}
        train = {name: _read_documents(Path(p), f"data.sources.{name}" if name else "data.path")
                 for name, p in named.items()}
        docs: dict[str, Any] = {"train": train if d.sources else train[""]}
        for split, key, p in (("val", "data.val_path", d.val_path), ("test", "data.test_path", d.test_path)):
            if p is not None:
                docs[split] = _read_documents(Path(p), key)
        if "val" not in docs and d.val_fraction > 0:
            every = max(2, round(1 / d.val_fraction))  # by a hash of the text: the same split on every machine
            docs["val"] = [t for texts in train.values() for t in texts if zlib.crc32(t.encode()) % every == 0]
            for name, texts in train.items():
                train[name] = [t for t in texts if zlib.crc32(t.encode()) % every != 0]
            docs["train"] = train if d.sources else train[""]
        return docs

    def _prepare(self, cfg: C.Config) -> tuple[TextTokenizer, dict]:
        if id(cfg) in self._cache:
            return self._cache[id(cfg)]
        lm = cfg.lm
        docs = self._documents(cfg)
        named = docs["train"] if isinstance(docs["train"], dict) else {"": docs["train"]}
        for name, texts in named.items():
            if not texts:
                where = f"data.sources.{name} '{cfg.data.sources[name]}'" if name else f"data.path '{cfg.data.path}'"
                raise RecipeError(f"{where} holds no text to train on")
        every = [t for texts in named.values() for t in texts]
        tok = self._load_tokenizer(cfg) if lm.tokenizer else train_wordpiece(every, lm.vocab_size, lm.min_frequency,
                                                                               lm.lowercase)
        lm.tokenizer = TOKENIZER_FILE  # from now on (checkpoint config): the copy in the run dir
        self._cache[id(cfg)] = (tok, docs)
        return tok, docs

    def pack_refusal(self, cfg: C.Config) -> Optional[str]:
        return None  # its documents are token lists: packed into rows of lm.block_size tokens

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        tok, docs = self._prepare(cfg)
        out: dict[str, Any] = {}
        for split, texts in docs.items():
            if isinstance(texts, dict):  # data.sources: one token stream each, drawn by data.mixture
                blocks = {name: self._blocks(cfg, tok, t, f"{split} documents of data.sources.{name}")
                          for name, t in texts.items()}
                out[split] = Mixture(blocks, weights=cfg.data.mixture or None)
            else:
                out[split] = self._blocks(cfg, tok, texts, f"{split} documents")
        if cfg.data.pack and not isinstance(out["train"], Mixture):
            rest = ", ".join(f"{k} {len(v):,} rows ({100 * v.used:.1f} %)" for k, v in out.items() if k != "train")
            say(f"torchrig: language-model data: train {out['train'].describe()}" + (f"; {rest}" if rest else "")
                + f" · vocabulary {len(tok)}")
        else:
            say("torchrig: language-model data: " + ", ".join(f"{k} {len(v)} sequences" for k, v in out.items())
                + f" of {cfg.lm.block_size} tokens{' (packed rows)' if cfg.data.pack else ''} · vocabulary "
                  f"{len(tok)}" + _mixed(out["train"]))
        return out

    @staticmethod
    def _blocks(cfg: C.Config, tok: TextTokenizer, texts: list[str], what: str) -> Any:
        """The documents tokenized, each ending with ``[SEP]``: packed into rows of ``lm.block_size`` tokens
        (``data.pack``), else joined and cut into ``lm.block_size`` sequences."""
        sep = tok.tokenizer.token_to_id("[SEP]")
        ids = [e.ids + [sep] for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
        tokens = sum(len(doc) for doc in ids)
        if cfg.data.pack and tokens:
            blocks = PackedDocuments(ids, cfg.lm.block_size, pad_id=tok.pad_id)
        else:
            blocks = TokenBlocks(torch.tensor([t for doc in ids for t in doc], dtype=torch.long), cfg.lm.block_size)
        if len(blocks) == 0:
            raise RecipeError(f"the {what} give {tokens} tokens, fewer than one sequence of "
                              f"lm.block_size={cfg.lm.block_size}; give more text or a smaller lm.block_size")
        return blocks

    # -------------------------------------------------------------------------------- model
    def _load_tokenizer(self, cfg: C.Config) -> TextTokenizer:
        p = Path(cfg.lm.tokenizer)
        path = Path(cfg.run_dir) / p if not p.is_absolute() and (Path(cfg.run_dir) / p).exists() else p
        if not path.exists():
            raise RecipeError(f"tokenizer '{path}' not found: " + (
                f"predict / evaluate need the run directory the checkpoint came from (it holds {TOKENIZER_FILE})"
                if cfg.lm.tokenizer == TOKENIZER_FILE else "set lm.tokenizer to a tokenizer.json file"))
        return read_tokenizer(path)

    def _tokenizer(self, cfg: C.Config) -> TextTokenizer:
        if id(cfg) in self._cache or not cfg.lm.tokenizer:
            return self._prepare(cfg)[0]
        return self._load_tokenizer(cfg)

    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError:
            raise RecipeError('the language-model recipe builds a Hugging Face GPT2LMHeadModel; pip install '
                              '"torchrig[hf]"') from None
        tok = self._tokenizer(cfg)
        vocab = tok.tokenizer.get_vocab()
        # no key/value cache: training needs none, and with one transformers would not find packed documents
        options = {"tie_word_embeddings": False, "use_cache": False, **NO_DROPOUT, **dict(cfg.model.options or {})}
        try:
            config = GPT2Config(vocab_size=len(tok), n_positions=cfg.lm.block_size, bos_token_id=vocab["[CLS]"],
                                eos_token_id=vocab["[SEP]"], **options)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"config key 'model.options': GPT2Config does not take {options} "
                              f"({str(exc).splitlines()[0]})") from None
        model = GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # what transformers falls back to for this class anyway, without its warning
        return model

    def save_artifacts(self, cfg: C.Config, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._prepare(cfg)[0].save(run_dir / TOKENIZER_FILE)

    # -------------------------------------------------------------------------------- predict
    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        """A ``.txt`` file of prompts, one per line (their last ``lm.block_size`` tokens), padded on the right: a
        causal model's outputs at a prompt's own positions do not see the padding after them."""
        tok = self._tokenizer(cfg)
        if not path.is_file():
            raise RecipeError(f"input '{path}' is not a .txt file of prompts (one per line)")
        lines = [(i, line) for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
        if not lines:
            raise RecipeError(f"input '{path}' holds no prompt")
        encoded = [e.ids[-cfg.lm.block_size:] or [tok.pad_id]
                   for e in tok.tokenizer.encode_batch([t for _, t in lines], add_special_tokens=False)]
        self._lengths = [len(ids) for ids in encoded]
        ids = torch.full((len(encoded), max(self._lengths)), tok.pad_id, dtype=torch.long)
        for row, seq in enumerate(encoded):
            ids[row, :len(seq)] = torch.tensor(seq)
        return ids, [f"{path.name}:{i}" for i, _ in lines]

    def write_predictions(self, cfg: C.Config, outputs: Any, names: list[str], out: Path, topk: int = 5) -> None:
        """For each prompt, the ``topk`` most likely next tokens (decoded) and their probabilities: the
        distribution after its last token, written as every recipe writes class predictions."""
        tok = self._tokenizer(cfg)
        after = torch.stack([outputs[row, self._lengths[row] - 1] for row in range(len(names))]).float()
        vocabulary = [tok.tokenizer.id_to_token(i) for i in range(len(tok))]
        write_class_predictions(after, names, out, topk, class_names=vocabulary)


def _read_documents(path: Path, key: str) -> list[str]:
    """The documents of a ``.txt`` file (one per non-empty line) or of a folder's ``.txt`` files (one each)."""
    files = input_files(path, (".txt",), key)
    docs: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise RecipeError(f"{key} '{f}' is not UTF-8 text") from None
        docs += [line for line in text.splitlines() if line.strip()] if path.is_file() else [text]
    return docs


def _mixed(train: Any) -> str:
    """The start line's part that says how a Mixture draws its sources per epoch."""
    if not isinstance(train, Mixture):
        return ""
    parts = [f"{name} {q} of {n}" for name, q, n in zip(train.names, train.quotas, train.lengths)]
    return " · each epoch draws " + ", ".join(parts) + " (data.mixture)"
