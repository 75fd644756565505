"""``text-classification``: a BERT-style encoder on CSV / JSONL texts with a word-piece tokenizer.

Data: ``data.path`` (and optional ``data.val_path`` / ``data.test_path``) is a ``.csv``, ``.tsv`` or
``.jsonl`` file with a text column and a label column (``text.text_column`` / ``text.label_column``;
``text.text_pair_column`` adds a second segment). Without a validation file ``data.val_fraction`` of
each label is held out with a fixed seed. With no ``data.path``: docstrings of nine Python
standard-library packages, labelled by package, with a fixed split by name hash.

The tokenizer (Hugging Face ``tokenizers``) is a word-piece vocabulary trained on the training texts, or
the one of ``text.tokenizer``: a local tokenizer folder (``transformers.AutoTokenizer``, no download) or a
``tokenizer.json``. It is saved as ``RUN_DIR/tokenizer.json``, which evaluate and predict read back (as
data: a regular file of bounded size, parsed by ``tokenizers``); the label names go into the run's config.
``RUN_DIR/data_summary.json`` records the split sizes and the majority-class baseline accuracy of each split.

Texts are not packed (``data.pack`` is refused): a text has one label, read from the encoder's summary of the
whole sequence (its first token's output), so a row holding several texts would need an output and a label per
text, which a sequence-classification model does not give.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import TensorDataset

from .. import config as C
from ..config import rules as R
from ..config.files import MiB, read_regular, write_atomic
from ..data import DataError
from ..data.datasets.text import TextTokenizer, docstring_splits, read_records, train_wordpiece
from .base import Recipe, RecipeError
from .common import input_files, say, stratified_split

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_LIMIT = 64 * MiB  # a tokenizer.json: BERT's is 0.7 MB, large multilingual ones ~20 MB


def _column(v: Any) -> str:
    if not R.accept(isinstance(v, str), v).strip():
        raise C.Refused(f"must name a column, got {v!r}")
    return v


_COLUMN = C.Rule("a column name", _column)


@dataclass
class TextConfig:
    """CSV / JSONL columns, the tokenizer and the sequence length (tokens), for the text-classification recipe."""

    text_column: str = C.key("text", _COLUMN, "the column (CSV) or field (JSONL) holding the text")
    text_pair_column: Optional[str] = C.key(None, R.optional(R.kind("a column name", str)),
                                            "a second segment (token_type 1), e.g. for sentence pairs")
    label_column: str = C.key("label", _COLUMN, "the column (CSV) or field (JSONL) holding the label")
    max_length: int = C.key(128, R.at_least(3), "tokens per sample including [CLS] / [SEP] (at least 4 with a "
                                                "text_pair_column); longer texts are truncated")
    vocab_size: int = C.key(8000, R.at_least(1), "tokenizer vocabulary budget, trained on the training texts")
    min_frequency: int = C.key(2, R.at_least(1), "a word or piece must occur this often to enter the vocabulary")
    lowercase: bool = C.key(True, R.BOOL, "lowercase the texts before tokenizing")
    labels: list = C.key([], R.kind("a list of labels", list), "index -> label; filled in by training (or fixes "
                                                               "the order)")
    tokenizer: Optional[str] = C.key(None, R.optional(R.kind("a file path", str)),
                                     "a local tokenizer folder (transformers.AutoTokenizer) or a tokenizer.json; null: train "
                                     "a word-piece vocabulary (saved in the run directory)")

    def validate(self) -> None:
        if self.text_pair_column and self.max_length < 4:  # [CLS] text [SEP] pair [SEP]: room for a token
            raise C.ConfigError(f"config key 'text.max_length': must be at least 4, got {self.max_length}")


C.register_section("text", TextConfig)


class _Prepared:
    def __init__(self):
        self.records: dict[str, list[dict]] = {}
        self.tokenizer: Optional[TextTokenizer] = None
        self.summary: dict = {}


class TextClassificationRecipe(Recipe):
    name = "text-classification"
    description = ("BERT-style encoder on CSV / JSONL texts with a word-piece tokenizer trained on them; "
                   "embedded default: Python standard-library docstrings labelled by package")
    defaults = {
        "epochs": 12, "optim": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
        "scheduler": {"name": "warmup_cosine", "warmup_steps": 40}, "metrics": ["accuracy"],
        "clip_grad_norm": 1.0,
        "model": {"name": "bert", "options": {"hidden": 128, "layers": 2, "heads": 4}},
        "data": {"batch_size": 32, "val_fraction": 0.1},
        "checkpoint": {"monitor": "val/accuracy", "mode": "max"},
        "text": {"vocab_size": 6000, "max_length": 64},
    }

    def pack_refusal(self, cfg: C.Config) -> Optional[str]:
        return ("a text has one label, read from the encoder's first-token output of the whole sequence, so texts "
                "cannot share a row")

    def __init__(self):
        self._cache: dict[int, _Prepared] = {}

    # -------------------------------------------------------------------------------- data
    def _prepare(self, cfg: C.Config) -> _Prepared:
        if id(cfg) in self._cache:
            return self._cache[id(cfg)]
        tc, d = cfg.text, cfg.data
        prep = _Prepared()
        if d.path is None:
            prep.records = docstring_splits()
            source = "Python standard-library docstrings"
        else:
            prep.records["train"] = read_records(d.path, tc.text_column, tc.label_column, tc.text_pair_column,
                                                 key="data.path")
            for split, key, p in (("val", "data.val_path", d.val_path), ("test", "data.test_path", d.test_path)):
                if p is not None:
                    prep.records[split] = read_records(p, tc.text_column, tc.label_column, tc.text_pair_column,
                                                       key=key)
            if "val" not in prep.records and d.val_fraction > 0:
                train = prep.records["train"]
                keep, held = stratified_split([r["label"] for r in train], d.val_fraction)
                prep.records["val"] = [train[i] for i in held]
                prep.records["train"] = [train[i] for i in keep]
            source = str(d.path)
        self._labels(tc, prep.records, embedded=d.path is None)
        if tc.tokenizer:
            prep.tokenizer = self._load_tokenizer(cfg)
        else:
            texts = [r["text"] for r in prep.records["train"]]
            texts += [r["pair"] for r in prep.records["train"] if r.get("pair")]
            prep.tokenizer = train_wordpiece(texts, tc.vocab_size, tc.min_frequency, tc.lowercase)
        prep.summary = {"source": source, "labels": list(tc.labels), "vocab_size": len(prep.tokenizer),
                        "splits": {}}
        for split, records in prep.records.items():
            counts = Counter(r["label"] for r in records)
            top, n_top = counts.most_common(1)[0]
            prep.summary["splits"][split] = {"samples": len(records), "majority_label": top,
                                             "majority_baseline_accuracy": round(n_top / len(records), 4),
                                             "counts": dict(sorted(counts.items()))}
        shown = prep.summary["splits"].get("test") or prep.summary["splits"].get("val")
        say(f"torchrig: text data from {source}: " + ", ".join(f"{k} {v['samples']}" for k, v in
                                                              prep.summary["splits"].items())
            + f" · {len(tc.labels)} labels · vocabulary {len(prep.tokenizer)}"
            + (f" · majority-class baseline {shown['majority_baseline_accuracy']:.4f} ('{shown['majority_label']}')"
               if shown else ""))
        tc.tokenizer = TOKENIZER_FILE  # from now on (checkpoint config): the copy in the run dir
        self._cache[id(cfg)] = prep
        return prep

    @staticmethod
    def _labels(tc: TextConfig, records: dict[str, list[dict]], embedded: bool) -> None:
        """Fill in (or check) ``text.labels``: every label of every split must occur in training."""
        train_labels = sorted({r["label"] for r in records["train"]})
        if tc.labels:
            tc.labels = [str(x) for x in tc.labels]
            extra = [lab for lab in train_labels if lab not in tc.labels]
            if extra:
                raise RecipeError(f"training labels {extra} are not in text.labels {tc.labels}")
        else:
            tc.labels = train_labels
        if len(tc.labels) < 2:
            raise RecipeError(f"the training data has {len(tc.labels)} label(s) {tc.labels}; a classifier needs 2 or more "
                              f"(is text.label_column='{tc.label_column}' the right column?)")
        for split, rows in records.items():
            unknown = sorted({r["label"] for r in rows} - set(tc.labels))
            if unknown:
                where = "" if embedded else f" (line {next(r['line'] for r in rows if r['label'] in unknown)})"
                raise RecipeError(f"the {split} data has labels {unknown[:5]} that the training data does not "
                                  f"have{where}; every label must occur in training")

    @staticmethod
    def _tokenizer_path(cfg: C.Config) -> Path:
        p = Path(cfg.text.tokenizer or TOKENIZER_FILE)
        if not p.is_absolute() and (Path(cfg.run_dir) / p).exists():
            return Path(cfg.run_dir) / p
        return p

    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        prep = self._prepare(cfg)
        index = {lab: i for i, lab in enumerate(cfg.text.labels)}
        out = {}
        for split, records in prep.records.items():
            ids, mask, types = self._encode(cfg, prep.tokenizer, records)
            labels = torch.tensor([index[r["label"]] for r in records], dtype=torch.long)
            out[split] = TensorDataset(ids, mask, types, labels)  # (inputs…, target): the model gets 3 tensors
        return out

    @staticmethod
    def _encode(cfg: C.Config, tok: TextTokenizer, records: list[dict]):
        pairs = [r.get("pair") or "" for r in records] if cfg.text.text_pair_column else None
        return tok.encode_batch([r["text"] for r in records], pairs, cfg.text.max_length)

    # -------------------------------------------------------------------------------- model
    def _tokenizer(self, cfg: C.Config) -> TextTokenizer:
        if id(cfg) in self._cache or not cfg.text.tokenizer:
            return self._prepare(cfg).tokenizer
        return self._load_tokenizer(cfg)

    def _load_tokenizer(self, cfg: C.Config) -> TextTokenizer:
        """``text.tokenizer``: a folder for ``transformers.AutoTokenizer``, or a ``tokenizer.json`` (as a run saves)."""
        path = self._tokenizer_path(cfg)
        if path.is_dir():
            return TextTokenizer.from_folder(path)
        if not path.exists():
            saved = cfg.text.tokenizer == TOKENIZER_FILE
            raise RecipeError(f"tokenizer '{path}' not found: " + (
                f"predict / evaluate need the run directory the checkpoint came from (it holds {TOKENIZER_FILE})"
                if saved else "set text.tokenizer to a tokenizer folder or a tokenizer.json file"))
        return read_tokenizer(path)

    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        from ..models.text import build_text_model

        tok = self._tokenizer(cfg)
        if not cfg.text.labels:
            self._prepare(cfg)
        try:
            return build_text_model(cfg.model.name, len(tok), len(cfg.text.labels), cfg.text.max_length,
                                    cfg.model.options, pad_id=tok.pad_id)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None

    def trainer_kwargs(self, cfg: C.Config, data: dict) -> dict:
        def predict_fn(step, batch):
            with step.autocast():
                logits = step.model(*batch[:3])
            return step.activation(logits.float())  # predict(activation=...): softmax over the classes by default

        return {"predict_fn": predict_fn}

    def class_names(self, cfg: C.Config) -> Optional[list[str]]:
        return list(cfg.text.labels) or None

    def save_artifacts(self, cfg: C.Config, run_dir: Path) -> None:
        prep = self._prepare(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        prep.tokenizer.save(run_dir / TOKENIZER_FILE)
        write_atomic(run_dir / "data_summary.json", (json.dumps(prep.summary, indent=2) + "\n").encode(),
                     root=run_dir)

    # -------------------------------------------------------------------------------- predict
    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        """A CSV / TSV / JSONL file (the text column; labels not needed), a .txt file (one text per
        line) or a folder of .txt files (one text per file)."""
        tok = self._tokenizer(cfg)
        records, names = [], []
        if path.is_file() and path.suffix.lower() in (".csv", ".tsv", ".jsonl", ".ndjson", ".json"):
            for r in read_records(path, cfg.text.text_column, None, cfg.text.text_pair_column, key="input"):
                records.append(r)
                names.append(f"{path.name}:{r['line']}")
        else:
            files = input_files(path, (".txt",), "input")
            for f in files:
                try:
                    content = f.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    raise RecipeError(f"input '{f}' is not UTF-8 text") from None
                if path.is_file():
                    for i, line in enumerate(content.splitlines(), 1):
                        if line.strip():
                            records.append({"text": line, "pair": None})
                            names.append(f"{f.name}:{i}")
                else:
                    records.append({"text": content, "pair": None})
                    names.append(str(f.relative_to(path)))
        if not records:
            raise RecipeError(f"input '{path}' holds no text")
        ids, mask, types = self._encode(cfg, tok, records)
        return (ids, mask, types), names


def read_tokenizer(path: Path) -> TextTokenizer:
    """A ``tokenizer.json`` (a run's own, or ``text.tokenizer``'s): a regular file of at most TOKENIZER_LIMIT."""
    todo = "give the tokenizer.json of a torchrig run, or a tokenizer folder"
    data = read_regular(path, TOKENIZER_LIMIT, "tokenizer file", todo, DataError)
    return TextTokenizer.from_json(data, f"tokenizer file '{path}'", todo)
