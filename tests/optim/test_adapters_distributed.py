"""LoRA on two gloo processes: under DDP it equals one process with the global batch (1e-6), under FSDP2 the frozen
base is sharded and never given a gradient; a run stopped mid-epoch resumes bitwise under both."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import HELPERS, dist_procs

import torchrig

pytest.importorskip("peft")
pytest.importorskip("transformers")


@pytest.mark.slow
def test_lora_under_ddp_and_fsdp2_two_ranks(tmp_path):
    from helpers.finetune_worker import full, gpt2, settings, tokens

    results = dist_procs.pair("lora", tmp_path, tmp_path / "store", timeout=400, worker=HELPERS / "finetune_worker.py")
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
    model = gpt2()
    torchrig.Trainer(model, **settings(tmp_path / "one", batch_size=4)).fit(tokens())  # one process, the global batch
    one = full(model, True)
    checks = json.loads((tmp_path / "checks.json").read_text())
    for strategy in ("ddp", "fsdp"):
        runs = torch.load(tmp_path / f"{strategy}.pt")
        assert runs["whole"].keys() == one.keys() and len(one) == 16
        assert max((runs["whole"][k] - one[k]).abs().max().item() for k in one) <= 1e-6, strategy
        assert all(torch.equal(runs["whole"][k], runs["resumed"][k]) for k in one), strategy  # bitwise
        c = checks[strategy]
        assert c["base_unchanged"] and c["frozen_grads"] == 0 and c["resumed_at"] == "step-00000003", (strategy, c)
        assert c["saved"] == c["trainable"] and c["sharded"] == (strategy == "fsdp"), (strategy, c)
