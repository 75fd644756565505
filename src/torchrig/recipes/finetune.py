"""``finetune``: LoRA fine-tuning of a Hugging Face model on the text recipes' data, adapters on by default.

``finetune.task: causal-lm`` (the default) trains a causal language model on the language-model recipe's data:
documents tokenized, joined and packed into sequences of ``lm.block_size`` tokens (``lm.*`` keys);
``classification`` trains a sequence classifier on the text-classification recipe's labelled texts (``text.*``
keys), its head trained in full beside the adapters (``peft.modules_to_save``). Without ``data.path`` both take
the embedded Python standard-library docstrings.

The model is GPT-2 built from its config (``GPT2Config(**model.options)``, random weights: nothing is downloaded)
with the data's vocabulary, or ``finetune.base``: a local Hugging Face model folder, or the name of a model already
in the local Hugging Face cache (``from_pretrained(..., local_files_only=True)``), whose own tokenizer the data then
uses. ``peft.method: lora`` (rank 8 on every Linear-like layer but the output layer) is the recipe's default: the
summary lists what trains and what is frozen, and checkpoints hold the adapters (``docs/finetuning.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset

from .. import config as C
from ..config import rules as R
from ..models.hub import no_progress_bars
from .base import Recipe, RecipeError
from .common import say
from .lm import NO_DROPOUT, LanguageModelRecipe
from .text import TextClassificationRecipe

TASKS = ("causal-lm", "classification")
HEADS = ("score", "classifier")  # a Hugging Face sequence classifier's output layer (GPT-2's, BERT's)


@dataclass
class FinetuneConfig:
    """What the finetune recipe trains: the task and the base model."""

    task: str = C.key("causal-lm", R.choice(*TASKS), "causal-lm: next-token prediction on packed sequences (lm.*); "
                                                      "classification: labelled texts (text.*)")
    base: Optional[str] = C.key(None, R.optional(R.kind("a folder or a model name", str)),
                                "a local Hugging Face model folder, or a model name in the local Hugging Face cache "
                                "(nothing is downloaded); null: GPT-2 built from model.options, random weights")


C.register_section("finetune", FinetuneConfig)


class Labelled(Dataset):
    """The text recipe's tensors as ``{"input_ids", "attention_mask", "labels"}`` samples (a Hugging Face
    classifier's keywords; ``labels`` is left out for prediction)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, labels: Optional[torch.Tensor] = None):
        self.ids, self.mask, self.labels = ids, mask, labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        out = {"input_ids": self.ids[i], "attention_mask": self.mask[i]}
        if self.labels is not None:
            out["labels"] = self.labels[i]
        return out


class FinetuneRecipe(Recipe):
    name = "finetune"
    description = ("LoRA fine-tuning (peft) of a Hugging Face model, GPT-2 from a config or a local folder: causal "
                   "LM on packed text or sequence classification; embedded default: standard-library docstrings")
    defaults = {
        "epochs": 2, "optim": {"name": "adamw", "lr": 2e-3}, "clip_grad_norm": 1.0, "loss": "auto", "metrics": [],
        "scheduler": {"name": "warmup_cosine", "warmup_steps": 10},
        "model": {"name": "gpt2", "options": {"n_layer": 2, "n_embd": 64, "n_head": 4}},
        "data": {"batch_size": 16, "val_fraction": 0.1},
        "peft": {"method": "lora", "r": 8, "alpha": 16.0},
        "lm": {"block_size": 64}, "text": {"max_length": 64, "vocab_size": 4000},
    }

    def __init__(self):
        self._lm, self._text = LanguageModelRecipe(), TextClassificationRecipe()

    def _causal(self, cfg: C.Config) -> bool:
        self._use_base_tokenizer(cfg)
        return cfg.finetune.task == "causal-lm"

    def pack_refusal(self, cfg: C.Config) -> Optional[str]:
        return None if cfg.finetune.task == "causal-lm" else self._text.pack_refusal(cfg)

    @staticmethod
    def _use_base_tokenizer(cfg: C.Config) -> None:
        """A base model of its own brings its vocabulary: the data is tokenized with its tokenizer."""
        base = cfg.finetune.base
        if base is None or not Path(base).is_dir():
            return
        if cfg.finetune.task == "classification" and not cfg.text.tokenizer:
            cfg.text.tokenizer = base  # a folder: transformers.AutoTokenizer
        elif cfg.finetune.task == "causal-lm" and not cfg.lm.tokenizer:
            if not (Path(base) / "tokenizer.json").is_file():
                raise RecipeError(f"config key 'finetune.base': '{base}' holds no tokenizer.json, which the data "
                                  f"must be tokenized with; set lm.tokenizer to the base model's tokenizer.json")
            cfg.lm.tokenizer = str(Path(base) / "tokenizer.json")

    # -------------------------------------------------------------------------------- data
    def build_data(self, cfg: C.Config) -> dict[str, Any]:
        if self._causal(cfg):
            tok = self._lm._tokenizer(cfg)
            if tok.tokenizer.token_to_id("[SEP]") is None:  # what joins the documents of the packed sequences
                raise RecipeError(f"the tokenizer {cfg.lm.tokenizer or ''} has no [SEP] token, which joins the "
                                  f"documents packed into sequences; give lm.tokenizer a word-piece tokenizer.json "
                                  f"(one a torchrig run saved, or exported with its model by torchrig export)")
            return self._lm.build_data(cfg)
        out = {}
        for split, data in self._text.build_data(cfg).items():
            ids, mask, _, labels = data.tensors
            out[split] = Labelled(ids, mask, labels)
        return out

    # -------------------------------------------------------------------------------- model
    def build_model(self, cfg: C.Config) -> torch.nn.Module:
        causal = self._causal(cfg)
        if cfg.finetune.base is None and causal:
            model = self._lm.build_model(cfg)  # GPT-2 from model.options, the data's vocabulary
        else:
            model = self._pretrained(cfg) if cfg.finetune.base is not None else self._classifier(cfg)
        vocabulary = len(self._lm._tokenizer(cfg) if causal else self._text._tokenizer(cfg))
        rows = model.get_input_embeddings().num_embeddings
        if vocabulary > rows:
            raise RecipeError(f"config key 'finetune.base': the model has {rows} token embeddings, fewer than the "
                              f"{vocabulary} tokens of its tokenizer; give the tokenizer the model was trained with")
        if hasattr(getattr(model, "config", None), "use_cache"):
            model.config.use_cache = False  # no key/value cache in the outputs: training needs none, torch.export none
        if not causal and cfg.peft.method is not None and not cfg.peft.modules_to_save:
            head = next((h for h in HEADS if hasattr(model, h)), None)
            if head is not None:  # a new head for these labels trains in full, beside the adapters
                cfg.peft.modules_to_save = [head]
                say(f"torchrig: finetune: the classifier head '{head}' trains in full (peft.modules_to_save)")
        return model

    def _classifier(self, cfg: C.Config) -> torch.nn.Module:
        try:
            from transformers import GPT2Config, GPT2ForSequenceClassification
        except ImportError:
            raise RecipeError('the finetune recipe builds Hugging Face models; pip install "torchrig[finetune]"') \
                from None
        tok = self._text._tokenizer(cfg)
        if not cfg.text.labels:
            self._text._prepare(cfg)
        options = {**NO_DROPOUT, **dict(cfg.model.options or {})}
        try:
            config = GPT2Config(vocab_size=len(tok), n_positions=cfg.text.max_length, num_labels=len(cfg.text.labels),
                                pad_token_id=tok.pad_id, bos_token_id=tok.pad_id, eos_token_id=tok.pad_id, **options)
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"config key 'model.options': GPT2Config does not take {options} "
                              f"({str(exc).splitlines()[0]})") from None
        return GPT2ForSequenceClassification(config)

    def _pretrained(self, cfg: C.Config) -> torch.nn.Module:
        """``finetune.base`` through ``from_pretrained``, from local files only."""
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        base, causal = cfg.finetune.base, cfg.finetune.task == "causal-lm"
        if not causal and not cfg.text.labels:
            self._text._prepare(cfg)
        extra = {} if causal else {"num_labels": len(cfg.text.labels)}
        try:
            cls = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
            with no_progress_bars():
                return cls.from_pretrained(base, local_files_only=True, **extra)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RecipeError(f"config key 'finetune.base': '{base}' is not a Hugging Face model folder nor a model "
                              f"in the local cache ({first[:200]}); nothing is downloaded: give a local folder") \
                from None

    # -------------------------------------------------------------------------------- the rest, by task
    def class_names(self, cfg: C.Config) -> Optional[list[str]]:
        return None if cfg.finetune.task == "causal-lm" else self._text.class_names(cfg)

    def save_artifacts(self, cfg: C.Config, run_dir: Path) -> None:
        (self._lm if self._causal(cfg) else self._text).save_artifacts(cfg, run_dir)

    def load_inputs(self, cfg: C.Config, path: Path) -> tuple[Any, list[str]]:
        if self._causal(cfg):
            return self._lm.load_inputs(cfg, path)
        (ids, mask, _), names = self._text.load_inputs(cfg, path)
        return Labelled(ids, mask), names

    def write_predictions(self, cfg: C.Config, outputs: Any, names: list[str], out: Path, topk: int = 5) -> None:
        if self._causal(cfg):
            return self._lm.write_predictions(cfg, outputs, names, out, topk)
        return super().write_predictions(cfg, outputs, names, out, topk)
