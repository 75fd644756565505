"""Tiny Hugging Face models and token data, and a 2-rank DDP run of them (started in pairs by pytest).

    python tests/helpers/hf_worker.py ddp OUT   # file:// pair (TEST_INIT, TEST_RANK, TEST_WORLD): fit, evaluate, predict

The models are built from ``transformers`` config objects (random weights, no download): hidden 32,
2 layers, vocabulary 100, sequences of 16 tokens; dropout is off so that two ranks can match one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

VOCAB, SEQ = 100, 16
QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False}


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def classification_data(n: int, seed: int = 0) -> list[dict]:
    """Token sequences labelled by whether their first token is below the middle of the vocabulary."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
             "labels": torch.tensor(int(ids[i, 0] < VOCAB // 2))} for i in range(n)]


def lm_data(n: int, seed: int = 0) -> list[dict]:
    """Counting sequences (start, start+1, …) mod the vocabulary: a next token a tiny model learns fast."""
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(SEQ)) % VOCAB
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="adamw", lr=1e-3, epochs=1, batch_size=4, seed=0, threads=1, run_dir=str(run_dir),
              **QUIET, **{"checkpoint.every_epochs": 0, "checkpoint.save_final": False})
    kw.update(extra)
    return kw


def params(model) -> dict:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def ddp(out: Path) -> None:
    from torchrig import Trainer

    dist = {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
            "world_size": int(os.environ["TEST_WORLD"]), "strategy": "ddp"}
    results, trainers = {}, []
    for name, build, data, metrics in (("bert", bert, classification_data, ["accuracy"]),
                                       ("gpt2", gpt2, lm_data, [])):
        t = Trainer(build(), **settings(out / name, metrics=metrics, **dist))
        trainers.append(t)  # the first one owns the process group: closed last
        t.fit(data(32))
        results[name] = {"params": params(t.model), "eval": t.evaluate(data(13, seed=1)),
                         "predict": t.predict(data(13, seed=1)), "steps": t.global_step}
    if int(os.environ["TEST_RANK"]) == 0:
        torch.save(results, out / "ddp.pt")
    trainers[0].close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"ddp": ddp}[sys.argv[1]](target)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done and closed: skip the interpreter's teardown of transformers (seconds)
