"""Text data: CSV / JSONL reading, a word-piece tokenizer trained on the training texts, and the
embedded default — docstrings of the Python standard library labelled by their package.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import sysconfig
import unicodedata
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch

from ..common import DataError

# ----------------------------------------------------------------------------- tokenizer

_WORD = re.compile(r"[^\W_]+|[^\w\s]|_")


class WordPieceTokenizer:
    """BERT-style word-piece tokenizer: words are split on spaces and punctuation, then each word
    is cut greedily into the longest vocabulary pieces (``##`` marks a piece inside a word).

    ``train`` builds the vocabulary from the training texts: special tokens, every character seen
    ``min_frequency`` times (alone and as ``##c``), then the word prefixes and inner pieces that save
    the most tokens (count x (length - 1)), until ``vocab_size``. It is deterministic: the same
    texts give the same vocabulary on every rank and machine.
    """

    PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
    SPECIALS = (PAD, UNK, CLS, SEP, MASK)
    MAX_PREFIX, MAX_PIECE = 16, 8  # longest candidate word prefix / inner piece (characters)

    def __init__(self, vocab: Sequence[str], lowercase: bool = True, max_word_chars: int = 64):
        if list(vocab[:len(self.SPECIALS)]) != list(self.SPECIALS):
            raise DataError(f"tokenizer vocabulary must start with {list(self.SPECIALS)}")
        self.vocab = list(vocab)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        self.lowercase = lowercase
        self.max_word_chars = max_word_chars
        self._cache: dict[str, list[int]] = {}
        self.pad_id, self.unk_id, self.cls_id, self.sep_id = (self.index[t] for t in self.SPECIALS[:4])

    def __len__(self) -> int:
        return len(self.vocab)

    # -- splitting ----------------------------------------------------------------------------
    def words(self, text: str) -> list[str]:
        if self.lowercase:
            text = unicodedata.normalize("NFD", text.lower())
            text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        return _WORD.findall(text)

    def word_ids(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        ids: list[int] = []
        if len(word) > self.max_word_chars:
            ids = [self.unk_id]
        else:
            start = 0
            while start < len(word):
                end, found = len(word), None
                while end > start:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    if piece in self.index:
                        found = self.index[piece]
                        break
                    end -= 1
                if found is None:
                    ids = [self.unk_id]
                    break
                ids.append(found)
                start = end
        if len(self._cache) < 200_000:
            self._cache[word] = ids
        return ids

    def tokenize(self, text: str) -> list[str]:
        return [self.vocab[i] for w in self.words(text) for i in self.word_ids(w)]

    def encode(self, text: str, pair: Optional[str] = None, max_length: int = 128) -> tuple[list[int], list[int]]:
        """``([CLS] a [SEP] (b [SEP]), segment ids)``, truncating the longer segment first."""
        a = [i for w in self.words(text) for i in self.word_ids(w)]
        b = [i for w in self.words(pair) for i in self.word_ids(w)] if pair is not None else None
        room = max_length - (3 if b is not None else 2)
        if room < 1:
            raise DataError(f"text.max_length {max_length} leaves no room for tokens")
        if b is None:
            a = a[:room]
        else:
            while len(a) + len(b) > room:
                if len(a) >= len(b):
                    a.pop()
                else:
                    b.pop()
        ids = [self.cls_id] + a + [self.sep_id]
        types = [0] * len(ids)
        if b is not None:
            ids += b + [self.sep_id]
            types += [1] * (len(b) + 1)
        return ids, types

    def encode_batch(self, texts: Sequence[str], pairs: Optional[Sequence[str]] = None,
                     max_length: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``, int64, padded to the longest (<= max_length)."""
        encoded = [self.encode(t, pairs[i] if pairs is not None else None, max_length) for i, t in enumerate(texts)]
        width = max((len(ids) for ids, _ in encoded), default=2)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        types = torch.zeros((len(encoded), width), dtype=torch.long)
        for r, (i, t) in enumerate(encoded):
            ids[r, :len(i)] = torch.tensor(i)
            mask[r, :len(i)] = 1
            types[r, :len(t)] = torch.tensor(t)
        return ids, mask, types

    # -- training and files --------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8000, min_frequency: int = 2,
              lowercase: bool = True) -> "WordPieceTokenizer":
        probe = cls(list(cls.SPECIALS), lowercase)
        counts: Counter = Counter()
        for t in texts:
            counts.update(probe.words(t))
        chars: Counter = Counter()
        for w, n in counts.items():
            for c in w:
                chars[c] += n
        alphabet = sorted(c for c, n in chars.items() if n >= min_frequency)
        vocab = list(cls.SPECIALS) + alphabet + ["##" + c for c in alphabet]
        budget = vocab_size - len(vocab)
        if budget > 0:
            scores: Counter = Counter()
            for w, n in counts.items():
                if len(w) > probe.max_word_chars:
                    continue
                for k in range(2, min(len(w), cls.MAX_PREFIX) + 1):
                    scores[w[:k]] += n
                for i in range(1, len(w)):
                    for j in range(i + 2, min(len(w), i + cls.MAX_PIECE) + 1):
                        scores["##" + w[i:j]] += n
            ranked = sorted(((n * (len(p.lstrip("#")) - 1), p) for p, n in scores.items() if n >= min_frequency),
                            key=lambda sp: (-sp[0], sp[1]))
            vocab += [p for _, p in ranked[:budget]]
        return cls(vocab, lowercase)

    def to_dict(self) -> dict:
        return {"type": "torchrig-wordpiece", "version": 1, "lowercase": self.lowercase,
                "max_word_chars": self.max_word_chars, "vocab": self.vocab}

    def save(self, path: Union[str, Path]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "WordPieceTokenizer":
        path = Path(path)
        if not path.exists():
            raise DataError(f"tokenizer file '{path}' does not exist")
        try:
            d = json.loads(path.read_text())
            if d.get("type") != "torchrig-wordpiece":
                raise ValueError(f"type is {d.get('type')!r}, expected 'torchrig-wordpiece'")
            return cls(d["vocab"], bool(d.get("lowercase", True)), int(d.get("max_word_chars", 64)))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"tokenizer file '{path}' is corrupt or not a torchrig tokenizer ({exc})") from None


# ----------------------------------------------------------------------------- CSV / JSONL


def _read_jsonl(path: Path, key: str) -> tuple[list, list[tuple[int, dict]]]:
    """(columns in order of appearance, (line number, object) per non-empty line) of a JSONL file."""
    columns: list = []
    rows: list[tuple[int, dict]] = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{key} '{path}' line {i} is not valid JSON ({exc}); JSONL needs one "
                                f"object per line") from None
            if not isinstance(obj, dict):
                raise DataError(f"{key} '{path}' line {i} is a {type(obj).__name__}, not an object")
            columns += [k for k in obj if k not in columns]
            rows.append((i, obj))
    return columns, rows


def _read_rows(path: Path, key: str) -> tuple[list, list[tuple[int, dict]]]:
    """(columns, (line number, row) pairs) of a CSV / TSV (header line) or JSONL file."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".csv", ".tsv"):
            with open(path, newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh, delimiter="\t" if suffix == ".tsv" else ",")
                return list(reader.fieldnames or []), [(i + 2, r) for i, r in enumerate(reader)]
        if suffix in (".jsonl", ".ndjson", ".json"):
            return _read_jsonl(path, key)
    except UnicodeDecodeError:
        raise DataError(f"{key} '{path}' is not UTF-8 text") from None
    raise DataError(f"{key} '{path}' has an unsupported type '{suffix}'; give .csv, .tsv or .jsonl")


def read_records(path: Union[str, Path], text_column: str, label_column: Optional[str],
                 pair_column: Optional[str] = None, key: str = "data.path") -> list[dict]:
    """Rows of a CSV / TSV (header line) or JSONL file as ``{"text", "pair", "label", "line"}``.

    ``label_column=None`` reads unlabelled inputs (prediction); otherwise every row needs a label.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{key} '{path}' does not exist; give a .csv, .tsv or .jsonl file")
    if path.is_dir():
        raise DataError(f"{key} '{path}' is a folder; give a .csv, .tsv or .jsonl file")
    columns, rows = _read_rows(path, key)
    if not rows:
        raise DataError(f"{key} '{path}' holds no rows")
    needed = [("text.text_column", text_column)]
    if label_column is not None:
        needed.append(("text.label_column", label_column))
    if pair_column is not None:
        needed.append(("text.text_pair_column", pair_column))
    for setting, col in needed:
        if col not in columns:
            raise DataError(f"{key} '{path}' has no column '{col}' (its columns: {', '.join(map(str, columns)) or 'none'}); "
                            f"set {setting}=NAME to the right column")
    out = []
    for line, r in rows:
        text = r.get(text_column)
        if text is None:
            raise DataError(f"{key} '{path}' line {line}: no value in column '{text_column}'")
        rec = {"text": str(text), "line": line,
               "pair": str(r.get(pair_column, "")) if pair_column is not None else None}
        if label_column is not None:
            label = r.get(label_column)
            if label is None or str(label).strip() == "":
                raise DataError(f"{key} '{path}' line {line}: empty label in column '{label_column}'")
            rec["label"] = str(label).strip()
        out.append(rec)
    return out


# ----------------------------------------------------------------------------- the embedded default

STDLIB_TOPICS = ("asyncio", "email", "http", "importlib", "logging", "multiprocessing", "unittest", "urllib", "xml")
MIN_DOC_CHARS = 40


def _docstrings(tree: ast.AST, prefix: str):
    """(qualified name, docstring) of a module, its classes and functions, recursively."""
    doc = ast.get_docstring(tree)
    if doc:
        yield prefix, doc
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _docstrings(node, f"{prefix}.{node.name}")


def stdlib_docstrings(topics: Sequence[str] = STDLIB_TOPICS) -> list[dict]:
    """Docstrings (>= 40 characters) of the standard library packages ``topics``, read from source
    with ``ast`` (nothing is imported), as ``{"name", "text", "label"}``; duplicates dropped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen_names: Counter = Counter()
    seen_texts: set = set()
    out = []
    for topic in topics:
        pkg = root / topic
        if not (pkg / "__init__.py").exists():
            continue
        for dirpath, dirnames, filenames in os.walk(pkg):
            dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "idle_test", "__pycache__"))
            for f in sorted(filenames):
                if not f.endswith(".py"):
                    continue
                file = Path(dirpath) / f
                module = ".".join(file.relative_to(root).with_suffix("").parts)
                try:
                    tree = ast.parse(file.read_text(encoding="utf-8"))
                except (SyntaxError, UnicodeDecodeError, OSError):
                    continue
                for name, doc in _docstrings(tree, module):
                    doc = doc.strip()
                    if len(doc) < MIN_DOC_CHARS or doc in seen_texts:
                        continue
                    seen_texts.add(doc)
                    seen_names[name] += 1
                    unique = name if seen_names[name] == 1 else f"{name}#{seen_names[name]}"
                    out.append({"name": unique, "text": doc, "label": topic})
    if len({r["label"] for r in out}) < min(2, len(topics)):
        raise DataError(f"the Python standard library source was not found under '{root}' (needed for the "
                        f"embedded text data set); give data.path=FILE.csv|.jsonl")
    return out


def docstring_splits() -> dict[str, list[dict]]:
    """Fixed split by a hash of each docstring's qualified name: 10% test, 10% val, 80% train."""
    parts: dict[str, list[dict]] = {"train": [], "val": [], "test": []}
    for r in stdlib_docstrings():
        h = zlib.crc32(r["name"].encode()) % 10
        parts["test" if h == 0 else "val" if h == 1 else "train"].append(r)
    return parts


__all__ = ["WordPieceTokenizer", "read_records", "stdlib_docstrings", "docstring_splits", "STDLIB_TOPICS"]
