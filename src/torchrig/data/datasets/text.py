"""Text data: CSV / JSONL reading, the tokenizer (Hugging Face ``tokenizers``: a word-piece vocabulary
trained on the training texts, or a saved one), and the embedded default — docstrings of the Python
standard library labelled by their package.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import sysconfig
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from ...config.files import write_atomic
from ..common import DataError

# ----------------------------------------------------------------------------- tokenizer

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` as the text recipe uses it: its post-processor adds the special tokens
    (``[CLS] a [SEP] (b [SEP])`` with segment ids 0 / 1), inputs are truncated to ``max_length`` (the longer
    segment first) and a batch is padded to its longest row with the tokenizer's padding token."""

    def __init__(self, tokenizer: Any, source: str = "the tokenizer"):
        if tokenizer.padding is None:
            raise DataError(f"{source} names no padding token; give a tokenizer saved by torchrig train, or a "
                            f"tokenizer folder whose tokenizer has a pad token")
        self.tokenizer = tokenizer
        self.pad_id: int = tokenizer.padding["pad_id"]

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_batch(self, texts: Sequence[str], pairs: Optional[Sequence[str]] = None,
                     max_length: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask, token_type_ids)``, int64, padded to the longest (<= max_length)."""
        self.tokenizer.enable_truncation(max_length, strategy="longest_first")
        encodings = self.tokenizer.encode_batch(list(zip(texts, pairs)) if pairs is not None else list(texts))
        width = len(encodings[0].ids) if encodings else 2

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(e, name) for e in encodings], dtype=torch.long).view(len(encodings), width)

        return column("ids"), column("attention_mask"), column("type_ids")

    def save(self, path: Union[str, Path]) -> None:
        """As a ``tokenizer.json`` (Hugging Face's format: ``tokenizers.Tokenizer.from_file`` reads it too)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)  # (the run directory)
        write_atomic(path, (self.tokenizer.to_str() + "\n").encode("utf-8"), root=path.parent)

    @classmethod
    def from_json(cls, data: bytes, source: str, todo: str) -> "TextTokenizer":
        """The tokenizer of a ``tokenizer.json``'s bytes, parsed by ``tokenizers`` (data: nothing in it runs)."""
        Tokenizer = _tokenizers().Tokenizer
        try:
            tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception for a bad file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"{source} is not a Hugging Face tokenizer.json ({first}); {todo}") from None
        return cls(tokenizer, source)

    @classmethod
    def from_folder(cls, path: Union[str, Path]) -> "TextTokenizer":
        """A tokenizer folder (``save_pretrained``'s) through ``transformers.AutoTokenizer``: local files only,
        no code from the folder run (``trust_remote_code=False``)."""
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError('text.tokenizer: a tokenizer folder is read with transformers, which is not installed; '
                            'pip install "torchrig[text]"') from None
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"text.tokenizer '{path}': transformers found no tokenizer there ({first}); give a folder "
                            f"written by save_pretrained (tokenizer.json, tokenizer_config.json)") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or hf.pad_token_id is None:
            missing = "a tokenizer.json (a fast tokenizer)" if backend is None else "a pad token"
            raise DataError(f"text.tokenizer '{path}': {type(hf).__name__} has no {missing}; the text recipe "
                            f"needs both")
        tokenizer = type(backend).from_str(backend.to_str())  # a copy: its padding and truncation are this recipe's
        tokenizer.enable_padding(pad_id=hf.pad_token_id, pad_token=hf.pad_token)
        return cls(tokenizer, f"text.tokenizer '{path}'")


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError('the text recipe\'s tokenizer is Hugging Face tokenizers, which is not installed; '
                        'pip install "torchrig[text]"') from None
    return tokenizers


def train_wordpiece(texts: Sequence[str], vocab_size: int = 8000, min_frequency: int = 2,
                    lowercase: bool = True) -> TextTokenizer:
    """A BERT-style word-piece tokenizer trained on ``texts`` by ``tokenizers.trainers.WordPieceTrainer``:
    BERT's normalizer (lowercase and no accents when ``lowercase``) and pre-tokenizer (spaces and
    punctuation), ``##`` before a piece inside a word, the special tokens of SPECIALS first.

    The same texts give the same vocabulary in every process (every rank trains its own): the trainer
    numbers the ``##c`` pieces in the order of a hash map, which differs between processes, and breaks ties
    between merges by those numbers (huggingface/tokenizers#1794); registered up front, they are numbered here."""
    _tokenizers()
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    chars = sorted({c for t in texts for c in normalizer.normalize_str(t) if not c.isspace()})
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                        special_tokens=[*SPECIALS, *("##" + c for c in chars)],
                                        continuing_subword_prefix="##")
    probe = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    probe.normalizer, probe.pre_tokenizer = normalizer, pre_tokenizers.BertPreTokenizer()
    probe.train_from_iterator(texts, trainer)
    vocab = probe.get_vocab()
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))  # the ##c pieces as plain vocabulary
    tokenizer.normalizer, tokenizer.pre_tokenizer, tokenizer.decoder = normalizer, probe.pre_tokenizer, decoders.WordPiece()
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.enable_padding(pad_id=vocab["[PAD]"], pad_token="[PAD]")
    return TextTokenizer(tokenizer)


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


__all__ = ["TextTokenizer", "train_wordpiece", "read_records", "stdlib_docstrings", "docstring_splits", "STDLIB_TOPICS"]
